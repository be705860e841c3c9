"""The combination matrix (issue 51): every tiny model family crossed with every pair of features; each cell
serves the reference's greedy tokens, or is refused with a clear message (at start-up, or per request as a
400), or it fails (a defect, with the reason). `scripts/combination_matrix.py` writes the result into
docs/combination_matrix.md and .json; tests/matrix/test_combination_matrix.py checks they are current.

Cost: one engine per (model, start-up feature set): the empty set, each start-up feature alone and each pair.
The request-level features ride in those engines' batches: each alone (a cell with the start-up feature) in
a single-feature engine, each pair in the plain engine. A pair of start-up features runs the plain prompts only.

Every engine serves the same waves (page size 4, 8 new tokens, greedy):
  0   one request per request-level combination, each on its own 12-token prompt (sessions: the first turn)
  0b  sessions: the second turn, its prompt built by the frontend's SessionStore from the first turn's tokens
  1   P0 (24 tokens)
  2   P1 and P2 (40 tokens each) together: in a retraction engine's pool (22 pages) their growth retracts
      one; in a host-tier engine's pool (26 pages) P0's cached pages are evicted to the host tier
  3   P0 again: a host-tier engine loads its pages back from the host
  4   retraction engines only: ten 4-token prompts together (SHORT): each is admitted on its prompt's page and
      grows to 3 pages, 30 in all: some are retracted whatever the model (a sliding-window model's requests,
      whose pages behind the window are freed, never outgrow the pool in waves 1-3)
and each request's tokens are compared with the reference: the same model, colocated, TP 1, no feature (a
grammar or a LoRA adapter is part of the reference when the request asks for it, an FP8 KV cache when the
engine has one), one request at a time.

Evidence that a feature did something (else the cell proves nothing and is a failure): speculation proposed
drafts (a counter), the host tier loaded pages back (bytes), retraction retracted and reloaded (counters),
the adapter changes the reference's tokens, a grammar's output matches its regex, a session pinned its KV,
n > 1 gives two choices, logprobs come one per token within 1e-3 of the reference's, an FP8 engine's pools are
FP8 (the prefill's and the decode's in PD).
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.extras.lora.adapter import ATTN, MLA_ATTN, write_random_adapter
from engine.extras.speculative.config import SpecConfig
from engine.sampling.grammar import load_hf_tokenizer
from engine.sampling.params import SamplingParams
from service.protocol import RequestError
from service.sessions import SessionStore, attach_session, session_prompt
from tests.matrix.engines import PD, Colocated, RankServer, Request, Served, tp_config
from tests.matrix.families import ACTIVE, KINDS, write_model

STARTUP = ("tp2", "pd", "ngram", "draft", "lora", "host", "priority", "retract", "fp8")
REQUEST = ("sessions", "grammar", "n2", "logprobs")
FEATURES = STARTUP + REQUEST
NAMES = {"tp2": "TP 2", "pd": "PD", "ngram": "n-gram spec", "draft": "draft spec", "lora": "LoRA",
         "host": "host tier", "priority": "priority", "retract": "retraction", "fp8": "FP8 KV cache",
         "sessions": "sessions",
         "grammar": "grammar", "n2": "n > 1", "logprobs": "logprobs"}
EXCLUSIVE = {frozenset({"ngram", "draft"}): "one --speculative method per engine"}
STATUSES = ("works", "off", "refused", "fails", "n/a")

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
REGEX = r"(cat|dog|bird)s?"
GRAMMAR = SamplingParams(temperature=0.0, max_new_tokens=12, regex=REGEX)
ENGINE = dict(page_size=4, max_total_tokens=1024, host_kv_tokens=2048, chunked_prefill_size=32,
              max_prefill_tokens=128, max_running_requests=16, threads=1, prefix_cache=True)
RETRACT_POOL = 88  # tokens: 22 pages; P1 + P2 prompts take 20, their 8 new tokens 4 more
HOST_POOL = 104  # tokens: 26 pages; P1 + P2 with their outputs take 24, so P0's cached pages go to the host
PREFILL_HOST_POOL = 80  # tokens: 20 pages, P1's and P2's prompts: a PD prefill's P0 pages go to the host
LOGPROB_ATOL = 1e-3
FP8 = "fp8_e4m3"  # the fp8 feature's --kv-cache-dtype


def _prompt(seed: int, n: int) -> list[int]:
    """n token ids from the models' ACTIVE set (see families.py: the tokens their output favours), so the
    output's tokens often occur earlier in the prompt and n-gram speculation finds matches to propose."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(ACTIVE.start, ACTIVE.stop, (n,), generator=g).tolist()


