"""DraftProposer: a smaller model with the target's vocabulary proposes K tokens autoregressively on
its own paged KV pool (a second ModelRunner: its own pages, page size and length per request), and
`make_speculator`, which builds the Scheduler's Speculator (engine/extras/speculative/speculator.py)
with it. It lives beside the runner, not with the other speculative modules: it runs forwards, and
engine/extras sits below engine/forward.

Per step, for the requests that speculate:
1. Catch-up: the draft's KV of a request covers its first `length` tokens; the tokens after it (the
   whole prompt the first time, later the last token and the drafts the target accepted) run as one
   extend segment with logits at its last position, all requests batched in one forward. A catch-up
   longer than --chunked-prefill-size runs in chunks, one per step, and the request proposes nothing
   until it is done (a long prompt never stalls the batch's step). On a PD decode this is how the
   draft's prompt KV comes to exist: computed locally from the prompt ids the decode already has.
2. K-1 one-token forwards, batched, feed d0..d_{K-2}; d_j is drawn from the row before it: greedy
   requests take its argmax, sampling ones draw from q_j (the draft's distribution with the request's
   processors, temperature, top-k/p, min-p; seeded by position), kept in `spec.draft_probs` for the
   rejection rule (engine.extras.speculative.verify).
3. After the verify, `rollback` cuts the draft's length to the tokens both models agree on (the
   target's kv_len: its last token and the accepted drafts) and frees whole pages past it.
A request whose pages do not fit the draft pool proposes nothing this step. `forget` frees a request's
draft pages (finished, aborted, retracted: a reloaded request catches up again).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from common.checks import need
from engine.extras.speculative.config import SpecConfig
from engine.extras.speculative.speculator import Speculator
from engine.forward.forward_batch import LOGITS_LAST, Segment, forward_segments
from engine.forward.model_runner import ModelRunner
from engine.kvcache.kv_manager import KVManager
from engine.kvcache.memory import pages_for
from engine.request import Req
from engine.sampling.sampler import Sampler, draw_seed, generated

_Q_SALT = 0x2545F4914F6CDD1D  # keeps the draft's draws apart from the target's


@dataclass
class DraftKV:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens of the request whose draft KV is computed


def draft_engine_config(cfg):  # noqa: ANN001, ANN201
    """The draft runner's EngineConfig: the target's, with the draft model, no host pool, no prefix
    cache, no speculation, LoRA and host tiers off (only fields this tree has are replaced). It runs whole
    on rank 0 whatever the target's --tp (a draft is small: vLLM's draft_tensor_parallel_size=1), with the
    threads rank 0 already has (under TP each rank has its share of the cores)."""
    names = {f.name for f in dataclasses.fields(cfg)}
    off = {"model": cfg.spec.draft_model, "host_kv_tokens": 0, "spec": SpecConfig(), "prefix_cache": False,
           "hicache_host_tokens": 0, "hicache_dir": "", "lora_paths": (), "max_loaded_loras": 0,
           "tp": 1, "dist_init_addr": "", "dist_store_hosted": False,
           "threads": cfg.threads if cfg.tp == 1 else torch.get_num_threads()}
    return dataclasses.replace(cfg, **{k: v for k, v in off.items() if k in names})


class DraftProposer:
    def __init__(self, target: ModelRunner, cfg, sampler: Sampler) -> None:  # noqa: ANN001
        self.runner = ModelRunner(draft_engine_config(cfg))
        need(self.runner.states is None,
             f"--draft-model {cfg.spec.draft_model} ({self.runner.model_cfg.model_type}) has recurrent layers: a draft "
             "model must be attention-only (its proposals would need their own state checkpoints); a hybrid target "
             "takes an attention-only draft, or --speculative ngram")
        need(self.runner.model_cfg.vocab_size == target.model_cfg.vocab_size,
             f"--draft-model's vocabulary ({self.runner.model_cfg.vocab_size}) must be the target's "
             f"({target.model_cfg.vocab_size})")
        self.sampler = sampler
        self.alloc = self.runner.pool.allocator
        self.ps = self.runner.page_size
        self.chunk = cfg.chunked_prefill_size
        self.states: dict[int, tuple[Req, DraftKV]] = {}

    # ---- bookkeeping --------------------------------------------------------------------------
    def _state(self, r: Req) -> DraftKV:
        if id(r) not in self.states:
            self.states[id(r)] = (r, DraftKV())
        return self.states[id(r)][1]

    def _cut(self, st: DraftKV, length: int) -> None:
        st.length = min(st.length, length)
        keep = pages_for(st.length, self.ps)
        if len(st.pages) > keep:
            self.alloc.free(st.pages[keep:])
            del st.pages[keep:]

    def rollback(self, r: Req) -> None:
        """After a verify: keep the draft KV of the tokens the target kept (its kv_len)."""
        if id(r) in self.states:
            self._cut(self.states[id(r)][1], r.kv.kv_len)

    def forget(self, r: Req) -> None:
        entry = self.states.pop(id(r), None)
        if entry is not None and entry[1].pages:
            self.alloc.free(entry[1].pages)

    def retain(self, running: list[Req]) -> None:
        """Forget every request not in `running` (retracted, or ended without the scheduler)."""
        keep = {id(r) for r in running}
        for key in [k for k in self.states if k not in keep]:
            self.forget(self.states[key][0])

    def used_pages(self) -> int:
        return self.alloc.num_used

    # ---- one step -----------------------------------------------------------------------------
    def propose(self, reqs: list[Req], lens: list[int]) -> None:
        """Set r.spec.draft (and draft_probs when sampling) for each request; lens[i]: at most that many."""
        live: list[tuple[Req, DraftKV, int]] = []
        segments: list[Segment] = []
        for r, n in zip(reqs, lens):
            st = self._state(r)
            self._cut(st, r.kv.kv_len)  # positions past the target's are unverified (a dropped draft)
            todo = len(r.token_ids) - st.length
            step = min(todo, self.chunk)
            want = st.length + step + (n - 1 if step == todo else 0)
            grow = pages_for(want, self.ps) - len(st.pages)
            if grow > self.alloc.num_free:
                continue  # the draft pool is full: this request decodes plainly this step
            st.pages.extend(self.alloc.allocate(max(0, grow)))
            segments.append(Segment(st.pages, st.length, r.token_ids[st.length : st.length + step], LOGITS_LAST))
            st.length += step
            if step == todo:
                live.append((r, st, n))
        if not segments:
            return
        logits = forward_segments(self.runner, segments).logits
        rows = {id(s.pages): lg for s, lg in zip(segments, logits)}
        drafts = {id(r): ([], []) for r, _, _ in live}
        for r, st, _ in live:
            self._draw(r, rows[id(st.pages)], drafts[id(r)], 0)
        for j in range(1, max((n for _, _, n in live), default=0)):
            batch = [(r, st) for r, st, n in live if n > j]
            out = forward_segments(self.runner, [Segment(st.pages, st.length, [drafts[id(r)][0][-1]], LOGITS_LAST)
                                                 for r, st in batch]).logits
            for (r, st), lg in zip(batch, out):
                st.length += 1
                self._draw(r, lg, drafts[id(r)], j)
        for r, _, _ in live:
            toks, qs = drafts[id(r)]
            r.spec.draft = toks
            r.spec.draft_probs = torch.stack(qs) if qs else None

    def _draw(self, r: Req, row: torch.Tensor, acc: tuple[list[int], list[torch.Tensor]], j: int) -> None:
        """Draft token j of r from its draft logits row (fp32 [V])."""
        sp = r.sampling
        if sp.greedy:
            acc[0].append(int(torch.argmax(row)))
            return
        q = self.sampler.probs(row, r)
        g = torch.Generator().manual_seed(
            draw_seed(sp, r.rid, self.sampler.default_seed, len(generated(r)) + j) ^ _Q_SALT)
        acc[0].append(int(torch.multinomial(q, 1, generator=g)))
        acc[1].append(q)


def make_speculator(runner: ModelRunner, cfg, kv: KVManager, sampler: Sampler) -> Speculator | None:  # noqa: ANN001
    """The engine's Speculator from cfg.spec (None when --speculative is off); the draft method loads
    the draft model (a DraftProposer) next to `runner`."""
    sc: SpecConfig = cfg.spec
    if not sc.on:
        return None
    draft = DraftProposer(runner, cfg, sampler) if sc.speculative == "draft" else None
    return Speculator(sc, kv, runner.context_length, draft)
