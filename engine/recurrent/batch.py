"""What a recurrent layer sees of one forward (`ForwardContext.state`), and the three calls a layer
makes: the short convolution, the gated delta rule (Gated DeltaNet) and the SSD scan (Mamba2).

Each call takes the layer's packed per-token inputs and its pool part (`StatePool.part`), and picks
the kernel: on CUDA (or with `triton` set: the triton attention backend, CI's interpreter), a batch
whose segments are all one token (a decode step) goes to the Triton steps
(engine/recurrent/triton_steps.py: state read and written in the pool, no gather); everything else to
the packed-segment torch path (engine/recurrent/segments.py: chunked forms for prompt chunks, one
batched step for the one-token segments). A batch with a prompt chunk goes, on CUDA (or with
`triton_prefill` True: the interpreter tests), to the Triton chunked kernels
(engine/recurrent/triton_chunked.py: the whole varlen batch in one launch each, states in place);
`triton_prefill` False keeps the torch path anywhere. The gated delta rule's chunked kernel is not
taken on CUDA by default (GDN_CHUNKED_ON_CUDA: it spills registers on sm_90; triton_chunked.py).

Speculative verifies (`checkpoints`, engine/extras/speculative/states.py): a segment that names
checkpoint slots runs one token at a time, its rows batched with the other verifies' at each
position as a decode step is (so a verify's states equal plain decoding's), and after position j the
layer's part of its slot is copied into its j-th checkpoint slot: the state after each position but
the last, from which a rejected draft is rolled back. The other segments run as above, in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from engine.recurrent.conv import causal_conv1d_varlen
from engine.recurrent.gated_delta import gated_delta_varlen
from engine.recurrent.ssd import NO_LIMIT, ssd_varlen
from engine.recurrent.state_pool import StatePool

# the gated delta rule's Triton chunked kernel on CUDA prefill by default: off until it compiles for sm_90
# without spilling registers (engine/recurrent/triton_chunked.py); triton_prefill=True still forces it
GDN_CHUNKED_ON_CUDA = False


@dataclass
class StateBatch:
    """The recurrent layers' view of one forward (B = segments)."""

    pool: StatePool
    slots: torch.Tensor  # int64 [B] each segment's slot, on the pool's device
    seq_lens: list[int]  # [B] new tokens of each segment: how per-token inputs are packed
    has_state: list[bool]  # [B] the segment continues its sequence (start > 0); False: from zeros
    triton: bool = False  # decode steps through the Triton kernels off CUDA too (the triton attention backend)
    # batches with a prompt chunk through the Triton chunked kernels: None on CUDA only, True / False forces it
    triton_prefill: bool | None = None
    # [B] speculative verifies: each segment's slots taking its state after each position but the last (()
    # for the others); None: no segment has them
    checkpoints: Sequence[tuple[int, ...]] | None = None

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.seq_lens)

    def _triton(self) -> bool:
        return (self.triton or self.pool.buffer.device.type == "cuda") and self.decode_only

    def _triton_chunked(self, gdn: bool = False) -> bool:
        if self.decode_only:
            return False
        if self.triton_prefill is not None:
            return self.triton_prefill
        return self.pool.buffer.device.type == "cuda" and (GDN_CHUNKED_ON_CUDA or not gdn)

    def _split(self, name: str, run: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """`run(sub_batch, *inputs' rows)` over the segments without checkpoints in one call, then over
        the verifies one position at a time, each position's state copied into its checkpoint slot
        (part `name`). Returns the packed outputs in the segments' order."""
        ck = self.checkpoints
        assert ck is not None
        lens = self.seq_lens
        starts = [0, *accumulate(lens)][:-1]
        dev = inputs[0].device
        out: torch.Tensor | None = None

        def part(segs: list[int], n: list[int], offset: int, has: list[bool]) -> None:
            nonlocal out
            rows = torch.tensor([starts[i] + j for i, m in zip(segs, n) for j in range(offset, offset + m)],
                                dtype=torch.long, device=dev)
            sub = replace(self, slots=self.slots[segs], seq_lens=n, has_state=has, checkpoints=None)
            y = run(sub, *(t.index_select(0, rows) for t in inputs))
            if out is None:
                out = y.new_empty(sum(lens), *y.shape[1:])
            out[rows] = y

        plain = [i for i in range(len(lens)) if not ck[i]]
        if plain:
            part(plain, [lens[i] for i in plain], 0, [self.has_state[i] for i in plain])
        states = self.pool.part(name)
        verifies = [i for i in range(len(lens)) if ck[i]]
        for j in range(max((lens[i] for i in verifies), default=0)):
            active = [i for i in verifies if lens[i] > j]
            part(active, [1] * len(active), j, [self.has_state[i] or j > 0 for i in active])
            keep = [i for i in active if j < len(ck[i])]
            if keep:
                dst = torch.tensor([ck[i][j] for i in keep], dtype=torch.long, device=states.device)
                states.index_copy_(0, dst, states.index_select(0, self.slots[keep].to(states.device)))
        assert out is not None, "no segments"
        return out

    def conv(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             activation: str | None = "silu") -> torch.Tensor:
        """Causal depthwise conv1d of packed x [T, C] (weight [C, K]) through pool part `name`
        ([slots, C, K-1]) -> y [T, C]."""
        if self.checkpoints:
            return self._split(name, lambda sb, x_: sb.conv(name, x_, weight, bias, activation), x)
        states = self.pool.part(name)
        if self._triton():
            from engine.recurrent.triton_steps import conv1d_decode_step
            return conv1d_decode_step(x.contiguous(), weight, bias, self.slots, states, self.has_state, activation)
        if self._triton_chunked():
            from engine.recurrent.triton_chunked import conv1d_prefill
            return conv1d_prefill(x, weight, bias, self.seq_lens, self.slots, states, self.has_state, activation)
        return causal_conv1d_varlen(x, weight, bias, self.seq_lens, self.slots, states, self.has_state, activation)

    def gated_delta(self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, *, use_qk_l2norm: bool = True, scale: float | None = None) -> torch.Tensor:
        """The gated delta rule over packed q, k [T, H_k, d_k], v [T, H_v, d_v], g, beta [T, H_v]
        through pool part `name` ([slots, H_v, d_k, d_v] fp32) -> o [T, H_v, d_v]."""
        if self.checkpoints:
            return self._split(name, lambda sb, *a: sb.gated_delta(name, *a, use_qk_l2norm=use_qk_l2norm, scale=scale),
                               q, k, v, g, beta)
        states = self.pool.part(name)
        if self._triton():
            from engine.recurrent.triton_steps import gdn_decode_step
            return gdn_decode_step(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                                   self.slots, states, self.has_state, use_qk_l2norm=use_qk_l2norm, scale=scale)
        if self._triton_chunked(gdn=True):
            from engine.recurrent.triton_chunked import gdn_prefill
            return gdn_prefill(q, k, v, g, beta, self.seq_lens, self.slots, states, self.has_state,
                               use_qk_l2norm=use_qk_l2norm, scale=scale)
        return gated_delta_varlen(q, k, v, g, beta, self.seq_lens, self.slots, states, self.has_state,
                                  use_qk_l2norm=use_qk_l2norm, scale=scale)

    def ssd(self, name: str, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,  # noqa: N803
            C: torch.Tensor, *, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,  # noqa: N803
            dt_limit: tuple[float, float] = NO_LIMIT, chunk_size: int = 256) -> torch.Tensor:
        """Mamba2's SSD scan over packed x [T, H, P], dt [T, H] (raw), B, C [T, G, N] through pool part
        `name` ([slots, H, P, N] fp32) -> y [T, H, P]."""
        if self.checkpoints:
            return self._split(name, lambda sb, *a: sb.ssd(name, a[0], a[1], A, a[2], a[3], D=D, dt_bias=dt_bias,
                                                           dt_limit=dt_limit, chunk_size=chunk_size), x, dt, B, C)
        states = self.pool.part(name)
        if self._triton():
            from engine.recurrent.triton_steps import ssd_decode_step
            return ssd_decode_step(x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(), self.slots,
                                   states, self.has_state, D=D, dt_bias=dt_bias, dt_limit=dt_limit)
        if self._triton_chunked():  # the kernel's own chunk (64), not the model's: equal up to rounding
            from engine.recurrent.triton_chunked import ssd_prefill
            return ssd_prefill(x, dt, A, B, C, self.seq_lens, self.slots, states, self.has_state, D=D,
                               dt_bias=dt_bias, dt_limit=dt_limit)
        return ssd_varlen(x, dt, A, B, C, self.seq_lens, self.slots, states, self.has_state, D=D, dt_bias=dt_bias,
                          dt_limit=dt_limit, chunk_size=chunk_size)