P0, P1, P2 = _prompt(1, 24), _prompt(2, 40), _prompt(3, 40)
SHORT = [_prompt(200 + i, 4) for i in range(10)]  # wave 4: retraction engines only
EXTRA = _prompt(4, 6)  # a session's second turn sends these new tokens


def clean(text: str, model_dir: str = "") -> str:
    """A message without the run's temporary paths and ports (the doc must not change from run to run)."""
    if model_dir:
        text = text.replace(model_dir, "<model>")
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:<port>", text)
    text = re.sub(r"/tmp/\S+", "<path>", text)
    return " ".join(text.split())[:300]


# ---- the models and their references -------------------------------------------------------------------
@dataclass
class Model:
    kind: str
    path: str
    draft: str  # the draft model of draft speculation: the dense model (same vocabulary)
    adapter: str  # a random LoRA adapter on the attention projections
    ref: Reference = field(init=False)

    def __post_init__(self) -> None:
        self.ref = Reference(self)


def build_models(root: Path, kinds: tuple[str, ...] = KINDS) -> list[Model]:
    """Each family's directory under `root` (the dense model too: every model's draft)."""
    from engine.config import ModelConfig

    dense = str(write_model("dense", root / "dense"))
    out = []
    for kind in kinds:
        path = dense if kind == "dense" else str(write_model(kind, root / kind))
        mc = ModelConfig.from_dir(path)
        adapter = str(write_random_adapter(root / f"{kind}-lora", mc, rank=4,  # attention only: MoE takes it
                                           targets=ATTN + MLA_ATTN, seed=5, std=0.3))  # the model's own (MLA: q_a..)
        out.append(Model(kind, path, dense, adapter))
    return out


class Reference:
    """A model's reference tokens and logprobs per (prompt, grammar, adapter, FP8 KV): colocated, TP 1, no other
    feature, each request alone (the prefix cache flushed between them); computed on demand and kept. An FP8 KV
    cell's reference stores its KV in FP8 too (the quantization's own error is issue 49's figure, not a cell's)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.known: dict[tuple, tuple[list[int], list[float]]] = {}
        self.engines: dict[tuple[bool, bool], Colocated] = {}

    def get(self, ids: list[int], grammar: bool, lora: bool, fp8: bool = False) -> tuple[list[int], list[float]]:
        key = (tuple(ids), grammar, lora, fp8)
        if key not in self.known:
            if (lora, fp8) not in self.engines:
                extra: dict[str, Any] = {"lora_paths": (f"a={self.model.adapter}",), "max_lora_rank": 8} if lora else {}
                if fp8:
                    extra["kv_cache_dtype"] = FP8
                self.engines[(lora, fp8)] = Colocated(EngineConfig(model=self.model.path, **ENGINE, **extra), None)
            eng = self.engines[(lora, fp8)]
            out = Served()
            fields = {"return_logprob": True, **({"lora": "a"} if lora else {})}
            eng.serve([Request("ref", list(ids), GRAMMAR if grammar else GREEDY, fields)], out)
            eng.kv.flush()
            done = out.done["ref"]
            assert done.error is None, f"the reference failed: {done.error}"
            self.known[key] = out.tokens["ref"], out.logprobs["ref"]
        return self.known[key]

    def close(self) -> None:
        for eng in self.engines.values():
            eng.close()
        self.engines.clear()

    def adapter_changes_tokens(self) -> bool:
        return any(self.get(p, False, True)[0] != self.get(p, False, False)[0] for p in (P0, P1))


# ---- one engine's run ------------------------------------------------------------------------------------
@dataclass
class Check:
    """One request's expectation: its reference key and what it asked for."""

    key: str  # the Served key of choice 0
    ids: list[int]
    grammar: bool = False
    n: int = 1
    logprobs: bool = False
    session: str = ""  # the second turn of this session (its first turn's pin is checked)


@dataclass
class EngineRun:
    startup: frozenset
    refused: str = ""  # start-up refusal (engine/service config validation)
    failed: str = ""  # a crash at start-up or while serving
    served: Served = field(default_factory=Served)
    counters: dict = field(default_factory=dict)
    plain: list[Check] = field(default_factory=list)
    combos: dict = field(default_factory=dict)  # frozenset of request features -> list[Check] | refusal str
    pins: dict = field(default_factory=dict)  # session id -> pages pinned after its first turn
    has_cache: bool = True
    seconds: float = 0.0


