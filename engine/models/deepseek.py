"""DeepSeek-V2 / V3 (model_type deepseek_v2, deepseek_v3), as transformers' DeepseekV2/V3ForCausalLM:
multi-head latent attention (engine/models/deepseek_mla.py) over a latent KV pool, the first
`first_k_dense_replace` layers with a dense SwiGLU MLP, the rest MoE (engine/models/moe.py) with
`n_shared_experts` ungated shared experts and DeepSeek routing: V2 softmax scores, greedy or
group-limited (`topk_method`), V3 sigmoid scores plus e_score_correction_bias for the choice, top-k
within the `topk_group` best of `n_group` groups, renormalised per `norm_topk_prob`; both scaled by
`routed_scaling_factor`.

Rope covers the qk_rope_head_dim dims only (ModelConfig.head_dim is set to it); DeepSeek's checkpoints
lay those dims out in interleaved (x0, x1) pairs (V2 always, V3 when `rope_interleave`): the loader
permutes the rope rows of q (q_proj / q_b_proj) and of kv_a_proj_with_mqa to (evens | odds), after which
the ordinary rotate-half rope gives the same q.k as transformers. The softmax scale is
1/sqrt(qk_nope + qk_rope), times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is YaRN.

Multi-token-prediction layers (`num_nextn_predict_layers` > 0: checkpoint layers numbered from
num_hidden_layers) are not run: their weights are skipped with a log line.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping

import torch

from engine.config import MLASpec, ModelConfig, MoESpec
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.checkpoint import Checkpoint, Weight, cols, dense_mlp_weights, permute_rows, rows, shell_weights
from engine.models.deepseek_mla import MLAAttention
from engine.models.moe import MoECausalLM, block_weights
from engine.models.rope import _yarn_mscale, rope_type

log = logging.getLogger(__name__)

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _int(raw: dict, key: str, default: object = None, minimum: int = 1) -> int:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"config.json field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _mla(raw: dict, scaling: dict | None) -> MLASpec:
    nope, rope = _int(raw, "qk_nope_head_dim"), _int(raw, "qk_rope_head_dim")
    if rope % 2:
        raise ValueError(f"config.json field 'qk_rope_head_dim' must be even, got {rope}")
    scale = (nope + rope) ** -0.5
    if rope_type(scaling) == "yarn" and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    interleave = True if raw.get("model_type") == "deepseek_v2" else bool(raw.get("rope_interleave", True))
    return MLASpec(q_lora_rank=0 if raw.get("q_lora_rank") is None else _int(raw, "q_lora_rank"),
                   kv_lora_rank=_int(raw, "kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                   v_head_dim=_int(raw, "v_head_dim"), softmax_scale=scale, rope_interleave=interleave)


def _routing(raw: dict, v3: bool, experts: int) -> dict:
    """MoESpec's routing fields; a combination transformers does not run (or runs otherwise) -> ValueError."""
    want = "sigmoid" if v3 else "softmax"
    if raw.get("scoring_func", want) != want:
        raise ValueError(f"config.json field 'scoring_func' ({raw['scoring_func']!r}) is not supported for "
                         f"{raw.get('model_type')} (only {want})")
    method = raw.get("topk_method", "noaux_tc" if v3 else "greedy")
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"config.json field 'topk_method' ({method!r}) is not supported (greedy, "
                         "group_limited_greedy)")
    if not v3 and raw.get("norm_topk_prob"):
        raise ValueError("config.json field 'norm_topk_prob' (true) is not supported for deepseek_v2 "
                         "(transformers' V2 router never renormalises)")
    grouped = v3 or method == "group_limited_greedy"
    n_group = _int(raw, "n_group", 1) if grouped and raw.get("n_group") is not None else 1
    topk_group = _int(raw, "topk_group", 1) if grouped and raw.get("topk_group") is not None else n_group
    if experts % n_group or topk_group > n_group or (v3 and n_group > 1 and experts // n_group < 2):
        raise ValueError(f"config.json field 'n_group' ({n_group}) must divide n_routed_experts ({experts}) "
                         f"into groups of >= 2 and be >= topk_group ({topk_group})")
    rsf = raw.get("routed_scaling_factor", 1.0)
    if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or rsf <= 0:
        raise ValueError(f"config.json field 'routed_scaling_factor' must be a positive number, got {rsf!r}")
    return dict(scoring=want, n_group=n_group, topk_group=topk_group, routed_scaling_factor=float(rsf),
                score_bias=v3, shared_gate=False, norm_topk_prob=v3 and bool(raw.get("norm_topk_prob", True)))


def _moe(raw: dict, layers: int) -> MoESpec:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json field 'hidden_act' ({raw['hidden_act']!r}) is not supported (silu only)")
    if raw.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json field 'moe_layer_freq' ({raw['moe_layer_freq']!r}) is not supported (1)")
    experts, top_k = _int(raw, "n_routed_experts"), _int(raw, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"config.json field 'num_experts_per_tok' ({top_k}) exceeds n_routed_experts ({experts})")
    inter = _int(raw, "moe_intermediate_size")
    first = _int(raw, "first_k_dense_replace", 0, minimum=0)
    return MoESpec(num_experts=experts, top_k=top_k, intermediate_size=inter,
                   shared_intermediate_size=inter * (raw.get("n_shared_experts") or 0),
                   sparse_layers=tuple(i >= first for i in range(layers)),
                   **_routing(raw, raw.get("model_type") == "deepseek_v3", experts))


def config(raw: dict) -> ModelConfig:
    """config.json of a DeepSeek-V2/V3 model (transformers' DeepseekV2Config / DeepseekV3Config fields)."""
    mtype = raw.get("model_type")
    if mtype not in MODEL_TYPES:
        raise ValueError(f"config.json field 'model_type' ({mtype!r}) is not a DeepSeek MLA model")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ValueError(f"config.json field {key!r} (true) is not supported by this engine")
    rope = _int(raw, "qk_rope_head_dim")
    # head_dim: the rope dims; num_key_value_heads means nothing to MLA (one latent "head")
    cfg = ModelConfig.from_hf(raw | {"head_dim": rope, "num_key_value_heads": None}, num_kv_heads=1)
    return dataclasses.replace(cfg, mla=_mla(raw, cfg.rope_scaling), moe=_moe(raw, cfg.num_layers))


class Model(MoECausalLM):
    """The DeepSeek decoder: MLAAttention in every layer, dense or MoE MLP per `first_k_dense_replace`."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, max_pos, tp)
        for i, layer in enumerate(self.layers):
            layer.self_attn = MLAAttention(cfg, i, tp)  # built on the meta device by the loader: no waste


def _rope_order(rope: int) -> torch.Tensor:
    """The row order taking `rope` rows of interleaved (x0, x1) pairs to (evens | odds)."""
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def rope_row_order(cfg: ModelConfig, part: str, heads: int) -> torch.Tensor | None:
    """The order the loader gives the output rows of MLA linear `part` (q_proj / q_b_proj: `heads` heads of
    this rank, already sliced; kv_a_proj_with_mqa: whole): the rope rows de-interleaved. None: the checkpoint's
    order (no interleaved rope, or another linear). LoRA's B rows take the same order (engine/extras/lora)."""
    m = cfg.mla
    if m is None or not m.rope_interleave:
        return None
    rope, qk = m.qk_rope_head_dim, m.qk_nope_head_dim + m.qk_rope_head_dim
    if part in ("q_proj", "q_b_proj"):
        head = torch.cat([torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + _rope_order(rope)])
        return (torch.arange(heads)[:, None] * qk + head).reshape(-1)
    if part == "kv_a_proj_with_mqa":
        return torch.cat([torch.arange(m.kv_lora_rank), m.kv_lora_rank + _rope_order(rope)])
    return None


def _attention(ck: Checkpoint, cfg: ModelConfig, i: int, tp: TPGroup) -> dict[str, torch.Tensor]:
    """Layer i's MLA weights and norms, this rank's heads of q / kv_b / o."""
    m, a, p = cfg.mla, f"model.layers.{i}.self_attn.", f"layers.{i}."
    assert m is not None
    q0, nq = tp.split(cfg.num_heads, "num_attention_heads")
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim

    def q_rows(w: Weight) -> Weight:  # [heads * qk, in] -> this rank's heads, rope de-interleaved
        w = rows(w, q0, nq, qk)
        order = rope_row_order(cfg, "q_proj", nq)
        return w if order is None else permute_rows(w, order)

    out = {p + "input_layernorm.weight": ck.take(f"model.layers.{i}.input_layernorm.weight"),
           p + "post_attention_layernorm.weight": ck.take(f"model.layers.{i}.post_attention_layernorm.weight")}
    s = p + "self_attn."
    if m.q_lora_rank:
        out[s + "q_a_proj.weight"] = ck.take(a + "q_a_proj.weight")
        out[s + "q_a_layernorm.weight"] = ck.take(a + "q_a_layernorm.weight")
        out[s + "q_b_proj.weight"] = q_rows(ck.take(a + "q_b_proj.weight"))
    else:
        out[s + "q_proj.weight"] = q_rows(ck.take(a + "q_proj.weight"))
    kv_a = ck.take(a + "kv_a_proj_with_mqa.weight")  # [R + R_, H]
    order = rope_row_order(cfg, "kv_a_proj_with_mqa", nq)
    out[s + "kv_a_proj_with_mqa.weight"] = kv_a if order is None else permute_rows(kv_a, order)
    out[s + "kv_a_layernorm.weight"] = ck.take(a + "kv_a_layernorm.weight")
    out[s + "kv_b"] = rows(ck.take(a + "kv_b_proj.weight"), q0, nq, m.qk_nope_head_dim + m.v_head_dim)
    out[s + "o_proj.weight"] = cols(ck.take(a + "o_proj.weight"), q0, nq, m.v_head_dim)
    return out


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """HF names -> Model's, sliced for tp.rank: MLA per `_attention`, experts stacked (moe.block_weights
    with DeepSeek's `shared_experts.`), multi-token-prediction layers skipped."""
    ck = Checkpoint(raw)
    mtp = sorted({int(g.group(1)) for n in raw if (g := re.match(r"model\.layers\.(\d+)\.", n))
                  and int(g.group(1)) >= cfg.num_layers})
    if mtp:
        log.info("ignoring %d multi-token-prediction layer(s) %s (not run by this engine)", len(mtp), mtp)
        for n in raw:
            g = re.match(r"model\.layers\.(\d+)\.", n)
            if g and int(g.group(1)) >= cfg.num_layers:
                ck.skip(n)
    out = shell_weights(ck, cfg, tp)
    assert cfg.moe is not None
    for i in range(cfg.num_layers):
        out |= _attention(ck, cfg, i, tp)
        hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
        if cfg.moe.sparse_layers[i]:
            out |= block_weights(ck, hf, ours, cfg.moe, tp, EXPERT_NAMES, shared="shared_experts.")
        else:
            out |= dense_mlp_weights(ck, hf, ours, cfg.intermediate_size, tp)
    ck.done()
    return out
