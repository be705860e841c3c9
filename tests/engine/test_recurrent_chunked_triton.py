"""The Triton prefill kernels of the recurrent layers (engine/recurrent/triton_chunked.py) against the
torch packed-segment forms (engine/recurrent/: gated_delta_varlen, ssd_varlen, causal_conv1d_varlen,
themselves checked against transformers in test_recurrent_kernels.py), fp32, under TRITON_INTERPRET=1 on
CPU tensors (compiled on a GPU when there is one): one varlen batch of segments of different lengths
(several chunks, exactly one chunk, shorter than one, one token, shorter than the conv's K - 1), with and
without an initial state (fresh slots hold NaN: never read), into a strided pool view (a layer of a
[slots, layers, ...] pool), head dims that are not powers of two (masked tiles). Then the wiring:
StateBatch's `triton_prefill` switch over a real StatePool."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

from engine.recurrent.batch import StateBatch
from engine.recurrent.conv import causal_conv1d_varlen
from engine.recurrent.gated_delta import gated_delta_varlen, gates
from engine.recurrent.ssd import NO_LIMIT, ssd_varlen
from engine.recurrent.state_pool import StatePart, StatePool, StateSpec

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
chunked = None
if importlib.util.find_spec("triton") is not None:  # the optional `gpu` extra
    if not ON_CUDA:  # Triton decides interpreter vs compiler when the kernel module is imported
        _prev = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            chunked = importlib.reload(importlib.import_module("engine.recurrent.triton_chunked"))
        finally:
            if _prev is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = _prev
    else:
        chunked = importlib.import_module("engine.recurrent.triton_chunked")

pytestmark = pytest.mark.skipif(chunked is None, reason="triton is not installed (the gpu extra)")

DEV = "cuda" if ON_CUDA else "cpu"


@pytest.fixture(autouse=True)
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches check the mode again (triton's lazily imported parts): keep the interpreter's on CPU."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")

# (tokens, has_state): 3 chunks of 16 (two boundaries crossed), a decode token, shorter than the conv's
# K - 1 with and without a state, exactly one chunk, a partial chunk
SEGMENTS = [(37, True), (1, False), (2, True), (16, False), (2, False), (5, True)]
SLOTS = torch.tensor([6, 1, 0, 4, 7, 3])
CHUNK = 16
TOL = {"atol": 2e-5, "rtol": 1e-4}


def lens() -> list[int]:
    return [n for n, _ in SEGMENTS]


def has() -> list[bool]:
    return [h for _, h in SEGMENTS]


def layer_pool(*shape: int, seed: int = 3) -> torch.Tensor:
    """Layer 1 of a [slots, 2 layers, ...] pool (a strided view), fresh segments' slots NaN."""
    p = torch.randn(8, 2, *shape, generator=torch.Generator().manual_seed(seed)) * 0.3
    for (_, h), slot in zip(SEGMENTS, SLOTS.tolist()):
        if not h:
            p[slot, 1] = float("nan")
    return p[:, 1]


def dev(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in ts]


def check(y: torch.Tensor, ref_y: torch.Tensor, states: torch.Tensor, ref_states: torch.Tensor) -> None:
    torch.testing.assert_close(y.cpu(), ref_y, **TOL)
    torch.testing.assert_close(states.cpu(), ref_states, equal_nan=True, **TOL)  # other slots untouched
    assert not states[SLOTS.to(DEV)].isnan().any()


def test_conv1d_prefill() -> None:
    g = torch.Generator().manual_seed(0)
    c, kw = 12, 4
    w, b = torch.randn(c, kw, generator=g) * 0.5, torch.randn(c, generator=g) * 0.1
    x = torch.randn(sum(lens()), c, generator=g)
    ref_states = layer_pool(c, kw - 1)
    states = ref_states.clone().to(DEV)
    ref = causal_conv1d_varlen(x, w, b, lens(), SLOTS, ref_states, has())
    # 8-token blocks: the 37-token segment spans 5 blocks; 8 channel blocks: the second masked
    y = chunked.conv1d_prefill(*dev(x, w, b), lens(), SLOTS.to(DEV), states, has(), block_t=8, block_c=8)
    check(y, ref, states, ref_states)


@pytest.mark.parametrize("dk,dv,l2norm,scale", [(12, 20, True, None), (16, 16, False, 0.2)])
def test_gdn_prefill(dk: int, dv: int, l2norm: bool, scale: float | None) -> None:
    gen = torch.Generator().manual_seed(1)
    hk, hv, n = 2, 4, sum(lens())  # two value heads per key head
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    if not l2norm:
        q, k = q * 0.25, k * 0.25
    v = torch.randn(n, hv, dv, generator=gen)
    g, beta = gates(torch.randn(n, hv, generator=gen), torch.randn(n, hv, generator=gen),
                    torch.rand(hv, generator=gen).log(), torch.ones(hv))
    kw = {"use_qk_l2norm": l2norm, "scale": scale}
    ref_states = layer_pool(hv, dk, dv)
    states = ref_states.clone().to(DEV)
    ref = gated_delta_varlen(q, k, v, g, beta, lens(), SLOTS, ref_states, has(), **kw)  # torch's chunk: 64
    # d_v 20 in 16-wide blocks: the second masked; d_k 12 in a 16-wide tile
    o = chunked.gdn_prefill(*dev(q, k, v, g, beta), lens(), SLOTS.to(DEV), states, has(), chunk_size=CHUNK,
                            block_v=16, **kw)
    check(o, ref, states, ref_states)