def engine_config(model: Model, startup: frozenset) -> EngineConfig:
    """The engine of `startup` on `model` (ValueError: refused at start-up, naming the flag)."""
    kw: dict[str, Any] = dict(ENGINE, model=model.path)
    if "tp2" in startup:
        kw["tp"] = 2
    if "ngram" in startup:
        kw["spec"] = SpecConfig(speculative="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3,
                                speculative_max_batch=64)
    if "draft" in startup:
        kw["spec"] = SpecConfig(speculative="draft", draft_model=model.draft, num_speculative_tokens=3,
                                speculative_max_batch=64)
    if "lora" in startup:
        kw |= {"lora_paths": (f"a={model.adapter}",), "max_lora_rank": 8}
    if "host" in startup:
        kw |= {"hicache_host_tokens": 1024, "max_total_tokens": HOST_POOL}
    if "priority" in startup:
        kw["enable_priority_scheduling"] = True
    if "retract" in startup:
        kw |= {"max_total_tokens": RETRACT_POOL, "new_token_ratio": 0.0}
    if "fp8" in startup:
        kw["kv_cache_dtype"] = FP8
    return tp_config(EngineConfig(**kw))


def request_combos(startup: frozenset) -> list[frozenset]:
    """The request-level combinations an engine of `startup` serves: all singles and pairs in the plain
    engine, the singles in a one-feature engine, none in a pair's."""
    if not startup:
        return [frozenset(c) for k in (1, 2) for c in itertools.combinations(REQUEST, k)]
    return [frozenset({f}) for f in REQUEST] if len(startup) == 1 else []


class Waves:
    """Builds and serves one engine's waves, recording what each request must match."""

    def __init__(self, eng: Any, run: EngineRun, startup: frozenset) -> None:
        self.eng, self.run, self.startup = eng, run, startup
        self.store = SessionStore(timeout_s=600.0)

    def fields(self, prio: int, **kw: Any) -> dict:
        out = dict(kw)
        if "lora" in self.startup:
            out["lora"] = "a"
        if "priority" in self.startup:
            out["priority"] = prio
        return out

    def request(self, rid: str, ids: list[int], combo: frozenset, prio: int, **kw: Any) -> tuple[Request, Check]:
        grammar, n, lp = "grammar" in combo, 2 if "n2" in combo else 1, "logprobs" in combo
        extra = {"n": 2} if n > 1 else {}
        if lp:
            extra["return_logprob"] = True
        req = Request(rid, ids, GRAMMAR if grammar else GREEDY, self.fields(prio, **extra, **kw))
        return req, Check(rid, ids, grammar, n, lp)

    def first_waves(self, combos: list[frozenset]) -> None:
        """Waves 0 and 0b: one request per combination (sessions: two turns)."""
        wave0: list[Request] = []
        turn2: list[tuple[frozenset, str, str]] = []
        for i, combo in enumerate(combos):
            rid, ids = f"q{i}", _prompt(100 + i, 12)
            if "sessions" in combo:
                refusal = self.session_refusal(combo, ids)
                if refusal:
                    self.run.combos[combo] = refusal
                    continue
                sid = f"s{i}"
                self.store.open(4096, sid)
                wave0.append(Request(rid, ids, GREEDY, self.fields(2, session_id=sid)))
                turn2.append((combo, sid, rid))
                continue
            req, check = self.request(rid, ids, combo, prio=i % 3)
            wave0.append(req)
            self.run.combos[combo] = [check]
        self.eng.serve(wave0, self.run.served)
        if not turn2:
            return
        pins = getattr(getattr(self.eng, "role", None), "sessions", None)
        self.run.pins = {sid: pins.pins[sid].pages if pins and sid in pins.pins else 0 for _, sid, _ in turn2}
        wave0b: list[Request] = []
        for combo, sid, rid in turn2:
            self.store.record(sid, rid, list(wave0[[r.rid for r in wave0].index(rid)].ids)
                              + self.run.served.tokens[rid])
            ids, _ = session_prompt({"session_params": {"id": sid}}, EXTRA, self.store, "colocated")
            req, check = self.request(f"{rid}t2", ids, combo, prio=2, session_id=sid)
            check.session = sid
            wave0b.append(req)
            self.run.combos[combo] = [check]
        self.eng.serve(wave0b, self.run.served)
        for _, sid, _ in turn2:
            self.eng.role.close_session(sid)

    def session_refusal(self, combo: frozenset, ids: list[int]) -> str:
        """The 400 a service gives this session request, or "" (the frontend's own checks)."""
        if self.eng.pd:  # the frontend of a decode (or prefill) service
            try:
                session_prompt({"session_params": {"id": "x"}}, ids, None, "decode")
            except RequestError as e:
                return f"400: {e}"
        if "n2" in combo:
            parsed = _Parsed(n=2)
            try:
                attach_session(parsed, _SessionParams("x"))
            except RequestError as e:
                return f"400: {e}"
        return ""

    def plain_waves(self) -> None:
        """Waves 1-3: P0; P1 and P2 together; P0 again. Wave 4 in a retraction engine: SHORT together."""
        waves = [[("p0", P0, 1)], [("p1", P1, 0), ("p2", P2, 5)], [("p0b", P0, 1)]]
        if "retract" in self.startup:
            waves.append([(f"r{i}", ids, i % 3) for i, ids in enumerate(SHORT)])
        for wave in waves:
            reqs = []
            for rid, ids, prio in wave:
                req, check = self.request(rid, ids, frozenset(), prio)
                reqs.append(req)
                self.run.plain.append(check)
            self.eng.serve(reqs, self.run.served)


