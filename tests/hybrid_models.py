"""Tiny random-weight hybrid models for the serving tests (engine and services): one Gated DeltaNet
family (Qwen3-Next: linear attention 2 of every 3 layers, MoE with a shared expert) and one Mamba2
family (Nemotron-H: Mamba2, attention, MLP and MoE blocks), written by transformers' own config and
model classes with the embedded model's tokenizer, so `pdserve` serves them like any checkpoint.
The per-family oracle tests live in tests/engine/test_hybrid_gdn.py and test_hybrid_mamba.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 256
CONFIGS = {  # model_type -> (transformers config class, fields)
    "qwen3_next": ("Qwen3NextConfig", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, full_attention_interval=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2)),
    "nemotron_h": ("NemotronHConfig", dict(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        max_position_embeddings=2048, hybrid_override_pattern="M*-M", chunk_size=64, bos_token_id=1,
        eos_token_id=2)),
}


def hf_model(kind: str):  # noqa: ANN201
    """transformers' model of `kind` in eval mode: matrices N(0, 0.15) from a fixed seed, the recurrent
    layers' own parameters (A_log, dt_bias, D, norms) as transformers initialises them."""
    import transformers

    cls, fields = CONFIGS[kind]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**fields),
                                                          attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model


def write_hybrid(kind: str, dst: Path):  # noqa: ANN201
    """An HF directory of `kind` at `dst` (fp32 safetensors, the embedded model's tokenizer); returns the
    transformers model (the oracle)."""
    from engine.models.embedded import resolve_model_path

    model = hf_model(kind)
    model.save_pretrained(dst)
    src = resolve_model_path("embedded")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return model
