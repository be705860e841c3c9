"""NVIDIA Nemotron-H (model_type nemotron_h: Nemotron-H 8B/47B/56B, Nemotron-Nano-9B-v2, Nemotron-3-Nano
30B-A3B), as transformers' NemotronHForCausalLM: a stack of single-mixer blocks, each

    x = x + mixer(rmsnorm(x))

whose mixer is, per `layers_block_type` (or the older `hybrid_override_pattern` string):

    "M" linear_attention  Mamba2 (engine/models/mamba2.py; conv window and SSM state in the request's slot)
    "*" full_attention    causal attention WITHOUT positional embedding (transformers' NemotronHAttention has
                          no rope: the Mamba layers carry position), scale head_dim^-1/2, no biases
    "-" mlp               down(relu(up(x))^2): non-gated, squared ReLU (`mlp_hidden_act` relu2)
    "E" moe               sigmoid router plus e_score_correction_bias (for the choice only), top-k within the
                          `topk_group` best of `n_group` groups, renormalised per `norm_topk_prob`, times
                          `routed_scaling_factor` (moe.route_grouped); non-gated relu2 experts, behind a
                          latent down/up projection when `moe_latent_size`; plus one relu2 shared expert

then the final norm (`norm_f`) and an untied LM head (transformers never ties Nemotron-H's). Checkpoint
names live under `backbone.` (or `model.`, transformers' renaming), experts one by one
(`mixer.experts.{e}.up_proj/down_proj`). Multi-token-prediction weights (`mtp.*`) are skipped, as
transformers skips them.

Refused by field: `mlp_hidden_act` other than relu2, `mamba_hidden_act` other than silu, a non-null
`sliding_window` (transformers' NemotronH attends to every position whatever it says: refused, not guessed),
a malformed `time_step_limit` (any [min, max] clamp is run, in prefill and decode alike), a layer kind
other than the four, MoE routing that cannot pick top-k experts, a model without attention layers.

Tensor parallelism: Mamba2 and attention as mamba2.py describes; the MLP, the experts and the shared
expert by intermediate (up rows, down columns); router, correction bias and latent projections
replicated; one all-reduce per block. Experts run as a loop over the active experts (torch GEMMs, on
CPU and CUDA alike: no fused kernel for non-gated experts yet).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig, MoESpec
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.checkpoint import Checkpoint, cols, rows, stack_experts
from engine.models.layers import ForwardContext, RMSNorm, linear, row_parallel
from engine.models.mamba2 import (
    HybridAttention,
    HybridLM,
    Mamba2Mixer,
    Mamba2Spec,
    attention_layers,
    dt_limit,
    json_float,
    mixer_weights,
    need_int,
    qkv_weights,
)
from engine.models.moe import group_by_expert, route_grouped
from engine.models.quant import QuantTensor
from engine.models.rope import RotaryTables

log = logging.getLogger(__name__)

# layers_block_type names (and the legacy ones transformers remaps) and hybrid_override_pattern letters
LAYER_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
               "attention": "attention", "mlp": "mlp", "moe": "moe"}
PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# NemotronHConfig's defaults for the fields a config.json may leave out
DEFAULTS = dict(vocab_size=131072, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=4096, intermediate_size=21504, layer_norm_epsilon=1e-5)


@dataclass(frozen=True)
class NemotronHSpec:
    """ModelConfig.hybrid of a Nemotron-H model."""

    kinds: tuple[str, ...]  # per layer: mamba | attention | mlp | moe
    mamba: Mamba2Spec
    mlp_bias: bool  # up/down biases of the MLP, the experts' latent projections and the shared expert
    moe_latent_size: int = 0  # experts run in this width between fc1/fc2_latent_proj; 0: the hidden size


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (transformers' relu2), in place on a fresh tensor."""
    return torch.relu_(x).square_()


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2), this rank's share of `intermediate` (`field` names it for TP errors)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup = SINGLE,
                 field: str = "intermediate_size") -> None:
        super().__init__()
        self.tp = tp
        inter = tp.split(intermediate, field)[1]
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias and tp.driver)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's partial sum of the block [T, H] (rank 0's includes the down bias)."""
        return linear(self.down_proj, relu2(linear(self.up_proj, x)))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x (normed), residual [T, H] -> residual + block(x) (summed over the group)."""
        return row_parallel(self.down_proj, relu2(linear(self.up_proj, x)), residual, self.tp)


