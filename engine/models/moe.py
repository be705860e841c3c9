"""Mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE) over tokens of a whole batch.

One block = a router (replicated on every TP rank), `num_experts` SwiGLU experts and, for Qwen2-MoE,
a shared expert scaled by sigmoid(shared_expert_gate(x)). Shapes: T tokens, H hidden, E experts,
k = top_k, I = per-expert intermediate on this rank, S = T * k routed slots (slot s = token s // k).

Routing (`route`, as transformers' TopKRouter): softmax over E in fp32 -> top-k -> divided by its sum
when `norm_topk_prob` (Mixtral always). DeepSeek (`route_grouped`): softmax or sigmoid scores, V3's
correction bias, grouped top-k, routed_scaling_factor; its shared experts are ungated. Experts:

- CPU (`experts_cpu`): the S slots are sorted by expert once; each ACTIVE expert runs one gate/up GEMM
  (silu and product fused, cpu_gemm.silu_gate_up) and one down GEMM over its contiguous run of
  tokens; outputs are scaled by the routing weight and summed per token with one index_add. With
  `--cpu-gemm onednn` every expert's weights are packed once at load (`pack_weights`).
- CUDA (`engine/models/moe_triton.py`): the same sort into BLOCK_M-row blocks per expert, one grouped
  GEMM for gate/up (silu * up fused) and one for down (routing weight applied), summed per token.

Tensor parallelism: every rank holds every expert's `tp.split(intermediate)` slice of gate/up rows
and down columns (the shared expert's too), the router and the shared gate replicated. The block's
output is a partial sum on each rank; rank 0 adds the residual, and ONE `tp.all_reduce` follows the
whole block (routed + shared experts).

Expert parallelism seam: `placement(num_experts, tp)` lists the global experts this rank holds
(today all of them, on every rank); `block_weights` loads exactly those, and SparseMoE refuses any
other placement. EP would return a subset per rank, map router ids to local indices (slots routed to
another rank's experts contribute nothing here) and keep the same one all-reduce (or an all-to-all
dispatch) to sum the ranks' outputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from engine.config import ModelConfig, MoESpec
from engine.distributed.tp import SINGLE, TPGroup
from engine.models import cpu_gemm
from engine.models.checkpoint import (
    Checkpoint,
    attention_weights,
    cat_rows,
    cols,
    dense_mlp_weights,
    rows,
    shell_weights,
    stack_experts,
)
from engine.models.layers import CausalLM, DenseMLP, linear
from engine.models.quant import QuantTensor


def placement(num_experts: int, tp: TPGroup) -> tuple[int, ...]:
    """Global ids of the experts rank `tp.rank` holds, in local order. Today: all of them (experts are
    sharded along the intermediate dimension, not placed): the expert-parallelism seam."""
    return tuple(range(num_experts))


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]): softmax in fp32,
    top-k, divided by their sum when `renormalize` (transformers' TopKRouter, ids in descending
    probability order)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(logits: torch.Tensor, spec: MoESpec,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing, as transformers' DeepseekV2/V3 TopkRouter: router logits [T, E] -> (weights fp32
    [T, k], expert ids int64 [T, k]). Scores: softmax (V2) or sigmoid (V3) in fp32; `bias` (V3's
    e_score_correction_bias [E]) is added for the choice only. With n_group > 1 only the topk_group best
    groups are eligible (a group's score: its best expert (softmax) or the sum of its best two (sigmoid)).
    The chosen scores are renormalised when norm_topk_prob (sigmoid only, as transformers), then scaled by
    routed_scaling_factor."""
    scores = torch.softmax(logits.float(), dim=-1) if spec.scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if spec.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, spec.n_group, e // spec.n_group)
        group_scores = grouped.max(-1).values if spec.scoring == "softmax" else grouped.topk(2, -1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(spec.topk_group, -1)[1], 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(e // spec.n_group, 1), float("-inf"))
    ids = torch.topk(choice, spec.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob and spec.scoring == "sigmoid":
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Expert ids [T, k] -> (slots sorted by expert, stable: int64 [S]; counts per expert, a Python
    list of E ints). The slots of expert e are order[sum(counts[:e]) : sum(counts[:e+1])]."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist()


def experts_cpu(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, inter: int, packed: list | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, H]; w13 [E, 2I, H] (gate rows, then
    up), w2 [E, H, I]; `packed` (from `pack_weights`): per expert ((gate, up), down) oneDNN weights,
    used instead of w13/w2; or w13/w2 as quantized stacks (engine/models/quant.py's QuantTensor), each
    active expert's weights dequantized for its GEMMs only. Added into `out` [T, H] when given (else a
    new zero tensor): one index_add over the S slots. Only experts with routed tokens compute (one GEMM
    pair each)."""
    k = ids.shape[1]
    num_experts = len(packed) if packed is not None else w13.shape[0]
    quantized = isinstance(w13, QuantTensor) or isinstance(w2, QuantTensor)
    order, counts = group_by_expert(ids, num_experts)
    tokens = order // k  # [S] token of each sorted slot
    xs = x.index_select(0, tokens)  # [S, H], grouped by expert
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = xs[start:start + n]  # expert e's tokens
        if packed is not None:
            (pg, pu), pd = packed[e]
            h = cpu_gemm.silu_gate_up(xe, w13, (pg, pu), inter)
            ys[start:start + n] = cpu_gemm.linear(h, w2, pd)
        elif quantized:
            h = cpu_gemm.silu_gate_up(xe, _expert(w13, e, xe.dtype), None, inter)
            torch.mm(h, _expert(w2, e, h.dtype).t(), out=ys[start:start + n])
        else:
            h = cpu_gemm.silu_gate_up(xe, w13[e], None, inter)
            torch.mm(h, w2[e].t(), out=ys[start:start + n])
        start += n
    ys.mul_(weights.reshape(-1).index_select(0, order).to(ys.dtype).unsqueeze(1))
    if out is None:
        out = torch.zeros_like(x)
    return out.index_add_(0, tokens, ys)


def _expert(w: torch.Tensor | QuantTensor, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's weight of a stack: dequantized (a transient) when the stack is quantized."""
    return w.dequant(e, dtype) if isinstance(w, QuantTensor) else w[e]


class SparseMoE(nn.Module):
    """The MoE MLP block of one decoder layer: forward(x, residual) -> residual + moe(x), summed over
    the TP group (rank 0 adds the residual; one all-reduce). Parameters: `gate.weight` [E, H] (router),
    `w13` [E_local, 2I, H] (each expert's gate rows then up rows, this rank's I), `w2` [E_local, H, I],
    and, when spec.shared_intermediate_size > 0, `shared_expert.{gate_up_proj,down_proj}` (a DenseMLP
    sharded like the dense layers) and `shared_expert_gate.weight` [1, H]. From a quantized checkpoint the
    loader replaces w13/w2 by `w13_quant`/`w2_quant` (QuantTensor stacks, engine/models/quant.py)."""

    QUANTIZABLE = ("w13", "w2")  # parameters the loader may hold low-bit (besides nn.Linear weights)

    def __init__(self, hidden: int, spec: MoESpec, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.inter = tp.split(spec.intermediate_size, "moe_intermediate_size")[1]
        self.experts = placement(spec.num_experts, tp)
        if self.experts != tuple(range(spec.num_experts)):
            raise ValueError("expert parallelism (experts placed on some ranks only) is not supported yet")
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(len(self.experts), 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(len(self.experts), hidden, self.inter), requires_grad=False)
        shared = spec.shared_intermediate_size
        self.shared_expert = DenseMLP(hidden, shared, tp, "shared_expert_intermediate_size") if shared else None
        gated = shared and spec.shared_gate
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if gated else None  # replicated
        # DeepSeek-V3's e_score_correction_bias [E] (replicated; a parameter so the loader fills it)
        self.score_bias = nn.Parameter(torch.empty(spec.num_experts), requires_grad=False) if spec.score_bias \
            else None
        self.packed: list | None = None  # per expert ((gate, up), down) oneDNN weights (pack_weights)
        self.triton = False  # the fused Triton kernel off CUDA too (use_triton: the triton attention backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x (normed) and residual [T, H] -> residual + routed experts (+ shared expert) [T, H]."""
        logits = linear(self.gate, x)  # [T, E]
        if self.spec.scoring == "softmax" and self.spec.n_group == 1 and self.spec.routed_scaling_factor == 1.0:
            weights, ids = route(logits, self.spec.top_k, self.spec.norm_topk_prob)  # [T, k]
        else:
            weights, ids = route_grouped(logits, self.spec, self.score_bias)
        out = residual.clone() if self.tp.driver else torch.zeros_like(residual)
        if self.shared_expert is not None:  # [sigmoid(x Wg^T) *] down(silu(gate(x)) * up(x)), a partial sum
            se, sg = self.shared_expert, self.shared_expert_gate
            y = linear(se.down_proj, se.act(x))  # [T, H]
            out.add_(y.mul_(torch.sigmoid(linear(sg, x))) if sg is not None else y)
        w13, w2 = getattr(self, "w13_quant", None), getattr(self, "w2_quant", None)  # quantized checkpoint
        if w13 is not None or w2 is not None:  # experts dequantized one at a time (CPU or CUDA)
            experts_cpu(x, weights, ids, self.w13 if w13 is None else w13, self.w2 if w2 is None else w2,
                        self.inter, out=out)
        elif self.packed is None and (self.triton or x.device.type == "cuda"):
            from engine.models.moe_triton import fused_moe

            out.add_(fused_moe(x, self.w13, self.w2, weights, ids, self.inter))
        else:
            experts_cpu(x, weights, ids, self.w13, self.w2, self.inter, self.packed, out=out)
        return self.tp.all_reduce(out)

    def pack_weights(self, mode: str) -> int:
        """Once, at load (loader.load_model calls it after cpu_gemm.pack_model): pack every expert's gate,
        up and down weights for oneDNN and drop the fp32 copies; returns how many were packed (0 when
        `mode` is torch, the weights are not fp32 on the CPU or are quantized, or oneDNN refuses)."""
        quantized = any(getattr(self, f"{n}_quant", None) is not None for n in self.QUANTIZABLE)
        if mode != "onednn" or not cpu_gemm.can_pack(self.w13) or quantized:
            return 0
        try:
            packed = [((cpu_gemm.pack(self.w13[e, :self.inter]), cpu_gemm.pack(self.w13[e, self.inter:])),
                       cpu_gemm.pack(self.w2[e])) for e in range(self.w13.shape[0])]
        except RuntimeError:  # plain torch GEMMs still work
            return 0
        self.packed = packed
        self.w13 = nn.Parameter(torch.empty(0, dtype=self.w13.dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, dtype=self.w2.dtype), requires_grad=False)
        return 3 * len(packed)


def use_triton(model: nn.Module) -> int:
    """Route every SparseMoE block of `model` through the fused Triton kernel (moe_triton.py) whatever the
    device: the runner calls it when the model's Triton kernels run (engine.attention.base.triton_kernels),
    which off CUDA means Triton's interpreter. Blocks whose experts were packed for oneDNN keep the CPU path.
    Returns how many blocks take the kernel."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE) and m.packed is None]
    for m in blocks:
        m.triton = True
    return len(blocks)


def pack_moe(model: nn.Module, mode: str) -> int:
    """Pack the experts of every SparseMoE block in `model` (see SparseMoE.pack_weights)."""
    return sum(m.pack_weights(mode) for m in model.modules() if isinstance(m, SparseMoE))


def _int(raw: dict, key: str, default: object = None, minimum: int = 1) -> int:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"config.json field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def sparse_layers(raw: dict, num_layers: int) -> tuple[bool, ...]:
    """Which layers are MoE (True) vs dense, as transformers' Qwen MoE decoder layers choose: layer i is
    sparse unless i is in `mlp_only_layers`, and only when (i + 1) % `decoder_sparse_step` == 0."""
    step = _int(raw, "decoder_sparse_step", 1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ValueError(f"config.json field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
    return tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))


def moe_spec(raw: dict, num_experts: str, intermediate: str, norm_topk_prob: bool,
             shared: str | None = None) -> MoESpec:
    """The MoESpec of a config.json: `num_experts` / `intermediate` name the family's fields for the
    expert count and per-expert intermediate, `shared` its shared-expert size field (None: no shared
    expert). `hidden_act` must be silu and top-k must fit the experts; else ValueError naming the field."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json field 'hidden_act' ({raw['hidden_act']!r}) is not supported (silu only)")
    experts = _int(raw, num_experts)
    top_k = _int(raw, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"config.json field 'num_experts_per_tok' ({top_k}) exceeds {num_experts} ({experts})")
    return MoESpec(num_experts=experts, top_k=top_k, intermediate_size=_int(raw, intermediate),
                   norm_topk_prob=norm_topk_prob,
                   shared_intermediate_size=_int(raw, shared, 0, minimum=0) if shared else 0,
                   sparse_layers=sparse_layers(raw, _int(raw, "num_hidden_layers")))


def moe_mlp(cfg: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
    """layers.CausalLM's MLP factory for MoE families: a SparseMoE on sparse layers, else the dense MLP."""
    spec = cfg.moe
    if spec is None or not spec.sparse_layers[layer_id]:
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size, tp)
    return SparseMoE(cfg.hidden_size, spec, tp)


class MoECausalLM(CausalLM):
    """The shared decoder (layers.CausalLM) with each layer's MLP from `moe_mlp`."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, max_pos, tp, moe_mlp)


def block_weights(ck: Checkpoint, hf: str, ours: str, spec: MoESpec, tp: TPGroup,
                  names: tuple[str, str, str], shared: str = "shared_expert.") -> dict[str, torch.Tensor]:
    """One MoE block at HF prefix `hf` (e.g. 'model.layers.0.mlp.') -> SparseMoE's parameters at `ours`:
    router `gate.weight` whole; expert e's f"{hf}experts.{e}.{gate|up|down}.weight" with the family's
    `names` (Mixtral: w1, w3, w2) stacked into w13 (gate rows then up rows) and w2, this rank's share
    of the intermediate; the shared expert (HF prefix `shared`, DeepSeek 'shared_experts.') like a dense
    MLP, its sigmoid gate (when spec.shared_gate) and V3's `gate.e_score_correction_bias` whole."""
    first, count = tp.split(spec.intermediate_size, "moe_intermediate_size")
    gate, up, down = names
    w13, w2 = [], []
    for e in placement(spec.num_experts, tp):
        p = f"{hf}experts.{e}."
        w13.append(cat_rows([rows(ck.take(f"{p}{gate}.weight"), first, count),
                             rows(ck.take(f"{p}{up}.weight"), first, count)]))
        w2.append(cols(ck.take(f"{p}{down}.weight"), first, count))
    out = {ours + "gate.weight": ck.take(hf + "gate.weight"), ours + "w13": stack_experts(w13),
           ours + "w2": stack_experts(w2)}
    if spec.shared_intermediate_size:
        out |= dense_mlp_weights(ck, hf + shared, ours + "shared_expert.", spec.shared_intermediate_size,
                                 tp, "shared_expert_intermediate_size")
        if spec.shared_gate:
            out[ours + "shared_expert_gate.weight"] = ck.take(hf + "shared_expert_gate.weight")
    if spec.score_bias:
        out[ours + "score_bias"] = ck.take(hf + "gate.e_score_correction_bias")
    return out


def moe_weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup, block: str,
                names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """A MoE family's whole checkpoint (MoECausalLM), sliced for tp.rank: `block` is the HF module name of
    a sparse layer's MLP ('mlp', Mixtral 'block_sparse_moe'), dense layers' MLPs are 'mlp'."""
    ck = Checkpoint(raw)
    out = shell_weights(ck, cfg, tp)
    for i in range(cfg.num_layers):
        out |= attention_weights(ck, cfg, i, tp)
        ours = f"layers.{i}.mlp."
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            out |= block_weights(ck, f"model.layers.{i}.{block}.", ours, cfg.moe, tp, names)
        else:
            out |= dense_mlp_weights(ck, f"model.layers.{i}.mlp.", ours, cfg.intermediate_size, tp)
    ck.done()
    return out
