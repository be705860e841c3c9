"""Quantized checkpoints as they ship (issue 49, first part): block FP8 and compressed-tensors INT4/INT8
directories loaded low-bit (engine/models/quant.py).

Each directory is a random-weight transformers model (fp32) whose decoder linears (attention, MLP,
experts, MLA projections) this test quantizes: to float8_e4m3fn with an fp32 `weight_scale_inv` per
block (`quantization_config: {quant_method: fp8, weight_block_size, activation_scheme: dynamic}`), or to
compressed-tensors `pack-quantized` int4 / int8 (packed by compressed-tensors' own helper; group or
channel scales, symmetric or with zero points). The router, norms, embeddings and LM head stay fp32, as
the real checkpoints ship them. The oracle is transformers loading the same directory with
`FineGrainedFP8Config(dequantize=True)` or `CompressedTensorsConfig(run_compressed=False)`: the same
dequantized weights bit for bit, teacher-forced logits within 1e-3, 16 greedy tokens identical.
Qwen3 FP8 with DeepSeek's 128x128 blocks (q/k/v and gate/up fused across block boundaries);
DeepSeek-V3 (MLA + MoE) FP8 with 16x16 blocks, so that every one of its small matrices spans several
blocks (transformers derives the block from the scale grid, which needs each dimension a multiple of the
block). Also: the quantized weights' bytes (fp8 at 128x128 blocks: under 0.26 of fp32's), a partial
edge block (DeepSeek-V3's kv_a is 576 rows = 4.5 blocks) against a direct reference, and what is
refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, ModelConfig
from engine.engine import LLM
from engine.models.loader import load_model
from engine.models.quant import QuantTensor, quantized_modules
from engine.sampling.params import SamplingParams
from tests.hf_oracle import hf_greedy

CHUNK = 64
LENGTHS = (7, 40, 150)
QUANTIZED = ("proj.weight", "proj_with_mqa.weight")  # suffixes of the decoder linears a real checkpoint quantizes
FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] fp32 -> (float8_e4m3fn [out, in], scale_inv fp32 [ceil(out/bo), ceil(in/bi)]): each block
    scaled so its largest magnitude maps to the fp8 maximum (DeepSeek's recipe); w ~ fp8 * scale per block."""
    out, cols = w.shape
    go, gi = -(-out // block[0]), -(-cols // block[1])
    padded = torch.zeros(go * block[0], gi * block[1])
    padded[:out, :cols] = w
    blocks = padded.view(go, block[0], gi, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(go * block[0], gi * block[1])
    return q[:out, :cols].contiguous(), scale.float()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The direct reference: every element times its block's scale."""
    out, cols = q.shape
    s = scale.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :cols]
    return q.float() * s


def make_fp8_dir(path: Path, block: tuple[int, int]) -> Path:
    """Rewrite the fp32 HF directory at `path` as a block-FP8 checkpoint, in place."""
    f = next(path.glob("*.safetensors"))
    tensors, out = load_file(str(f)), {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith(QUANTIZED) and ".mlp.gate." not in name:
            out[name], out[name + "_scale_inv"] = quantize_fp8(t, block)
        else:
            out[name] = t
    save_file(out, str(f), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def quantize_int(w: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> dict[str, torch.Tensor]:
    """w [out, in] fp32 -> compressed-tensors pack-quantized tensors (weight_packed, weight_scale,
    weight_shape, weight_zero_point when asymmetric), packed by compressed-tensors' own helper. group None:
    one scale per output channel."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, cols = w.shape
    g = w.view(out, -1, group or cols)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if symmetric:
        scale, zero = g.abs().amax(-1) / qmax, None
        q = torch.round(g / scale[..., None]).clamp(qmin, qmax)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / (qmax - qmin)
        zero = torch.round(qmin - lo / scale).clamp(qmin, qmax)
        q = torch.round(g / scale[..., None] + zero[..., None]).clamp(qmin, qmax)
    t = {"weight_packed": pack_to_int32(q.reshape(out, cols).to(torch.int8), bits), "weight_scale": scale.float(),
         "weight_shape": torch.tensor([out, cols])}
    if zero is not None:
        t["weight_zero_point"] = pack_to_int32(zero.to(torch.int8), bits, packed_dim=0)
    return t


def make_int_dir(path: Path, bits: int, group: int | None, symmetric: bool) -> Path:
    """Rewrite the fp32 HF directory at `path` as a compressed-tensors pack-quantized checkpoint, in place."""
    f = next(path.glob("*.safetensors"))
    tensors, out = load_file(str(f)), {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith(QUANTIZED) and ".mlp.gate." not in name:
            out |= {name[: -len("weight")] + k: v for k, v in quantize_int(t, bits, group, symmetric).items()}
        else:
            out[name] = t
    save_file(out, str(f), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group" if group else "channel",
               "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax"}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "quantization_status": "compressed", "kv_cache_scheme": None,
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                "input_activations": None,
                                                                "output_activations": None}},
                                  "ignore": ["lm_head", "re:.*mlp.gate$"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def hf_quantized(path: Path):  # noqa: ANN201
    """transformers' model of the quantized directory, dequantized at load (fp32 compute): the oracle."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    method = json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]
    qc = FineGrainedFP8Config(dequantize=True) if method == "fp8" else CompressedTensorsConfig(run_compressed=False)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _qwen3_config():  # noqa: ANN202
    from transformers import Qwen3Config

    return Qwen3Config(num_hidden_layers=2, hidden_size=128, intermediate_size=256, head_dim=32,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _deepseek_config():  # noqa: ANN202
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                            q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32,
                            n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1, n_shared_experts=1,
                            routed_scaling_factor=2.5, n_group=4, topk_group=2, num_nextn_predict_layers=0,
                            max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)


# name -> (transformers config, rewrite as quantized, bytes per weight in memory: values + scales (+ zeros))
CASES = {
    "qwen3-fp8": (_qwen3_config, lambda p: make_fp8_dir(p, (128, 128)), 1 + 4 / 128),
    "deepseek_v3-fp8": (_deepseek_config, lambda p: make_fp8_dir(p, (16, 16)), 1 + 4 / 16),
    "qwen3-int4-asym-g32": (_qwen3_config, lambda p: make_int_dir(p, 4, 32, False), 0.5 + 5 / 32),
    "qwen3-int8-channel": (_qwen3_config, lambda p: make_int_dir(p, 8, None, True), None),
    "deepseek_v3-int4-g16": (_deepseek_config, lambda p: make_int_dir(p, 4, 16, True), 0.5 + 4 / 16),
}


@pytest.fixture(scope="module", params=list(CASES))
def quant_model(request, hf_checkpoint):
    make_config, rewrite, _ = CASES[request.param]
    cfg = make_config()
    path, _ = hf_checkpoint(cfg, request.param)
    rewrite(path)
    llm = LLM(EngineConfig(model=str(path), max_total_tokens=2048, page_size=16, chunked_prefill_size=CHUNK,
                           threads=1))
    return request.param, path, hf_quantized(path), llm, cfg.vocab_size


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def test_the_oracle_runs_the_same_weights(quant_model):
    """transformers' dequantized weights equal ours bit for bit (FP8: also fp8 * block scale directly)."""
    name, path, hf, llm, _ = quant_model
    key = "model.layers.0.self_attn.o_proj.weight"
    ours = llm.runner.model.layers[0].self_attn.o_proj.weight_quant.dequant()
    assert torch.equal(hf.get_parameter(key).detach(), ours)
    if name.endswith("fp8"):
        block = tuple(json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"])
        tensors = load_file(str(next(path.glob("*.safetensors"))))
        assert torch.equal(ours, dequantize_fp8(tensors[key], tensors[key + "_scale_inv"], block))


def test_teacher_forced_logits_match_transformers(quant_model):
    name, _, hf, llm, vocab = quant_model
    worst = {}
    for ids in _prompts(vocab):
        ours = llm.prompt_logits(ids, chunk=CHUNK)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ref.abs().max() > 1.0
        worst[len(ids)] = (ours - ref).abs().max().item()
    assert max(worst.values()) < 1e-3, f"{name}: max abs logit diff by prompt length {worst}"


def test_greedy_matches_transformers(quant_model):
    _, _, hf, llm, vocab = quant_model
    prompts = _prompts(vocab)[:2]
    want = hf_greedy(hf, prompts, 16)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    assert [c.output_ids for c in llm.generate(prompts, greedy)] == want
    assert llm.scheduler.kv.all_free()


def test_weights_stay_low_bit(quant_model):
    """Every decoder linear (and expert stack, and MLA's kv_b) holds fp8 bytes plus per-(row, block) scales:
    about a quarter of fp32's bytes; no full-precision copy of them is left in the model."""
    name, _, _, llm, _ = quant_model
    model = llm.runner.model
    quants = quantized_modules(model)
    scheme = name.split("-")[1]
    want_dtype = torch.float8_e4m3fn if scheme == "fp8" else torch.uint8
    assert quants and all(q.qdata.dtype == want_dtype and q.scheme == scheme for _, q in quants)
    low = sum(q.nbytes() for _, q in quants)
    fp32 = sum(q.shape.numel() * 4 for _, q in quants)
    per_weight = CASES[name][2]  # e.g. fp8: 1 byte + one fp32 scale per row and block of columns
    if per_weight is not None:
        assert abs(low / fp32 - per_weight / 4) < 0.01, (low, fp32)
    else:  # int8 per channel: 1 byte + one scale per row
        assert 0.25 < low / fp32 < 0.26, (low, fp32)
    if name == "qwen3-fp8":  # the shipped block: about a quarter of fp32
        assert low / fp32 < 0.26
    names = {n for n, _ in quants}
    want = {"layers.0.self_attn.qkv_proj.weight_quant", "layers.0.mlp.gate_up_proj.weight_quant"} \
        if name.startswith("qwen3") \
        else {"layers.0.self_attn.q_b_proj.weight_quant", "layers.0.self_attn.kv_b_quant", "layers.1.mlp.w13_quant",
              "layers.1.mlp.w2_quant", "layers.1.mlp.shared_expert.down_proj.weight_quant"}
    assert want <= names, sorted(names)
    for n, p in model.layers.named_parameters():  # what a quantized weight replaced is empty
        if f"{n.rsplit('.', 1)[0]}.{n.rsplit('.', 1)[1]}_quant" in names:
            assert p.numel() == 0, n
    router = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]  # fp32 as shipped (oneDNN-packed)
    assert all(getattr(m, "weight_quant", None) is None and m.packed is not None for m in router)
    assert model.lm_packed is not None  # the LM head too


def test_partial_edge_blocks_dequantize_exactly():
    """A weight whose sizes are not multiples of the block (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows):
    the edge blocks' scales cover only what is there; rows fused and permuted keep their scales."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(72, 40, generator=g)
    q, s = quantize_fp8(w, (32, 16))
    qt = QuantTensor.from_fp8("w", q, s, (32, 16))
    ref = dequantize_fp8(q, s, (32, 16))
    assert torch.equal(qt.dequant(), ref)
    perm = torch.randperm(72, generator=g)
    assert torch.equal(QuantTensor.cat([qt.rows(50, 72), qt.rows(0, 50)]).dequant(), torch.cat([ref[50:], ref[:50]]))
    assert torch.equal(qt.permute_rows(perm).dequant(), ref[perm])
    x = torch.randn(3, 40, generator=g)
    assert torch.allclose(qt.linear(x), x @ ref.T, atol=1e-5)


def _tiny_fp8(tmp_path: Path, **config: object) -> Path:
    from tests.tiny_model import make_tiny_model

    path = make_fp8_dir(make_tiny_model(tmp_path / "m"), (128, 128))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] |= config
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("change,field", [
    ({"quant_method": "awq"}, "quantization_config.quant_method"),
    ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method"),
    ({"activation_scheme": "static"}, "quantization_config.activation_scheme"),
    ({"weight_block_size": None}, "quantization_config.weight_block_size"),
    ({"fmt": "e5m2"}, "quantization_config.fmt"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "quantization_config.kv_cache_scheme"),
])
def test_unsupported_fp8_configs_are_refused_by_name(tmp_path, change, field):
    path = _tiny_fp8(tmp_path, **change)
    cfg = ModelConfig.from_dir(path)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_model(path, cfg, "float32", "cpu", 64)


@pytest.mark.parametrize("change,field", [
    ({"format": "marlin-24"}, "quantization_config.format"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "quantization_config.kv_cache_scheme"),
    ({"input_activations": {"num_bits": 8, "type": "int"}}, "config_groups.group_0.input_activations"),
    ({"num_bits": 2}, "config_groups.group_0.weights.num_bits"),
    ({"type": "float"}, "config_groups.group_0.weights.type"),
    ({"actorder": "group"}, "config_groups.group_0.weights.actorder"),
    ({"strategy": "tensor"}, "config_groups.group_0.weights.strategy"),
])
def test_unsupported_compressed_tensors_configs_are_refused_by_name(tmp_path, change, field):
    from tests.tiny_model import make_tiny_model

    path = make_int_dir(make_tiny_model(tmp_path / "m"), 4, 32, True)
    cfg = json.loads((path / "config.json").read_text())
    qc, group = cfg["quantization_config"], cfg["quantization_config"]["config_groups"]["group_0"]
    for key, value in change.items():
        if key in ("format", "kv_cache_scheme"):
            qc[key] = value
        elif key == "input_activations":
            group[key] = value
        else:
            group["weights"][key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_model(path, ModelConfig.from_dir(path), "float32", "cpu", 64)


def test_a_loaded_tiny_quant_model_and_refusals(tmp_path):
    """The tiny Llama (tied embeddings) loads; without its quantization_config the scales are named as
    quantization tensors, not 'unexpected weights'; TP over quantized weights is refused."""
    from engine.distributed.tp import TPGroup

    path = _tiny_fp8(tmp_path)
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, "float32", "cpu", 64)
    assert len(quantized_modules(model)) == cfg.num_layers * 4  # qkv, o, gate_up, down per layer
    with pytest.raises(ValueError, match="tensor parallelism"):
        load_model(path, cfg, "float32", "cpu", 64, tp=TPGroup(rank=0, size=2))
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="no 'quantization_config'"):
        load_model(path, cfg, "float32", "cpu", 64)


def test_lora_over_a_quantized_checkpoint_is_refused(tmp_path):
    """LoRA's batched deltas read full-precision weights: refused at start-up, by name, not a wrong answer."""
    from engine.forward.model_runner import ModelRunner

    path = _tiny_fp8(tmp_path)
    with pytest.raises(ValueError, match="LoRA adapters .* over a quantized checkpoint"):
        ModelRunner(EngineConfig(model=str(path), max_total_tokens=256, max_loaded_loras=1, threads=1))
