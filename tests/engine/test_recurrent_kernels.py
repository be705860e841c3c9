"""The recurrent-layer kernels (engine/recurrent/) in fp32 at tiny sizes: each against transformers' own
torch functions (the oracle: models/qwen3_next for conv1d and the gated delta rule, models/mamba2 for
SSD, the same code nemotron_h and granitemoehybrid carry), a prompt prefilled in uneven engine chunks
(37 + 64 + 5) equal to one pass, prefill then decode steps equal to prefill of every token, and a packed
batch of segments with state slots equal to the segments one by one. The Triton decode steps
(engine/recurrent/triton_steps.py) against the torch steps over a strided pool: under
TRITON_INTERPRET=1 on CPU, compiled on a GPU when there is one (as tests/engine/test_moe.py does)."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from engine.recurrent.conv import causal_conv1d, causal_conv1d_step, causal_conv1d_varlen
from engine.recurrent.gated_delta import chunk_gated_delta_rule, gated_delta_varlen, gates, recurrent_gated_delta_step
from engine.recurrent.ssd import ssd_chunk_scan, ssd_step, ssd_varlen

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
steps = None
if importlib.util.find_spec("triton") is not None:  # the optional `gpu` extra
    if not ON_CUDA:  # Triton decides interpreter vs compiler when the kernel module is imported
        _prev = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            steps = importlib.reload(importlib.import_module("engine.recurrent.triton_steps"))  # even if imported
        finally:
            if _prev is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = _prev
    else:
        steps = importlib.import_module("engine.recurrent.triton_steps")

# after the Triton kernels: transformers imports triton (the kernels need not come first: triton_steps._sum)
hf_next = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
hf_mamba2 = importlib.import_module("transformers.models.mamba2.modeling_mamba2")

SPLIT = (37, 64, 5)  # uneven engine chunks: shorter than, exactly, and not a multiple of the chunk size
TOL = {"atol": 1e-5, "rtol": 1e-4}


def close(a: torch.Tensor, b: torch.Tensor, **tol: float) -> None:
    torch.testing.assert_close(a, b, **(tol or TOL))


def pieces(t: torch.Tensor, lens: tuple[int, ...]) -> list[torch.Tensor]:
    return list(torch.split(t, list(lens)))


# --- causal conv1d --------------------------------------------------------------------------


C, K = 12, 4


@pytest.fixture
def conv():
    g = torch.Generator().manual_seed(0)
    return torch.randn(C, K, generator=g) * 0.5, torch.randn(C, generator=g) * 0.1, g


@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_matches_transformers(conv, with_bias: bool) -> None:
    w, b, g = conv
    b = b if with_bias else None
    x = torch.randn(50, C, generator=g)
    y, state = causal_conv1d(x, w, b, None)
    ref = hf_next.causal_conv1d_fn(x.t()[None], w, b, activation="silu")[0].t()
    close(y, ref)
    close(state, x[-(K - 1):].t())
    # transformers' step over a K-1 column state equals ours, and it shifts its state in place the same way
    st = state[None].clone()
    xt = torch.randn(1, C, generator=g)
    ref_step = hf_next.causal_conv1d_update(xt[..., None], st, w, b, activation="silu")[..., 0]
    y_step, new = causal_conv1d_step(xt, w, b, state[None])
    close(y_step, ref_step)
    close(new, st)


def test_conv_chunks_and_decode_equal_one_pass(conv) -> None:
    w, b, g = conv
    x = torch.randn(sum(SPLIT) + 3, C, generator=g)
    full, full_state = causal_conv1d(x, w, b, None)
    outs, st = [], None
    for part in pieces(x[: sum(SPLIT)], SPLIT):
        y, st = causal_conv1d(part, w, b, st)
        outs.append(y)
    for t in range(sum(SPLIT), x.shape[0]):  # three decode steps
        y, st3 = causal_conv1d_step(x[t : t + 1], w, b, st[None])
        outs.append(y)
        st = st3[0]
    close(torch.cat(outs), full)
    close(st, full_state)
    # a chunk shorter than K-1 keeps part of the old state
    y1, s1 = causal_conv1d(x[:2], w, b, None)
    y2, s2 = causal_conv1d(x[2:3], w, b, s1)
    close(torch.cat([y1, y2]), full[:3])
    close(s2, torch.cat([torch.zeros(C, 0), x[:3].t()], 1))


# --- Gated DeltaNet ------------------------------------------------------------------------


HK, HV, DK, DV = 2, 4, 16, 8


def gdn_inputs(n: int, seed: int, batch: int | None = None):
    """q, k, v, g, beta for n tokens as the layer feeds them (g and beta through `gates`), unnormalised."""
    g = torch.Generator().manual_seed(seed)
    lead = (n,) if batch is None else (batch, n)
    q = torch.randn(*lead, HK, DK, generator=g)
    k = torch.randn(*lead, HK, DK, generator=g)
    v = torch.randn(*lead, HV, DV, generator=g)
    a, b = torch.randn(*lead, HV, generator=g), torch.randn(*lead, HV, generator=g)
    A_log = torch.empty(HV).uniform_(0.01, 16, generator=g).log()  # noqa: N806
    dt_bias = torch.ones(HV)
    gg, beta = gates(a, b, A_log, dt_bias)
    ref_g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # Qwen3NextGatedDeltaNet.forward
    close(gg, ref_g, atol=0, rtol=0)
    close(beta, b.sigmoid(), atol=0, rtol=0)
    return q, k, v, gg, beta


def test_gdn_chunked_matches_transformers() -> None:
    n = sum(SPLIT)
    q, k, v, g, beta = gdn_inputs(n, 1)
    s0 = torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(2)) * 0.3
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    kw = {"initial_state": s0[None], "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    args = (q[None], k[None], v[None], g[None], beta[None])
    ref_o, ref_s = hf_next.torch_chunk_gated_delta_rule(*args, chunk_size=64, **kw)
    close(o, ref_o[0])
    close(s, ref_s[0])
    rec_o, rec_s = hf_next.torch_recurrent_gated_delta_rule(*args, **kw)  # the token-by-token definition
    close(o, rec_o[0])
    close(s, rec_s[0])


def test_gdn_step_matches_transformers() -> None:
    q, k, v, g, beta = gdn_inputs(1, 3, batch=3)  # [B=3, 1, ...]
    s0 = torch.randn(3, HV, DK, DV, generator=torch.Generator().manual_seed(4)) * 0.3
    o, s = recurrent_gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
    ref_o, ref_s = hf_next.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0,
                                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(o, ref_o[:, 0])
    close(s, ref_s)


def test_gdn_chunks_and_decode_equal_one_pass() -> None:
    n = sum(SPLIT) + 4
    q, k, v, g, beta = gdn_inputs(n, 5)
    full, full_state = chunk_gated_delta_rule(q, k, v, g, beta)
    outs, st, at = [], None, 0
    for m in SPLIT:
        o, st = chunk_gated_delta_rule(q[at : at + m], k[at : at + m], v[at : at + m], g[at : at + m],
                                       beta[at : at + m], st)
        outs.append(o)
        at += m
    for t in range(at, n):  # four decode steps
        o, s1 = recurrent_gated_delta_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                           beta[t : t + 1], st[None])
        outs.append(o)
        st = s1[0]
    close(torch.cat(outs), full)
    close(st, full_state)


# --- Mamba2 SSD ---------------------------------------------------------------------------


NH, HP, NG, NS = 4, 8, 2, 16
LIMIT = (0.0, float("inf"))


def ssd_inputs(n: int, seed: int, batch: int | None = None):
    """x, dt (raw), A, B, C, D, dt_bias as a Mamba2 mixer feeds them (dt_bias: inverse softplus of dt in
    [1e-3, 0.1], the mixers' init)."""
    g = torch.Generator().manual_seed(seed)
    lead = (n,) if batch is None else (batch, n)
    x = torch.randn(*lead, NH, HP, generator=g)
    dt = torch.randn(*lead, NH, generator=g)
    B = torch.randn(*lead, NG, NS, generator=g)  # noqa: N806
    C = torch.randn(*lead, NG, NS, generator=g)  # noqa: N806
    A = -torch.arange(1, NH + 1, dtype=torch.float32)  # noqa: N806
    D = torch.randn(NH, generator=g)  # noqa: N806
    d = (torch.rand(NH, generator=g) * (torch.tensor(0.1).log() - torch.tensor(1e-3).log())
         + torch.tensor(1e-3).log()).exp()
    dt_bias = d + torch.log(-torch.expm1(-d))
    return x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("limit", [LIMIT, (0.01, 0.5)])
def test_ssd_chunked_matches_transformers(limit: tuple[float, float]) -> None:
    n = sum(SPLIT)
    x, dt, A, B, C, D, dt_bias = ssd_inputs(n, 6)  # noqa: N806
    s0 = torch.randn(NH, HP, NS, generator=torch.Generator().manual_seed(7)) * 0.3
    kw = {"D": D, "dt_bias": dt_bias, "dt_softplus": True, "dt_limit": limit}
    y, s = ssd_chunk_scan(x, dt, A, B, C, s0, chunk_size=32, **kw)
    ref_y, ref_s = hf_mamba2.mamba2_chunk_scan(x[None], dt[None], A, B[None], C[None], chunk_size=32,
                                               initial_states=s0[None], return_final_states=True, **kw)
    close(y, ref_y[0])
    close(s, ref_s[0])


def test_ssd_step_matches_transformers() -> None:
    x, dt, A, B, C, D, dt_bias = ssd_inputs(1, 8, batch=3)  # noqa: N806
    s0 = torch.randn(3, NH, HP, NS, generator=torch.Generator().manual_seed(9)) * 0.3
    y, s = ssd_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], s0, D=D, dt_bias=dt_bias)
    ref = s0.clone()  # updated in place; the head_dim-expanded arguments as mamba2_scan_forward passes them
    ref_y = hf_mamba2.mamba2_selective_state_update(
        ref, x[:, 0], dt[:, 0, :, None].expand(-1, -1, HP), A[:, None, None].expand(-1, HP, NS), B[:, 0], C[:, 0],
        D[:, None].expand(-1, HP), dt_bias=dt_bias[:, None].expand(-1, HP), dt_softplus=True)
    close(y, ref_y)
    close(s, ref)


@pytest.mark.parametrize("chunk_size", [32, 128])
def test_ssd_chunks_and_decode_equal_one_pass(chunk_size: int) -> None:
    n = sum(SPLIT) + 4
    x, dt, A, B, C, D, dt_bias = ssd_inputs(n, 10)  # noqa: N806
    kw = {"D": D, "dt_bias": dt_bias}
    full, full_state = ssd_chunk_scan(x, dt, A, B, C, chunk_size=chunk_size, **kw)
    outs, st, at = [], None, 0
    for m in SPLIT:
        y, st = ssd_chunk_scan(x[at : at + m], dt[at : at + m], A, B[at : at + m], C[at : at + m], st,
                               chunk_size=chunk_size, **kw)
        outs.append(y)
        at += m
    for t in range(at, n):
        y, s1 = ssd_step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], st[None], **kw)
        outs.append(y)
        st = s1[0]
    close(torch.cat(outs), full)
    close(st, full_state)


# --- packed segments with state slots ---------------------------------------------------------


# (tokens, has_state) per segment: decode rows between prefill chunks of every kind, fresh and continued
SEGMENTS = [(1, True), (37, False), (1, True), (70, True), (1, False), (5, True), (64, False)]
SLOTS = torch.tensor([5, 0, 3, 6, 1, 2, 4])


def one_by_one(chunk, step, per_token: list[torch.Tensor], states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of run_segments: each segment alone, from its slot (or zeros), into a copy of the pool."""
    states = states.clone()
    outs, at = [], 0
    for (n, has), slot in zip(SEGMENTS, SLOTS.tolist()):
        part = [t[at : at + n] for t in per_token]
        init = states[slot] if has else None
        if n == 1:
            y, new = step(*part, (init if has else torch.zeros_like(states[slot]))[None])
            new = new[0]
        else:
            y, new = chunk(*part, init)
        outs.append(y)
        states[slot] = new
        at += n
    return torch.cat(outs), states


def pool(*shape: int) -> torch.Tensor:
    """A state pool whose fresh slots hold NaN: a kernel that read one would show it."""
    p = torch.randn(8, *shape, generator=torch.Generator().manual_seed(11)) * 0.3
    for (_, has), slot in zip(SEGMENTS, SLOTS.tolist()):
        if not has:
            p[slot] = float("nan")
    return p


def lens() -> list[int]:
    return [n for n, _ in SEGMENTS]


def has() -> list[bool]:
    return [h for _, h in SEGMENTS]


def test_conv_varlen_equals_one_by_one(conv) -> None:
    w, b, g = conv
    x = torch.randn(sum(lens()), C, generator=g)
    states = pool(C, K - 1)
    ref_y, ref_states = one_by_one(lambda xs, st: causal_conv1d(xs, w, b, st),
                                   lambda xs, st: causal_conv1d_step(xs, w, b, st), [x], states)
    y = causal_conv1d_varlen(x, w, b, lens(), SLOTS, states, has())
    close(y, ref_y, atol=1e-6, rtol=1e-6)
    close(states, ref_states, atol=1e-6, rtol=1e-6, equal_nan=True)


def test_gdn_varlen_equals_one_by_one() -> None:
    q, k, v, g, beta = gdn_inputs(sum(lens()), 12)
    states = pool(HV, DK, DV)
    ref_y, ref_states = one_by_one(chunk_gated_delta_rule, recurrent_gated_delta_step, [q, k, v, g, beta], states)
    y = gated_delta_varlen(q, k, v, g, beta, lens(), SLOTS, states, has())
    close(y, ref_y, atol=1e-6, rtol=1e-6)
    close(states, ref_states, atol=1e-6, rtol=1e-6, equal_nan=True)
    assert not states[SLOTS].isnan().any()


def test_ssd_varlen_equals_one_by_one() -> None:
    x, dt, A, B, C_, D, dt_bias = ssd_inputs(sum(lens()), 13)  # noqa: N806
    kw = {"D": D, "dt_bias": dt_bias}
    states = pool(NH, HP, NS)
    ref_y, ref_states = one_by_one(
        lambda xs, dts, bs, cs, st: ssd_chunk_scan(xs, dts, A, bs, cs, st, chunk_size=32, **kw),
        lambda xs, dts, bs, cs, st: ssd_step(xs, dts, A, bs, cs, st, **kw), [x, dt, B, C_], states)
    y = ssd_varlen(x, dt, A, B, C_, lens(), SLOTS, states, has(), chunk_size=32, **kw)
    close(y, ref_y, atol=1e-6, rtol=1e-6)
    close(states, ref_states, atol=1e-6, rtol=1e-6, equal_nan=True)
    assert not states[SLOTS].isnan().any()


# --- Triton decode steps ---------------------------------------------------------------------


needs_triton = pytest.mark.skipif(steps is None, reason="triton is not installed (the gpu extra)")
DEV = "cuda" if ON_CUDA else "cpu"
ROWS = [True, False, True, True, False]  # has_state per decode row: fresh rows' slots hold NaN
ROW_SLOTS = torch.tensor([6, 1, 0, 4, 3])


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def layer_pool(*shape: int) -> torch.Tensor:
    """Layer 1 of a [slots, 2 layers, ...] pool (a strided view, as a model's layer sees its pool), fresh
    rows' slots NaN."""
    p = torch.randn(8, 2, *shape, generator=torch.Generator().manual_seed(14)) * 0.3
    for has, slot in zip(ROWS, ROW_SLOTS.tolist()):
        if not has:
            p[slot, 1] = float("nan")
    return p[:, 1]


def on_device(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in ts]


@needs_triton
def test_triton_conv1d_step(conv, interpreter) -> None:
    w, b, g = conv
    x = torch.randn(len(ROWS), C, generator=g)
    ref_states = layer_pool(C, K - 1)
    states = ref_states.clone().to(DEV)  # a copy on CPU too (.to is a no-op there)
    ref = causal_conv1d_varlen(x, w, b, [1] * len(ROWS), ROW_SLOTS, ref_states, ROWS)
    xd, wd, bd, sl = on_device(x, w, b, ROW_SLOTS)
    y = steps.conv1d_decode_step(xd, wd, bd, sl, states, ROWS, block_c=8)  # 12 channels: a masked block
    close(y.cpu(), ref)
    close(states.cpu(), ref_states, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("dk,dv", [(16, 8), (12, 20)])  # head dims that are not powers of two: masked
def test_triton_gdn_step(dk: int, dv: int, interpreter) -> None:
    gen = torch.Generator().manual_seed(15)
    n = len(ROWS)
    q, k = torch.randn(n, HK, dk, generator=gen), torch.randn(n, HK, dk, generator=gen)
    v = torch.randn(n, HV, dv, generator=gen)
    gg, beta = gates(torch.randn(n, HV, generator=gen), torch.randn(n, HV, generator=gen),
                     torch.rand(HV, generator=gen).log(), torch.ones(HV))
    ref_states = layer_pool(HV, dk, dv)
    states = ref_states.clone().to(DEV)  # a copy on CPU too (.to is a no-op there)
    ref = gated_delta_varlen(q, k, v, gg, beta, [1] * n, ROW_SLOTS, ref_states, ROWS)
    o = steps.gdn_decode_step(*on_device(q, k, v, gg, beta, ROW_SLOTS), states, ROWS, block_v=8)
    close(o.cpu(), ref)
    close(states.cpu(), ref_states, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("limit", [LIMIT, (0.01, 0.5)])
def test_triton_ssd_step(limit: tuple[float, float], interpreter) -> None:
    n = len(ROWS)
    x, dt, A, B, C_, D, dt_bias = ssd_inputs(1, 16, batch=n)  # noqa: N806
    x, dt, B, C_ = x[:, 0], dt[:, 0], B[:, 0], C_[:, 0]  # noqa: N806
    x = torch.cat([x, torch.randn(n, NH, 4)], -1)  # head_dim 12: two 8-wide blocks, the second masked
    kw = {"D": D, "dt_bias": dt_bias, "dt_limit": limit}
    ref_states = layer_pool(NH, 12, NS)
    states = ref_states.clone().to(DEV)  # a copy on CPU too (.to is a no-op there)
    ref = ssd_varlen(x, dt, A, B, C_, [1] * n, ROW_SLOTS, ref_states, ROWS, **kw)
    xd, dtd, Ad, Bd, Cd, sl = on_device(x, dt, A, B, C_, ROW_SLOTS)  # noqa: N806
    y = steps.ssd_decode_step(xd, dtd, Ad, Bd, Cd, sl, states, ROWS, block_p=8,
                              **{**kw, "D": D.to(DEV), "dt_bias": dt_bias.to(DEV)})
    close(y.cpu(), ref)
    close(states.cpu(), ref_states, equal_nan=True)


# --- speculative verifies: the state after each position (StateBatch.checkpoints) -------------


# (tokens, has_state, checkpoint slots) per segment, slots 1..4: a verify of K = 3 (3 checkpoints), a prompt
# chunk, a verify of K = 1, a plain decode row (engine/extras/speculative/states.py)
VERIFY = [(4, True, (5, 6, 7)), (9, False, ()), (2, True, (8,)), (1, True, ())]


def _kernel(kind: str, n: int, conv_params):  # noqa: ANN001, ANN202
    """(per-token inputs, step, chunk, part shape, StateBatch call) of one recurrent kernel."""
    from engine.recurrent.batch import StateBatch

    if kind == "conv":
        w, b, g = conv_params
        return ([torch.randn(n, C, generator=g)], lambda x, st: causal_conv1d_step(x, w, b, st),
                lambda x, st: causal_conv1d(x, w, b, st), (C, K - 1),
                lambda sb, x: StateBatch.conv(sb, "p", x, w, b))
    if kind == "gdn":
        return (list(gdn_inputs(n, 21)), recurrent_gated_delta_step, chunk_gated_delta_rule, (HV, DK, DV),
                lambda sb, *a: StateBatch.gated_delta(sb, "p", *a))
    x, dt, A, B, C_, D, dt_bias = ssd_inputs(n, 22)  # noqa: N806
    kw = {"D": D, "dt_bias": dt_bias}
    return ([x, dt, B, C_], lambda *a: ssd_step(a[0], a[1], A, *a[2:], **kw),
            lambda *a: ssd_chunk_scan(a[0], a[1], A, *a[2:], chunk_size=32, **kw), (NH, HP, NS),
            lambda sb, *a: StateBatch.ssd(sb, "p", a[0], a[1], A, a[2], a[3], **kw))


@pytest.mark.parametrize("kind", ["conv", "gdn", "ssd"])
@pytest.mark.parametrize("triton", [False, pytest.param(True, marks=needs_triton)])
def test_verify_checkpoints_hold_the_state_after_each_position(kind: str, triton: bool, conv,
                                                               request: pytest.FixtureRequest) -> None:
    """A batch with two speculative verifies: their outputs and final states equal decoding their tokens
    one at a time, and checkpoint slot j holds the state after position j; the prompt chunk and the
    decode row beside them run as without checkpoints. triton: the verify positions through the Triton
    decode steps (the interpreter on CPU)."""
    from engine.recurrent.batch import StateBatch
    from engine.recurrent.state_pool import StatePart, StatePool, StateSpec

    if triton:
        request.getfixturevalue("interpreter")
    n_tok = sum(n for n, _, _ in VERIFY)
    inputs, step, chunk, shape, call = _kernel(kind, n_tok, conv)
    pool = StatePool(StateSpec((StatePart("p", shape, torch.float32),)), 8, "cpu")
    part = pool.part("p")
    part.copy_(torch.randn(part.shape, generator=torch.Generator().manual_seed(23)) * 0.3)
    want, at = [], 0
    states = part.clone()
    for slot, (n, has_state, ck) in enumerate(VERIFY, start=1):
        rows = [t[at : at + n] for t in inputs]
        st = states[slot] if has_state else None
        if ck or n == 1:  # a verify or a decode row: one token at a time
            for j in range(n):
                y, new = step(*(r[j : j + 1] for r in rows), (st if st is not None else torch.zeros(shape))[None])
                st = new[0]
                want.append(y)
                if j < len(ck):
                    states[ck[j]] = st
        else:
            y, st = chunk(*rows, st)
            want.append(y)
        states[slot] = st
        at += n
    sb = StateBatch(pool, torch.arange(1, len(VERIFY) + 1), [n for n, _, _ in VERIFY], [h for _, h, _ in VERIFY],
                    triton=triton, checkpoints=[ck for _, _, ck in VERIFY])
    got = call(sb, *inputs)
    close(got, torch.cat(want))
    close(part, states)