@dataclass
class _Req:
    n: int


class _Parsed:
    """The part of a parsed /generate that attach_session reads."""

    def __init__(self, n: int) -> None:
        self.req = _Req(n)
        self.session = None


@dataclass
class _SessionParams:
    id: str
    replace: bool | None = None


def run_engine(model: Model, startup: frozenset, ranks: RankServer | None) -> EngineRun:
    run = EngineRun(startup)
    t0 = time.monotonic()
    try:
        cfg = engine_config(model, startup)
        tp_ranks = ranks if "tp2" in startup else None
        if "pd" in startup:  # a host-tier prefill's pool is small enough that P1 and P2 evict P0 (it holds no output)
            eng: Any = PD(cfg, tp_ranks, PREFILL_HOST_POOL if "host" in startup else 0)
        else:
            eng = Colocated(cfg, tp_ranks)
    except ValueError as e:
        run.refused = clean(str(e), model.path)
        return run
    except Exception as e:  # noqa: BLE001 - a crash at start-up is the cell's defect, recorded
        run.failed = f"start-up: {type(e).__name__}: {clean(str(e), model.path)}"
        return run
    try:
        kv = eng.kv if hasattr(eng, "kv") else eng.p_kv
        run.has_cache = kv.cache is not None
        waves = Waves(eng, run, startup)
        combos = request_combos(startup)
        if combos:
            waves.first_waves(combos)
        waves.plain_waves()
        run.counters = eng.counters()
    except Exception as e:  # noqa: BLE001 - a crash while serving is the cell's defect, recorded
        run.failed = f"serving: {type(e).__name__}: {clean(str(e), model.path)}"
    finally:
        rank_error = eng.close()
        if rank_error and not run.failed:
            run.failed = f"TP rank 1: {clean(rank_error, model.path)}"
    run.seconds = time.monotonic() - t0
    return run


# ---- verdicts --------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    status: str  # works | off | refused | fails | n/a
    note: str = ""


def _check(model: Model, run: EngineRun, c: Check, lora: bool, fp8: bool) -> str:
    """"" when request `c` served its reference (and its own feature's evidence), else why not."""
    served = run.served
    done = served.done.get(c.key)
    if done is None:
        return f"{c.key}: no answer"
    if done.error is not None:
        return f"{c.key}: {done.error_code} {clean(done.error, model.path)}"
    want, want_lp = model.ref.get(c.ids, c.grammar, lora, fp8)
    for i in range(c.n):
        key = c.key if i == 0 else f"{c.key}#{i}"
        got = served.tokens.get(key)
        if got != want:
            return f"{key}: tokens {got} differ from the reference's {want}"
        if c.logprobs:
            lp = served.logprobs.get(key, [])
            if len(lp) != len(got):
                return f"{key}: {len(lp)} logprobs for {len(got)} tokens"
            worst = max((abs(a - b) for a, b in zip(lp, want_lp)), default=0.0)
            if worst > LOGPROB_ATOL:
                return f"{key}: logprobs differ from the reference's by {worst:.2e}"
    if c.n > 1 and f"{c.key}#1" not in served.done:
        return f"{c.key}: n=2 gave one choice"
    if c.grammar:
        text = load_hf_tokenizer(model.path).decode(served.tokens[c.key], skip_special_tokens=True)
        if not re.fullmatch(REGEX, text):
            return f"{c.key}: grammar output {text!r} does not match {REGEX!r}"
    return ""