class ReluSquaredMoE(nn.Module):
    """Nemotron-H's MoE block: forward(x, residual) -> residual + fc2(experts(fc1(x))) + shared(x), summed
    over the group (rank 0 adds the residual; one all-reduce). Parameters: `gate_weight` [E, H] (router,
    applied in fp32 as transformers keeps it), `score_bias` [E], `w_up` [E, I, W], `w_down` [E, W, I]
    (W = moe_latent_size or H; this rank's I), `shared_experts.{up,down}_proj`, and with a latent size
    `fc1_latent_proj` [W, H] and `fc2_latent_proj` [H, W]."""

    def __init__(self, hidden: int, spec: MoESpec, latent: int, bias: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        inter = tp.split(spec.intermediate_size, "moe_intermediate_size")[1]
        width = latent or hidden
        e = spec.num_experts
        self.gate_weight = nn.Parameter(torch.empty(e, hidden), requires_grad=False)
        self.score_bias = nn.Parameter(torch.empty(e), requires_grad=False)
        self.w_up = nn.Parameter(torch.empty(e, inter, width), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(e, width, inter), requires_grad=False)
        self.shared_experts = ReluSquaredMLP(hidden, spec.shared_intermediate_size, bias, tp,
                                             "moe_shared_expert_intermediate_size")
        self.fc1_latent_proj = nn.Linear(hidden, latent, bias=bias) if latent else None  # replicated
        self.fc2_latent_proj = nn.Linear(latent, hidden, bias=bias and tp.driver) if latent else None

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * down_e(relu(up_e(x[t]))^2) over e = ids[t, j], for x [T, W]: the T*k slots
        sorted by expert once, one up and one down GEMM per active expert, one index_add."""
        k = ids.shape[1]
        order, counts = group_by_expert(ids, self.spec.num_experts)
        tokens = order // k  # [S] token of each sorted slot
        xs = x.index_select(0, tokens)  # [S, W] grouped by expert
        ys = torch.empty(xs.shape[0], self.w_down.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                torch.mm(relu2(xs[start : start + n] @ self.w_up[e].t()), self.w_down[e].t(), out=ys[start : start + n])
                start += n
        ys.mul_(weights.reshape(-1).index_select(0, order).to(ys.dtype).unsqueeze(1))
        return torch.zeros(x.shape[0], ys.shape[1], dtype=x.dtype, device=x.device).index_add_(0, tokens, ys)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x (normed), residual [T, H] -> residual + routed experts + shared expert [T, H]."""
        logits = F.linear(x.float(), self.gate_weight.float())  # [T, E]
        weights, ids = route_grouped(logits, self.spec, self.score_bias)  # [T, k]
        h = linear(self.fc1_latent_proj, x) if self.fc1_latent_proj is not None else x
        y = self.experts(h, weights, ids)
        if self.fc2_latent_proj is not None:  # linear: applying it to each rank's partial sum is exact
            y = linear(self.fc2_latent_proj, y)
        y = y + self.shared_experts.partial(x)
        return self.tp.all_reduce(residual + y if self.tp.driver else y)


class NemotronHBlock(nn.Module):
    """x + mixer(rmsnorm(x)), the mixer by the layer's kind."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        spec: NemotronHSpec = cfg.hybrid
        self.kind = spec.kinds[layer_id]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        h = cfg.hidden_size
        if self.kind == "mamba":
            self.mixer = Mamba2Mixer(spec.mamba, h, layer_id, tp)
        elif self.kind == "attention":
            self.mixer = HybridAttention(cfg, layer_id, tp)
        elif self.kind == "mlp":
            self.mixer = ReluSquaredMLP(h, cfg.intermediate_size, spec.mlp_bias, tp)
        else:
            self.mixer = ReluSquaredMoE(h, cfg.moe, spec.moe_latent_size, spec.mlp_bias, tp)

    def forward(self, x: torch.Tensor, rotary: RotaryTables | None, ctx: ForwardContext) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "mamba":
            return self.mixer(h, x, ctx)
        if self.kind == "attention":
            return self.mixer(h, x, ctx, rotary)
        return self.mixer(h, x)


class Model(HybridLM):
    """The Nemotron-H stack (mamba2.HybridLM, no rope anywhere)."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        tp.split(cfg.num_heads, "num_attention_heads")  # heads first: the error names the first misfit
        tp.kv_heads(cfg.num_kv_heads)
        super().__init__(cfg, max_pos, tp, [NemotronHBlock(cfg, i, tp) for i in range(cfg.num_layers)])


def _kinds(raw: dict) -> tuple[str, ...]:
    """Each layer's kind, as NemotronHConfig reads it: `layers_block_type` (alias layer_types) when given,
    else `hybrid_override_pattern`, else transformers' default four layers."""
    listed = raw.get("layers_block_type", raw.get("layer_types"))
    if listed is not None:
        if not isinstance(listed, list) or not listed or any(k not in LAYER_KINDS for k in listed):
            raise ValueError(f"config.json field 'layers_block_type' must list layers of {sorted(LAYER_KINDS)}, "
                             f"got {listed!r}")
        return tuple(LAYER_KINDS[k] for k in listed)
    pattern = raw.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or any(c not in PATTERN for c in pattern):
            raise ValueError(f"config.json field 'hybrid_override_pattern' must be a string of {''.join(PATTERN)}, "
                             f"got {pattern!r}")
        return tuple(PATTERN[c] for c in pattern)
    return ("mamba", "moe", "attention", "mlp")


def _alias(raw: dict, key: str, legacy: str, default: object) -> tuple[str, object]:
    """(the name it was read under, its value): NemotronHConfig takes the legacy `mamba_*` name over the
    current one when both are there."""
    if legacy in raw:
        return legacy, raw[legacy]
    return key, raw.get(key, default)


def _mamba(raw: dict, eps: float) -> Mamba2Spec:
    act = raw.get("mamba_hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json field 'mamba_hidden_act' ({act!r}) is not supported (silu only)")
    values = {}
    for key, legacy, default in (("n_groups", "mamba_n_groups", 8), ("conv_kernel", "mamba_d_conv", 4),
                                 ("chunk_size", "mamba_chunk_size", 128)):
        name, v = _alias(raw, key, legacy, default)
        values[key] = need_int({name: v}, name)
    limit_key, limit = _alias(raw, "time_step_limit", "mamba_dt_limit", [0.0, float("inf")])
    conv_bias = _alias(raw, "use_conv_bias", "mamba_conv_bias", True)[1]
    heads, groups = need_int(raw, "mamba_num_heads", 128), values["n_groups"]
    if heads % groups:
        raise ValueError(f"config.json field 'n_groups' ({groups}) must divide mamba_num_heads ({heads})")
    return Mamba2Spec(num_heads=heads, head_dim=need_int(raw, "mamba_head_dim", 64),
                      n_groups=groups, d_state=need_int(raw, "ssm_state_size", 128),
                      conv_kernel=values["conv_kernel"], chunk_size=values["chunk_size"], conv_bias=bool(conv_bias),
                      proj_bias=bool(raw.get("use_bias", False)), norm_eps=eps,
                      dt_limit=dt_limit(raw, limit_key, limit), fields=("mamba_num_heads", "n_groups"))


def _moe(raw: dict, kinds: tuple[str, ...]) -> MoESpec | None:
    if "moe" not in kinds:
        return None
    key = "n_routed_experts" if "n_routed_experts" in raw else "num_local_experts"
    experts = need_int(raw, key, 8)
    top_k = need_int(raw, "num_experts_per_tok", 2)
    n_group, topk_group = need_int(raw, "n_group", 1), need_int(raw, "topk_group", 1)
    if experts % n_group or topk_group > n_group or (n_group > 1 and experts // n_group < 2):
        raise ValueError(f"config.json field 'n_group' ({n_group}) must divide {key} ({experts}) into groups of "
                         f">= 2 and be >= topk_group ({topk_group})")
    if top_k > topk_group * (experts // n_group):
        raise ValueError(f"config.json field 'num_experts_per_tok' ({top_k}) exceeds the experts its "
                         f"topk_group ({topk_group}) groups hold")
    scaling = json_float(raw.get("routed_scaling_factor", 1.0))
    if scaling is None:
        raise ValueError(f"config.json field 'routed_scaling_factor' must be a number, got "
                         f"{raw['routed_scaling_factor']!r}")
    return MoESpec(num_experts=experts, top_k=top_k, intermediate_size=need_int(raw, "moe_intermediate_size", 7688),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                   shared_intermediate_size=need_int(raw, "moe_shared_expert_intermediate_size", 7688),
                   sparse_layers=tuple(k == "moe" for k in kinds), scoring="sigmoid", n_group=n_group,
                   topk_group=topk_group, routed_scaling_factor=scaling, score_bias=True, shared_gate=False)


def config(raw: dict) -> ModelConfig:
    """config.json of a Nemotron-H model (module docstring): the layer kinds, the Mamba2 sizes
    (mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size, conv_kernel, chunk_size, time_step_limit,
    use_conv_bias, use_bias), attention (num_attention_heads, num_key_value_heads, head_dim or the original
    attention_head_dim), the MLP
    (intermediate_size, mlp_bias) and MoE fields; layer_norm_epsilon for every norm."""
    if raw.get("model_type") != "nemotron_h":
        raise ValueError(f"config.json field 'model_type' ({raw.get('model_type')!r}) is not nemotron_h")
    act = raw.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"config.json field 'mlp_hidden_act' ({act!r}) is not supported (relu2 only)")
    if raw.get("sliding_window") is not None:
        raise ValueError(f"config.json field 'sliding_window' ({raw['sliding_window']!r}) is not supported "
                         "(transformers' Nemotron-H attends to every position; only null runs exactly)")
    kinds = _kinds(raw)
    full = DEFAULTS | {k: v for k, v in raw.items() if v is not None}
    if raw.get("head_dim") is None and raw.get("attention_head_dim") is not None:  # NVIDIA's original name
        full["head_dim"] = raw["attention_head_dim"]
    eps = json_float(full["layer_norm_epsilon"])
    if eps is None or eps <= 0:
        raise ValueError(f"config.json field 'layer_norm_epsilon' must be a positive number, got "
                         f"{raw['layer_norm_epsilon']!r}")
    latent = raw.get("moe_latent_size")
    spec = NemotronHSpec(kinds=kinds, mamba=_mamba(raw, eps), mlp_bias=bool(raw.get("mlp_bias", False)),
                         moe_latent_size=0 if latent is None else need_int(raw, "moe_latent_size"))
    shared = {k: v for k, v in full.items() if k not in ("layers_block_type", "layer_types", "sliding_window")}
    return ModelConfig.from_hf(shared | {"num_hidden_layers": len(kinds)}, rms_eps=eps, tie_embeddings=False,
                               moe=_moe(raw, kinds), attention_layers=attention_layers(kinds, "layers_block_type"),
                               hybrid=spec)


def _mlp_weights(ck: Checkpoint, hf: str, ours: str, intermediate: int, bias: bool, tp: TPGroup,
                 field: str) -> dict[str, torch.Tensor]:
    """A relu2 MLP at `hf` (up_proj, down_proj) as ReluSquaredMLP at `ours`: up's rows and down's columns
    of this rank's share; down's bias on rank 0 only."""
    i0, n = tp.split(intermediate, field)
    out = {ours + "up_proj.weight": rows(ck.take(hf + "up_proj.weight"), i0, n),
           ours + "down_proj.weight": cols(ck.take(hf + "down_proj.weight"), i0, n)}
    if bias:
        out[ours + "up_proj.bias"] = rows(ck.take(hf + "up_proj.bias"), i0, n)
        if tp.driver:
            out[ours + "down_proj.bias"] = ck.take(hf + "down_proj.bias")
        else:
            ck.skip(hf + "down_proj.bias")
    return out


def _moe_weights(ck: Checkpoint, hf: str, ours: str, cfg: ModelConfig, tp: TPGroup) -> dict[str, torch.Tensor]:
    """An MoE mixer at `hf` as ReluSquaredMoE at `ours`: router and correction bias whole, experts stacked
    (this rank's intermediate), the shared expert like an MLP, the latent projections whole (fc2's bias on
    rank 0 only)."""
    spec, hybrid = cfg.moe, cfg.hybrid
    i0, n = tp.split(spec.intermediate_size, "moe_intermediate_size")
    ups, downs = [], []
    for e in range(spec.num_experts):
        up, down = ck.take(f"{hf}experts.{e}.up_proj.weight"), ck.take(f"{hf}experts.{e}.down_proj.weight")
        ups.append(rows(up, i0, n))
        downs.append(cols(down, i0, n))
    if any(isinstance(w, QuantTensor) for w in ups + downs):
        raise ValueError(f"weights {hf}experts.*: quantized non-gated experts are not supported yet")
    out = {ours + "gate_weight": ck.take(hf + "gate.weight"),
           ours + "score_bias": ck.take(hf + "gate.e_score_correction_bias"),
           ours + "w_up": stack_experts(ups), ours + "w_down": stack_experts(downs)}
    out |= _mlp_weights(ck, hf + "shared_experts.", ours + "shared_experts.", spec.shared_intermediate_size,
                        hybrid.mlp_bias, tp, "moe_shared_expert_intermediate_size")
    if hybrid.moe_latent_size:
        for name, row_parallel_bias in (("fc1_latent_proj", False), ("fc2_latent_proj", True)):
            out[ours + f"{name}.weight"] = ck.take(hf + f"{name}.weight")
            if hybrid.mlp_bias and (tp.driver or not row_parallel_bias):
                out[ours + f"{name}.bias"] = ck.take(hf + f"{name}.bias")
            elif hybrid.mlp_bias:
                ck.skip(hf + f"{name}.bias")
    return out


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """HF names (under backbone. or model.) -> Model's, sliced for tp.rank; mtp.* skipped."""
    ck = Checkpoint(raw)
    pre = "backbone." if "backbone.embeddings.weight" in raw else "model."
    out = {"embed_tokens.weight": ck.take(pre + "embeddings.weight"), "norm.weight": ck.take(pre + "norm_f.weight")}
    if tp.driver:
        out["lm_head.weight"] = ck.take("lm_head.weight")
    else:
        ck.skip("lm_head.weight")
    mtp = [name for name in raw if name.startswith("mtp.")]
    if mtp:
        log.info("skipping %d multi-token-prediction weights (mtp.*): not run by this engine", len(mtp))
        for name in mtp:
            ck.skip(name)
    spec: NemotronHSpec = cfg.hybrid
    for i, kind in enumerate(spec.kinds):
        hf, ours = f"{pre}layers.{i}.mixer.", f"layers.{i}.mixer."
        out[f"layers.{i}.norm.weight"] = ck.take(f"{pre}layers.{i}.norm.weight")
        if kind == "mamba":
            out |= mixer_weights(ck, hf, ours, spec.mamba, tp)
        elif kind == "attention":
            out |= qkv_weights(ck, cfg, hf, ours, tp)
        elif kind == "mlp":
            out |= _mlp_weights(ck, hf, ours, cfg.intermediate_size, spec.mlp_bias, tp, "intermediate_size")
        else:
            out |= _moe_weights(ck, hf, ours, cfg, tp)
    ck.done()
    return out