@pytest.mark.parametrize("limit", [NO_LIMIT, (0.01, 0.5)])
def test_ssd_prefill(limit: tuple[float, float]) -> None:
    gen = torch.Generator().manual_seed(2)
    nh, hp, ng, ns, n = 4, 20, 2, 12, sum(lens())  # two heads per B/C group; P and N not powers of two
    x = torch.randn(n, nh, hp, generator=gen)
    dt = torch.randn(n, nh, generator=gen) - 1.0
    a = -torch.rand(nh, generator=gen) - 0.5
    b, c = torch.randn(n, ng, ns, generator=gen), torch.randn(n, ng, ns, generator=gen)
    d, dt_bias = torch.randn(nh, generator=gen), torch.randn(nh, generator=gen) * 0.1
    kw = {"D": d, "dt_bias": dt_bias, "dt_limit": limit}
    ref_states = layer_pool(nh, hp, ns)
    states = ref_states.clone().to(DEV)
    ref = ssd_varlen(x, dt, a, b, c, lens(), SLOTS, ref_states, has(), chunk_size=32, **kw)
    y = chunked.ssd_prefill(*dev(x, dt, a, b, c), lens(), SLOTS.to(DEV), states, has(), chunk_size=CHUNK,
                            block_p=16, **{**kw, "D": d.to(DEV), "dt_bias": dt_bias.to(DEV)})
    check(y, ref, states, ref_states)


def test_bad_input_is_refused() -> None:
    x = torch.zeros(5, 4)
    st = torch.zeros(4, 4, 3)
    with pytest.raises(ValueError, match="rows"):
        chunked.conv1d_prefill(x, torch.zeros(4, 4), None, [2, 2], torch.tensor([1, 2]), st)
    with pytest.raises(ValueError, match="slots"):
        chunked.conv1d_prefill(x, torch.zeros(4, 4), None, [5], torch.tensor([1, 2]), st)
    with pytest.raises(ValueError, match="at least one token"):
        chunked.conv1d_prefill(x, torch.zeros(4, 4), None, [5, 0], torch.tensor([1, 2]), st)
    with pytest.raises(ValueError, match="power of two"):
        chunked.gdn_prefill(torch.zeros(5, 1, 4), torch.zeros(5, 1, 4), torch.zeros(5, 1, 4), torch.zeros(5, 1),
                            torch.zeros(5, 1), [5], torch.tensor([1]), torch.zeros(2, 1, 4, 4), chunk_size=24)
    with pytest.raises(ValueError, match="activation"):
        chunked.conv1d_prefill(x, torch.zeros(4, 4), None, [5], torch.tensor([1]), st, activation="gelu")


# --- the wiring: StateBatch's switch ----------------------------------------------------------


def test_state_batch_switch() -> None:
    """A mixed batch (prompt chunks and a decode token) through StateBatch: `triton_prefill` True runs the
    chunked kernels (their default tiles: chunk 64, so the 70-token segment crosses a boundary), False the
    torch path, over a real StatePool's parts (strided views of its slot rows); both equal. Decode-only
    batches never take them, and off CUDA the default is torch."""
    hv, dk, dv, c, kw, nh, hp, ns = 2, 16, 16, 24, 4, 2, 16, 16
    spec = StateSpec((StatePart("0.conv", (c, kw - 1), torch.float32), StatePart("0.ssm", (hv, dk, dv), torch.float32),
                      StatePart("1.ssm", (nh, hp, ns), torch.float32)))
    pools = [StatePool(spec, 6, DEV) for _ in range(2)]
    for name in ("0.conv", "0.ssm", "1.ssm"):
        for p in pools:  # the same old states in both
            p.part(name).copy_(torch.randn(p.part(name).shape, generator=torch.Generator().manual_seed(5)) * 0.3)
    gen = torch.Generator().manual_seed(4)
    seq, flags = [70, 1, 9], [False, True, True]
    n = sum(seq)
    x = torch.randn(n, c, generator=gen)
    w = torch.randn(c, kw, generator=gen) * 0.5
    q, k, v = (torch.randn(n, hv, d, generator=gen) for d in (dk, dk, dv))
    g, beta = gates(torch.randn(n, hv, generator=gen), torch.randn(n, hv, generator=gen), torch.zeros(hv),
                    torch.ones(hv))
    xs, dt = torch.randn(n, nh, hp, generator=gen), torch.randn(n, nh, generator=gen)
    a = -torch.rand(nh, generator=gen) - 0.5
    bb, cc = torch.randn(n, 1, ns, generator=gen), torch.randn(n, 1, ns, generator=gen)
    outs = []
    for pool, switch in zip(pools, (True, False)):
        sb = StateBatch(pool, torch.tensor([3, 1, 5], device=DEV), seq, flags, triton_prefill=switch)
        assert sb._triton_chunked() is switch
        outs.append([sb.conv("0.conv", *dev(x, w), None),
                     sb.gated_delta("0.ssm", *dev(q, k, v, g, beta)),
                     sb.ssd("1.ssm", *dev(xs, dt, a, bb, cc), D=torch.ones(nh, device=DEV))])
    for got, ref in zip(*outs):
        torch.testing.assert_close(got.cpu(), ref.cpu(), **TOL)
    for name in ("0.conv", "0.ssm", "1.ssm"):
        torch.testing.assert_close(pools[0].part(name).cpu(), pools[1].part(name).cpu(), **TOL)
    assert not StateBatch(pools[0], torch.tensor([1], device=DEV), [1], [True], triton_prefill=True)._triton_chunked()
    assert StateBatch(pools[0], torch.tensor([1], device=DEV), [5], [True])._triton_chunked() is ON_CUDA
