"""A stand-in worker for frontend tests: speaks the real zmq/msgpack protocol, runs no model.

Each request generates the prompt's ids reversed, one token per step, then finishes ("stop", as on
an EOS; with ignore_eos it cycles on) or at max_new_tokens,
with `PDSERVE_STUB_DELAY_S` seconds between steps (default 0.005). It honours stop strings (on the
decoded output), stop_token_ids, aborts (by rid, room or all), logprobs (fixed values), and the
prefill role (one token, then finished), and n > 1 (choice i generates the reversed prompt rotated
by i). POST /v1/embeddings is answered with a fake vector per input (`fake_embedding`: deterministic
in its ids, `dimensions` or the config's hidden_size long, normalised). Prompts containing
`[[stub:error]]` fail with 500, `[[stub:crash]]` kills the worker process.

Run a whole service with it: `python -m tests.stub_worker --role prefill --model DIR --port N ...`
(any flag of `pdserve prefill`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from service import messages as m
from service.channels import WorkerChannels
from service.config import ServerConfig
from service.stats import Counters, Histo, KVStats, TransferTotals, WorkerStats


@dataclass
class StubReq:
    msg: m.GenerateReq
    plan: list[int]
    max_new: int
    out: list[int] = field(default_factory=list)
    sent_input_lp: bool = False
    index: int = 0  # the choice (n > 1): its plan is the reversed prompt rotated by index


def _context_length(cfg: ServerConfig) -> tuple[int, int]:
    conf = json.loads((Path(cfg.engine.model) / "config.json").read_text())
    return cfg.engine.context_length or conf.get("max_position_embeddings", 4096), conf["vocab_size"]


def fake_embedding(ids: list[int], size: int) -> list[float]:
    """A unit vector of `size` values that depends only on `ids` (no model runs)."""
    seed = sum((i + 1) * t for i, t in enumerate(ids)) % 9973
    v = [math.sin(seed + k) for k in range(size)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


class StubWorker:
    def __init__(self, cfg: ServerConfig) -> None:
        from tokenizers import Tokenizer

        self.cfg = cfg
        self.tok = Tokenizer.from_file(str(Path(cfg.engine.model) / "tokenizer.json"))
        self.delay = float(os.environ.get("PDSERVE_STUB_DELAY_S", "0.005"))
        self.io = WorkerChannels(cfg.endpoints)
        self.active: dict[str, StubReq] = {}
        self.finished = 0
        ctx_len, vocab = _context_length(cfg)
        self.info = {"role": cfg.role, "model_path": cfg.engine.model, "context_length": ctx_len,
                     "vocab_size": vocab, "page_size": cfg.engine.page_size,
                     "max_total_tokens": cfg.engine.max_total_tokens,
                     "bootstrap_port": cfg.pd.bootstrap_port, "stub": True,
                     "hidden_size": json.loads((Path(cfg.engine.model) / "config.json").read_text())["hidden_size"]}

    def send(self, msg: object) -> None:
        self.io.outbox.send(msg)

    def add(self, msg: m.GenerateReq, outs: list[m.TokenOut]) -> None:
        prompt = self.tok.decode(msg.input_ids, skip_special_tokens=False)
        if "[[stub:crash]]" in prompt:
            os._exit(3)
        if "[[stub:error]]" in prompt:
            outs.append(m.TokenOut(rid=msg.rid, new_token_ids=[], finished=True, finish_reason="error",
                                   error="stub worker refused the request", error_code=500))
            return
        plan = list(reversed(msg.input_ids))
        max_new = 1 if self.cfg.role == "prefill" else msg.sampling.max_new_tokens
        for i in range(1 if self.cfg.role == "prefill" else msg.n):  # a prefill reports choice 0 only
            key = msg.rid if i == 0 else f"{msg.rid}#{i}"
            self.active[key] = StubReq(msg=msg, plan=plan[i:] + plan[:i], max_new=max_new, index=i)

    def abort(self, msg: m.AbortReq, outs: list[m.TokenOut]) -> None:
        for rid, r in list(self.active.items()):
            if msg.abort_all or r.msg.rid == msg.rid or (msg.room is not None and r.msg.pd.room == msg.room):
                del self.active[rid]
                outs.append(m.TokenOut(rid=r.msg.rid, index=r.index, new_token_ids=[], finished=True,
                                       finish_reason="abort", error=msg.reason, error_code=499,
                                       prompt_tokens=len(r.msg.input_ids), completion_tokens=len(r.out)))

    def step_one(self, r: StubReq) -> m.TokenOut:
        t = r.plan[len(r.out) % len(r.plan)]
        r.out.append(t)
        sp = r.msg.sampling
        out = m.TokenOut(rid=r.msg.rid, index=r.index, new_token_ids=[t], prompt_tokens=len(r.msg.input_ids),
                         completion_tokens=len(r.out))
        lp = r.msg.logprobs
        if lp.on:
            out.new_logprobs = [-0.5]
            if not r.sent_input_lp and lp.start_len >= 0:
                out.input_start = lp.start_len
                out.input_logprobs = [-1.0] * (len(r.msg.input_ids) - max(1, lp.start_len))
                r.sent_input_lp = True
        text = self.tok.decode(r.out, skip_special_tokens=False)
        matched = next((s for s in sp.stop if s in text), None)
        if matched is not None:
            out.finished, out.finish_reason, out.matched_stop = True, "stop", matched
        elif t in sp.stop_token_ids:
            out.finished, out.finish_reason, out.matched_stop = True, "stop", t
        elif len(r.out) >= r.max_new:
            out.finished, out.finish_reason = True, "length"
        elif len(r.out) == len(r.plan) and not sp.ignore_eos:  # like an EOS after one pass
            out.finished, out.finish_reason = True, "stop"
        return out

    def stats(self, token: int) -> m.StatsOut:
        used = sum(len(r.msg.input_ids) + len(r.out) for r in self.active.values())
        return m.StatsOut(token=token, info=self.info, stats=WorkerStats(
            queues={"running": len(self.active), "waiting": 0},
            kv=KVStats(used_tokens=used, total_tokens=self.cfg.engine.max_total_tokens),
            counters=Counters(retractions=0), time=time.time(),
            transfer=TransferTotals(seconds=Histo(le=[0.01, 0.1], counts=[1, 2], sum=0.05, count=2)),
        ))

    def handle(self, msg: object, outs: list[m.TokenOut]) -> None:
        if isinstance(msg, m.GenerateReq):
            self.add(msg, outs)
        elif isinstance(msg, m.AbortReq):
            self.abort(msg, outs)
        elif isinstance(msg, m.StatsReq):
            self.send(self.stats(msg.token))
        elif isinstance(msg, m.FlushCacheReq):  # as the real worker: refused while requests are in flight
            busy = len(self.active)
            self.send(m.FlushCacheOut(token=msg.token, ok=not busy, message=f"cannot flush the prefix cache while "
                                      f"{busy} request(s) are in flight; retry when idle" if busy
                                      else "no prefix cache on this worker"))
        elif isinstance(msg, m.LoraReq):  # as the real worker with LoRA off (engine/extras/lora/runner.py)
            off = "LoRA is off on this server (start it with --max-loaded-loras N or --lora-paths)"
            code, message = (400, off) if msg.op == "load" else (404, f"LoRA adapter {msg.name!r} is not loaded")
            self.send(m.LoraOut(token=msg.token, ok=False, code=code, message=message))
        elif isinstance(msg, m.EmbedReq):  # service/embeddings.py's frontend parsed and tokenized it
            size = msg.dimensions or self.info["hidden_size"]
            self.send(m.EmbedOut(msg.token, [fake_embedding(ids, size) for ids in msg.inputs]))

    def run(self) -> None:
        parent = os.getppid()
        self.send(m.StatsOut(token=-1, info=self.info))
        poller = self.io.poller
        while os.getppid() == parent:
            outs: list[m.TokenOut] = []
            deadline = time.monotonic() + (self.delay if self.active else 0.2)
            while (left := deadline - time.monotonic()) > 0 and poller.poll(left * 1000):
                for msg in self.io.inbox.recv_all():
                    self.handle(msg, outs)
            for rid, r in list(self.active.items()):
                out = self.step_one(r)
                outs.append(out)
                if out.finished:
                    del self.active[rid]
                    self.finished += 1
            if outs:
                self.send(m.TokenBatch(outs=outs))


def run_stub_worker(cfg: ServerConfig) -> None:
    StubWorker(cfg).run()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "special_tokens_map.json", "generation_config.json")


def make_tokenizer_dir(dst: Path) -> Path:
    """A model directory without weights: the embedded model's tokenizer + config.json."""
    from engine.config import EMBEDDED_MODEL
    from engine.models.embedded import resolve_model_path

    src = resolve_model_path(EMBEDDED_MODEL)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def main(argv: list[str]) -> int:
    from service.launch import run_main

    role = "colocated"
    if "--role" in argv:
        i = argv.index("--role")
        role = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    return run_main(role, "tests.stub_worker:run_stub_worker", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
