"""The combination matrix's tiny random-weight models, one per family kind: dense GQA (Llama), sliding window
(Mistral), MoE (Qwen2-MoE, shared expert), MLA (DeepSeek-V3) and hybrid (Qwen3-Next: Gated DeltaNet).

Every model has the embedded model's tokenizer and its 49,152-token vocabulary (a grammar needs a tokenizer
whose vocabulary fits the logits), 2-3 layers of hidden size 64, 4 query heads and 2 KV heads (TP 2 splits
them), weights N(0, 0.2) so a wrong layer moves the argmax, written once into a directory the engine loads
like any checkpoint.

Text from a random model over 49k tokens never repeats itself, so n-gram speculation (prompt lookup) would
find nothing to propose: the output head's rows outside `ACTIVE` (128 ordinary tokens) are scaled down 20x,
so greedy tokens come from those 128 (still chosen by the whole network: a wrong layer still moves the
argmax) and the matrix's prompts are drawn from them too, as real text reuses its words."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 49152
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
ACTIVE = range(1000, 1128)  # the token ids the output head favours (and the matrix's prompts use)
OUTSIDE_SCALE = 0.05  # the output head's other rows, so they never win the argmax (yet never tie)
KINDS = ("dense", "sliding", "moe", "mla", "hybrid")
TITLES = {"dense": "dense GQA (Llama)", "sliding": "sliding window (Mistral, window 8)",
          "moe": "MoE (Qwen2-MoE, shared expert)", "mla": "MLA (DeepSeek-V3)",
          "hybrid": "hybrid (Qwen3-Next, Gated DeltaNet)"}


def _config(kind: str):  # noqa: ANN202 - a transformers config
    import transformers

    if kind == "dense":
        return transformers.LlamaConfig(**COMMON, intermediate_size=128, num_hidden_layers=2)
    if kind == "sliding":
        return transformers.MistralConfig(**COMMON, intermediate_size=128, num_hidden_layers=2, sliding_window=8)
    if kind == "moe":
        return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48)
    if kind == "mla":
        return transformers.DeepseekV3Config(
            **(COMMON | {"num_key_value_heads": 4}), intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32,
            q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
            routed_scaling_factor=2.5, n_group=2, topk_group=1, num_nextn_predict_layers=0)
    if kind == "hybrid":
        return transformers.Qwen3NextConfig(
            **COMMON, num_hidden_layers=3, full_attention_interval=3, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
            num_experts_per_tok=2)
    raise ValueError(f"unknown model kind {kind!r} (one of {KINDS})")


def write_model(kind: str, dst: Path) -> Path:
    """A random-weight HF directory of `kind` at `dst` (fp32 safetensors + the embedded model's tokenizer):
    matrices N(0, 0.2) from a fixed seed, norms in [0.5, 1.5], the recurrent layers' own parameters as
    transformers initialises them; the output head's rows outside ACTIVE scaled by OUTSIDE_SCALE."""
    from transformers import AutoModelForCausalLM

    from engine.models.embedded import resolve_model_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)
            elif p.dim() > 1 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        head = model.get_output_embeddings().weight
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[ACTIVE.start:ACTIVE.stop] = True
        head[~keep] *= OUTSIDE_SCALE
    model.save_pretrained(dst)
    src = resolve_model_path("embedded")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst
