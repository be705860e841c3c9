"""The Mamba2 hybrids (Nemotron-H: engine/models/nemotron_h.py, Granite-4.0-H: granitemoehybrid.py) against
transformers' own torch code, fp32, on random-weight directories written by transformers' config and
model classes (hidden 64, 5-7 layers mixing every block kind, small Mamba chunk sizes).

Per family: teacher-forced logits within 1e-3 over prompts of 2..700 tokens prefilled in 64- or 128-token
engine chunks (the Mamba chunk 64 or 128, so engine chunks both split and span scan chunks); decoding one
token at a time after a prefill equal to the teacher-forced logits there; two requests of different lengths
in one forward (a prompt chunk beside another, a chunk beside a one-token step) equal to each alone; the KV
pool holding the attention layers only and the state slot every Mamba2 layer's conv window and SSM state.
Then config fields refused by name, the tensor-parallel slicing of every rank's weights, and 2 or 4 TP
ranks (threads of this process, their all-reduces summed in process) together against transformers.

The engine side runs through ModelRunner with explicit Segment.slot (one recurrent-state slot per request);
the TP ranks through the same build_batch / ForwardContext / StateBatch calls (ModelRunner refuses TP over
recurrent layers for now).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.distributed.tp import TPGroup
from engine.forward.forward_batch import LOGITS_ALL, Segment, forward_segments
from engine.kvcache.memory import pages_for
from engine.models.registry import family

VOCAB = 256
MAX_LEN = 700
NEMOTRON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                conv_kernel=4, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=48, max_position_embeddings=1024)
GRANITE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
               shared_intermediate_size=48, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_state=16,
               mamba_d_conv=4, max_position_embeddings=1024, embedding_multiplier=12.0, residual_multiplier=0.22,
               attention_multiplier=0.2, logits_scaling=2.0)
# name -> (model_type, config fields, engine chunk); each Mamba chunk differs from its engine chunk
CASES = {
    # every block kind; grouped sigmoid routing (top-2 within the best of 2 groups) scaled by 2.5
    "nemotron": ("nemotron_h", NEMOTRON | dict(
        layers_block_type=["linear_attention", "full_attention", "mlp", "moe", "linear_attention", "mlp",
                           "full_attention"], chunk_size=128, n_group=2, topk_group=1, routed_scaling_factor=2.5),
        64),
    # latent experts, every bias, no conv bias, a dt clamp, the old pattern string, no renormalisation
    "nemotron-latent": ("nemotron_h", NEMOTRON | dict(
        hybrid_override_pattern="M*EME-", chunk_size=64, moe_latent_size=32, mlp_bias=True, use_bias=True,
        use_conv_bias=False, time_step_limit=(0.0, 0.08), norm_topk_prob=False), 128),
    # rope, attention biases, MoE + shared MLP, Granite's multipliers
    "granite": ("granitemoehybrid", GRANITE | dict(
        num_hidden_layers=5, layer_types=["mamba", "attention", "mamba", "mamba", "attention"], num_local_experts=6,
        mamba_n_groups=2, mamba_chunk_size=64, position_embedding_type="rope", attention_bias=True), 128),
    # dense (shared MLP only), no positional embedding, one Mamba group, projection biases, tied embeddings
    "granite-dense": ("granitemoehybrid", GRANITE | dict(
        num_hidden_layers=4, layer_types=["attention", "mamba", "mamba", "attention"], num_local_experts=0,
        mamba_n_groups=1, mamba_chunk_size=128, position_embedding_type="nope", mamba_proj_bias=True,
        tie_word_embeddings=True), 64),
}


def hf_config(name: str, **overrides: object):  # noqa: ANN201
    from transformers import GraniteMoeHybridConfig, NemotronHConfig

    mtype, fields, _ = CASES[name]
    cls = NemotronHConfig if mtype == "nemotron_h" else GraniteMoeHybridConfig
    return cls(**(fields | overrides))


def randomize(model: torch.nn.Module, std: float = 0.15) -> None:
    """Weights N(0, std), biases N(0, 0.1), norms U(0.5, 1.5); Mamba's A = -U(0.05, 1.5), dt_bias the inverse
    softplus of U(0.005, 0.1) (decays slow enough that state crosses engine and scan chunks), D ~ N(1, 0.5),
    conv N(0, 0.4); the router's correction bias N(0, 0.1) (a buffer: it must be loaded too)."""
    g = torch.Generator().manual_seed(1)

    def draw(shape: torch.Size, lo: float = 0.0, hi: float = 0.0, mean: float = 0.0, sd: float = 0.0) -> torch.Tensor:
        if sd:
            return torch.randn(shape, generator=g) * sd + mean
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            leaf = name.rsplit(".", 1)[-1]
            if "rotary" in name or "inv_freq" in leaf:
                continue
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or "layernorm" in name:
                p.copy_(draw(p.shape, 0.5, 1.5))
            elif leaf == "A_log":
                p.copy_(draw(p.shape, 0.05, 1.5).log())
            elif leaf == "dt_bias":
                dt = draw(p.shape, 0.005, 0.1)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif leaf == "D":
                p.copy_(draw(p.shape, mean=1.0, sd=0.5))
            elif "conv1d" in name:
                p.copy_(draw(p.shape, sd=0.4))
            elif p.dim() == 1:
                p.copy_(draw(p.shape, sd=0.1))
            else:
                p.copy_(draw(p.shape, sd=std))


def save(name: str, path, **overrides: object):  # noqa: ANN001, ANN201
    """transformers' model of case `name` (random weights, eval), saved fp32 at `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(name, **overrides), attn_implementation="eager",
                                             dtype=torch.float32).eval()
    randomize(model)
    model.save_pretrained(path)
    return model


def runner_for(path, chunk: int):  # noqa: ANN001, ANN201
    from engine.forward.model_runner import ModelRunner

    return ModelRunner(EngineConfig(model=str(path), max_total_tokens=4096, page_size=16, chunked_prefill_size=chunk,
                                    max_running_requests=4, threads=1))


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


class Request:
    """One request on the runner: its pages (for MAX_LEN tokens) and state slot."""

    def __init__(self, runner, ids: list[int]) -> None:  # noqa: ANN001
        self.runner, self.ids = runner, ids
        self.pages = runner.pool.allocator.allocate(pages_for(MAX_LEN, runner.page_size))
        self.slot = runner.states.allocate(1)[0]

    def segment(self, start: int, end: int) -> Segment:
        return Segment(self.pages, start, self.ids[start:end], LOGITS_ALL, slot=self.slot)

    def run(self, cuts: list[int]) -> torch.Tensor:
        """Logits [n, V] of ids[:cuts[-1]], one forward per [cuts[i], cuts[i+1])."""
        return torch.cat([forward_segments(self.runner, [self.segment(a, b)]).logits[0]
                          for a, b in zip(cuts, cuts[1:])])

    def free(self) -> None:
        self.runner.pool.allocator.free(self.pages)
        self.runner.states.free([self.slot])


def chunked(n: int, chunk: int) -> list[int]:
    return [*range(0, n, chunk), n]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):  # noqa: ANN001, ANN201
    path = tmp_path_factory.mktemp(request.param)
    hf = save(request.param, path)
    chunk = CASES[request.param][2]
    return request.param, hf, runner_for(path, chunk), chunk


def reference(hf, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_kv_pool_holds_attention_layers_and_the_slot_every_mamba_layer(case) -> None:  # noqa: ANN001
    name, hf, runner, _ = case
    cfg = runner.model_cfg
    kinds = cfg.hybrid.kinds
    assert cfg.attention_layers == tuple(i for i, k in enumerate(kinds) if k == "attention")
    assert runner.pool.buffer.shape[1] == len(cfg.attention_layers) < cfg.num_layers
    m = cfg.hybrid.mamba
    assert (m.num_heads, m.head_dim, m.d_state) == (8, 16, 16)
    want = []
    for i, k in enumerate(kinds):
        if k == "mamba":
            want += [(f"{i}.conv", (m.conv_dim, m.conv_kernel - 1), torch.float32),
                     (f"{i}.ssm", (m.num_heads, m.head_dim, m.d_state), torch.float32)]
    assert [(p.name, p.shape, p.dtype) for p in runner.states.spec.parts] == want


def test_teacher_forced_logits_match_transformers(case) -> None:  # noqa: ANN001
    name, hf, runner, chunk = case
    worst, scale = {}, 0.0
    for n in (2, 130, MAX_LEN):
        ids = prompt(n, n)
        ref = reference(hf, ids)
        scale = max(scale, ref.abs().max().item())
        req = Request(runner, ids)
        try:
            worst[n] = (req.run(chunked(n, chunk)) - ref).abs().max().item()
        finally:
            req.free()
    print(f"{name}: max abs logit diff by prompt length {worst}")
    assert scale > 1.0  # logits large enough for 1e-3 to mean something
    assert max(worst.values()) < 1e-3, f"{name}: max abs logit diff by prompt length {worst}"


def test_decode_steps_equal_teacher_forced_logits(case) -> None:  # noqa: ANN001
    """A prefill (in engine chunks), then 40 one-token steps: the recurrent step path of conv and SSD."""
    name, hf, runner, chunk = case
    ids = prompt(7, 190)
    ref = reference(hf, ids)
    req = Request(runner, ids)
    try:
        got = req.run([*chunked(150, chunk)[:-1], *range(150, 191)])
    finally:
        req.free()
    diff = (got - ref).abs().max().item()
    assert diff < 1e-3, f"{name}: decode steps differ from teacher-forced logits by {diff}"


def test_two_requests_in_one_forward_equal_each_alone(case) -> None:  # noqa: ANN001
    """Request a (200 tokens) and b (91) in lockstep: chunk beside chunk, then a chunk beside b's one-token
    step, then a alone; each equal to its own run alone (and to transformers)."""
    name, hf, runner, chunk = case
    a_ids, b_ids = prompt(11, 200), prompt(12, 91)
    cuts = {"a": [0, 64, 128, 192, 200], "b": [0, 64, 90, 91]}
    alone = {}
    for key, ids in (("a", a_ids), ("b", b_ids)):
        req = Request(runner, ids)
        try:
            alone[key] = req.run(cuts[key])
        finally:
            req.free()
    reqs = {"a": Request(runner, a_ids), "b": Request(runner, b_ids)}
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    try:
        for step in range(4):
            live = [k for k in ("a", "b") if step + 1 < len(cuts[k])]
            segs = [reqs[k].segment(cuts[k][step], cuts[k][step + 1]) for k in live]
            for k, logits in zip(live, forward_segments(runner, segs).logits):
                got[k].append(logits)
    finally:
        for r in reqs.values():
            r.free()
    for key, ids in (("a", a_ids), ("b", b_ids)):
        batched = torch.cat(got[key])
        assert (batched - alone[key]).abs().max().item() < 1e-4, f"{name}: request {key} batched != alone"
        assert (batched - reference(hf, ids)).abs().max().item() < 1e-3


def test_nemotron_reads_the_pattern_string_as_transformers_does() -> None:
    """hybrid_override_pattern (older checkpoints) when layers_block_type is absent; the list wins over it."""
    from engine.models.nemotron_h import config

    raw = {k: v for k, v in _raw("nemotron").items() if k != "layers_block_type"}
    assert config(raw | {"hybrid_override_pattern": "M*-EM"}).hybrid.kinds == ("mamba", "attention", "mlp", "moe",
                                                                             "mamba")
    cfg = config(_raw("nemotron") | {"hybrid_override_pattern": "M*"})
    assert cfg.num_layers == 7 and cfg.attention_layers == (1, 6)
    assert config(raw).hybrid.kinds == ("mamba", "moe", "attention", "mlp")  # transformers' default
    old = {k: v for k, v in _raw("nemotron").items() if k != "head_dim"}
    assert config(old | {"attention_head_dim": 32}).head_dim == 32  # NVIDIA's original field name


def _raw(name: str) -> dict:
    """config.json of case `name` as transformers writes it."""
    return hf_config(name).to_dict()


@pytest.mark.parametrize("name,change,field", [
    ("nemotron", {"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ("nemotron", {"mamba_hidden_act": "relu"}, "mamba_hidden_act"),
    ("nemotron", {"sliding_window": 128}, "sliding_window"),
    ("nemotron", {"time_step_limit": [0.1]}, "time_step_limit"),
    ("nemotron", {"time_step_limit": [0.2, 0.1]}, "time_step_limit"),
    ("nemotron", {"layers_block_type": ["linear_attention", "cross_attention"]}, "layers_block_type"),
    ("nemotron", {"layers_block_type": ["linear_attention", "mlp", "moe"]}, "layers_block_type"),
    ("nemotron", {"layers_block_type": None, "hybrid_override_pattern": "M*X"}, "hybrid_override_pattern"),
    ("nemotron", {"n_groups": 3}, "n_groups"),
    ("nemotron", {"n_group": 4}, "n_group"),
    ("nemotron", {"num_experts_per_tok": 4}, "num_experts_per_tok"),
    ("nemotron", {"model_type": "nemotron"}, "model_type"),
    ("granite", {"hidden_act": "gelu"}, "hidden_act"),
    ("granite", {"position_embedding_type": "alibi"}, "position_embedding_type"),
    ("granite", {"mamba_d_head": 12}, "mamba_d_head"),
    ("granite", {"mamba_n_groups": 3}, "mamba_n_groups"),
    ("granite", {"time_step_limit": None}, "time_step_limit"),
    ("granite", {"layer_types": ["mamba", "attention"]}, "layer_types"),
    ("granite", {"layer_types": ["mamba"] * 5}, "layer_types"),
    ("granite", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("granite", {"logits_scaling": 0}, "logits_scaling"),
    ("granite", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope"),
])
def test_configs_it_cannot_run_exactly_are_refused(name: str, change: dict, field: str) -> None:
    raw = _raw(name) | change
    with pytest.raises(ValueError, match=field):
        family(CASES[name][0]).config(raw)


@pytest.mark.parametrize("name,change,size,field", [
    ("nemotron", {"mamba_num_heads": 9, "n_groups": 3}, 2, "mamba_num_heads"),
    ("nemotron", {"mamba_num_heads": 6, "n_groups": 3}, 2, "n_groups"),
    ("granite", {"mamba_n_heads": 4, "mamba_expand": 1}, 8, "num_attention_heads"),
    ("granite", {"mamba_n_heads": 6, "mamba_n_groups": 3, "mamba_expand": 3, "mamba_d_head": "auto"}, 2,
     "mamba_n_groups"),
    ("granite", {"shared_intermediate_size": 50}, 4, "shared_intermediate_size"),
])
def test_tp_size_that_does_not_divide_is_refused(name: str, change: dict, size: int, field: str) -> None:
    fam = family(CASES[name][0])
    cfg = fam.config(_raw(name) | change)
    with pytest.raises(ValueError, match=field), torch.device("meta"):
        fam.Model(cfg, 8, TPGroup(0, size))


@pytest.mark.parametrize("name,size", [("nemotron-latent", 2), ("nemotron", 4), ("granite", 2),
                                       ("granite-dense", 2)])
def test_tp_ranks_weights_fit_their_model_and_slice_the_full_ones(tmp_path, name: str, size: int) -> None:
    """Every rank's weights() has exactly its Model's parameter shapes; heads' slices (in_proj's z and dt
    rows, A_log, out_proj's columns) concatenate to the full weights; B/C groups split when the TP size
    divides n_groups, else each rank holds its heads' group; the LM head on rank 0 only."""
    from safetensors.torch import load_file

    save(name, tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    fam, raw = family(cfg.model_type), load_file(str(tmp_path / "model.safetensors"))
    full = fam.weights(raw, cfg, TPGroup())
    ranks = [fam.weights(raw, cfg, TPGroup(r, size)) for r in range(size)]
    m = cfg.hybrid.mamba
    nh, inner, gn = m.num_heads // size, m.intermediate // size, m.n_groups * m.d_state
    for r, w in enumerate(ranks):
        with torch.device("meta"):
            model = fam.Model(cfg, 8, TPGroup(r, size))
        assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {n: tuple(t.shape) for n, t in w.items()}
        assert ("lm_head.weight" in w) == (r == 0 and not cfg.tie_embeddings)
        parts = model.state_spec().parts
        assert parts[1].shape == (nh, m.head_dim, m.d_state)
    i = cfg.hybrid.kinds.index("mamba")
    p = f"layers.{i}.{'mixer' if cfg.model_type == 'nemotron_h' else 'mamba'}."
    ng = max(1, m.n_groups // size)
    for key, first, count in (("z", 0, inner), ("dt", 2 * inner + 2 * ng * m.d_state, nh)):
        got = torch.cat([w[p + "in_proj.weight"][first : first + count] for w in ranks])
        start = 0 if key == "z" else 2 * m.intermediate + 2 * gn
        assert torch.equal(got, full[p + "in_proj.weight"][start : start + m.num_heads * (m.head_dim if key == "z"
                                                                                          else 1)]), key
    assert torch.equal(torch.cat([w[p + "A_log"] for w in ranks]), full[p + "A_log"])
    assert torch.equal(torch.cat([w[p + "out_proj.weight"] for w in ranks], 1), full[p + "out_proj.weight"])
    per_group = size // m.n_groups if size > m.n_groups else 0
    for r, w in enumerate(ranks):  # B rows of the conv: the rank's group(s)
        g0 = r // per_group if per_group else r * ng
        b = w[p + "conv_weight"][inner : inner + ng * m.d_state]
        assert torch.equal(b, full[p + "conv_weight"][m.intermediate + g0 * m.d_state :][: ng * m.d_state])
    assert math.isclose(sum(w[p + "norm_weight"].numel() for w in ranks), m.intermediate)



class _Reducer:
    """The all-reduce of ranks running as threads of this process: each deposits its tensor, all sum the
    deposits in rank order (the same result on every rank), in place."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * size

    def reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = x
        self.barrier.wait()
        total = sum(self.parts[1:], self.parts[0].clone())
        self.barrier.wait()
        return x.copy_(total)


class _ThreadGroup(TPGroup):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.reduce(self.rank, x) if self.size > 1 else x


class _Rank:
    """One TP rank's shard of the model with its own KV pool and state pool, forwarding segments as
    ModelRunner.forward does (the runner itself refuses TP over recurrent layers for now)."""

    def __init__(self, path, group: TPGroup) -> None:  # noqa: ANN001
        from engine.attention.registry import create_backend
        from engine.kvcache.memory import KVPool
        from engine.models.loader import load_model
        from engine.recurrent.state_pool import StatePool

        self.cfg = cfg = ModelConfig.from_dir(path)
        self.model = load_model(path, cfg, "float32", "cpu", 1024, tp=group)
        self.pool = KVPool(128, cfg.num_kv_layers, 16, self.model.local_kv_heads, cfg.head_dim, torch.float32, "cpu")
        self.states = StatePool(self.model.state_spec(), 4, "cpu")
        self.backend = create_backend("cpu")

    def forward(self, segments: list[Segment]) -> list[torch.Tensor] | None:
        from engine.attention.base import build_metadata
        from engine.forward.forward_batch import build_batch
        from engine.models.layers import ForwardContext
        from engine.recurrent.batch import StateBatch

        b = build_batch(segments, 16)
        meta = build_metadata(b.page_table, b.seq_lens, b.new_lens, 16, self.cfg.head_dim ** -0.5, "cpu")
        state = StateBatch(self.states, torch.tensor(b.state_slots), b.new_lens, [s.start > 0 for s in segments])
        ctx = ForwardContext(self.pool, self.backend, meta, torch.tensor(b.out_page), torch.tensor(b.out_offset),
                             native=getattr(self.backend, "native", None), state=state)
        hidden = self.model(torch.tensor(b.ids), torch.tensor(b.positions), ctx)
        if not self.model.tp.driver:
            return None
        logits = self.model.logits(hidden[torch.tensor(b.logit_rows)])
        return [logits[p] for p in b.picks]


@pytest.mark.parametrize("name,size", [("nemotron", 2), ("nemotron-latent", 4), ("granite", 4),
                                       ("granite-dense", 2)])
def test_tp_ranks_together_match_transformers(tmp_path, name: str, size: int) -> None:
    """`size` ranks as threads (their all-reduces summed in process): two requests in lockstep, prompt
    chunks, a chunk beside one-token steps, then steps alone; within 1e-3 of transformers. Groups split
    (nemotron: 2 over 2 ranks) or replicated, their gated norm's squares summed across ranks (the other
    three); attention heads split, KV heads replicated at 4 ranks; experts and MLPs by intermediate."""
    from concurrent.futures import ThreadPoolExecutor

    hf = save(name, tmp_path)
    reducer = _Reducer(size)
    ranks = [_Rank(tmp_path, _ThreadGroup(r, size, reducer)) for r in range(size)]
    assert ranks[0].states.spec.parts[-1].shape[0] == 8 // size  # this rank's Mamba heads
    ids = {"a": prompt(21, 136), "b": prompt(22, 75)}
    cuts = {"a": [0, 64, 128, *range(129, 137)], "b": [0, 64, 74, 75]}
    pages = {"a": list(range(1, 12)), "b": list(range(12, 17))}
    slots = {"a": 1, "b": 2}
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    with ThreadPoolExecutor(size) as pool:
        for step in range(max(len(c) for c in cuts.values()) - 1):
            live = [k for k in ("a", "b") if step + 1 < len(cuts[k])]
            segs = [Segment(pages[k], cuts[k][step], ids[k][cuts[k][step] : cuts[k][step + 1]], LOGITS_ALL,
                            slot=slots[k]) for k in live]
            outs = list(pool.map(_Rank.forward, ranks, [segs] * size))
            for k, logits in zip(live, outs[0]):
                got[k].append(logits)
    worst = max((torch.cat(got[k]) - reference(hf, ids[k])).abs().max().item() for k in ("a", "b"))
    print(f"{name} TP={size} vs transformers: max abs logit diff {worst:.2e}")
    assert worst < 1e-3, f"{name} TP={size} vs transformers: max abs logit diff {worst}"