def _evidence(model: Model, run: EngineRun, feature: str) -> str:
    """"" when the run shows start-up `feature` did something, else why not."""
    k = run.counters
    if feature in ("ngram", "draft") and not k.get("spec_proposed"):
        return "no draft token was proposed"
    if feature == "host" and not k.get("host_loaded_bytes"):
        return "no page came back from the host tier"
    if feature == "retract":
        if not k.get("retractions"):
            return "no request was retracted"
        if k["reloads"] != k["retractions"]:
            return f"{k['retractions']} retractions but {k['reloads']} reloads"
    if feature == "fp8" and not k.get("kv_fp8"):
        return "the KV pool is not FP8"
    if feature == "lora" and not model.ref.adapter_changes_tokens():
        return "the adapter changes no token"
    return ""


def judge(model: Model, runs: dict[frozenset, EngineRun], cell: frozenset) -> Verdict:
    """The verdict of `cell` (one or two features) on `model` from its engines' runs."""
    if cell in EXCLUSIVE:
        return Verdict("n/a", EXCLUSIVE[cell])
    startup = frozenset(f for f in cell if f in STARTUP)
    request = frozenset(f for f in cell if f in REQUEST)
    run = runs[startup]
    if run.refused:
        return Verdict("refused", f"start-up: {run.refused}")
    if run.failed:
        return Verdict("fails", run.failed)
    lora = "lora" in startup
    if request:
        checks = run.combos.get(request)
        if isinstance(checks, str):
            return Verdict("refused", f"per request: {checks}")
    else:
        checks = run.plain
    if checks is None:
        return Verdict("fails", "the matrix ran no request for this cell")
    for c in checks:
        why = _check(model, run, c, lora, "fp8" in startup)
        if why:
            return Verdict("fails", why)
    for f in sorted(startup):
        why = _evidence(model, run, f)
        if why:
            return Verdict("fails", why)
    if "sessions" in request:
        sid = next(c.session for c in checks if c.session)
        if not run.pins.get(sid):
            if not run.has_cache:
                return Verdict("off", "served; no prefix cache on this model, so the session's KV is not kept "
                                      "(each turn recomputes its history)")
            return Verdict("fails", "the session's KV was not pinned after its first turn")
    if "grammar" in request and startup & {"ngram", "draft"}:
        return Verdict("off", "served; structured-output requests never speculate (documented: "
                              "engine/extras/speculative/policy.py SwitchOff)")
    return Verdict("works")


def cells() -> list[frozenset]:
    """Every cell: each feature alone, then each pair, in FEATURES order."""
    return [frozenset({f}) for f in FEATURES] + [frozenset(p) for p in itertools.combinations(FEATURES, 2)]


def cell_name(cell: frozenset) -> str:
    return "+".join(f for f in FEATURES if f in cell)


def startup_sets() -> list[frozenset]:
    sets = {frozenset(f for f in c if f in STARTUP) for c in cells()}
    return sorted((s for s in sets if s not in EXCLUSIVE), key=lambda s: (len(s), [FEATURES.index(f) for f in s]))


def run_model(model: Model, ranks: RankServer | None, log: Any = None) -> tuple[dict[str, Verdict], dict]:
    """Every engine of `model`, then every cell's verdict: ({cell name: verdict}, {engine: seconds})."""
    runs: dict[frozenset, EngineRun] = {}
    for s in startup_sets():
        runs[s] = run_engine(model, s, ranks)
        if log is not None:
            state = "refused" if runs[s].refused else "failed" if runs[s].failed else "ran"
            log(f"{model.kind:8s} {'+'.join(sorted(s)) or 'plain':18s} {state:8s} {runs[s].seconds:5.1f}s "
                f"{runs[s].counters}")
    verdicts = {cell_name(c): judge(model, runs, c) for c in cells()}
    return verdicts, {"+".join(sorted(s)) or "plain": round(r.seconds, 2) for s, r in runs.items()}


def run_matrix(root: Path, kinds: tuple[str, ...] = KINDS, log: Any = None) -> dict[str, dict[str, Verdict]]:
    """The whole matrix: {model kind: {cell name: verdict}}."""
    torch.set_num_threads(1)
    models = build_models(root, kinds)
    ranks = RankServer()
    try:
        out = {}
        for mod in models:
            try:
                out[mod.kind] = run_model(mod, ranks, log)[0]
            finally:
                mod.ref.close()
        return out
    finally:
        ranks.close()
