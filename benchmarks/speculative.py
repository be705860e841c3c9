"""Speculative decoding: decode tok/s with and without each method, on two workloads, one run.

    python benchmarks/speculative.py [--threads N] [--tokens 128] [--batches 1,16] [--out FILE]

Workloads (SmolLM2-135M-Instruct, the embedded model, chat template, greedy, ignore_eos):
- repetitive: the prompt holds a ~250-token passage and asks for it back with one word changed
  (RAG quoting, code edits): n-gram lookup finds the continuation in the prompt.
- chat: open-ended questions (stories, explanations): little of the answer is in the prompt.
Batch B runs B requests at once (distinct passages / questions). Decode time runs from the step
after which every request has its first token to the last finish, so prompts are not counted;
tok/s = tokens generated in that time / that time.

Methods: off; ngram (K tokens, ngram 2..4, the default switch-off rule); draft (a truncated copy of
the target, its first --draft-layers layers: the same vocabulary, a cheap and poor draft; its figure
is the machinery's overhead per accepted token, not a tuned draft's speed-up); self (the target as
its own draft: it accepts about every token, so it shows the draft-method machinery's cost per
accepted token when the draft costs as much as the target). One model runner is
shared by every configuration (the scheduler's config carries the method), so all runs use the same
weights and threads. The acceptance rate and mean tokens per verify step come from the scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402  (engine before torch: engine/__init__.py)
from engine.engine import LLM  # noqa: E402
from engine.extras.speculative.config import SpecConfig  # noqa: E402
from engine.forward.model_runner import ModelRunner  # noqa: E402
from engine.models.embedded import resolve_model_path  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

# isort: split
import torch  # noqa: E402

PASSAGES = [
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps and listening to "
    "the waves below. At the top he wiped the great lens, lit the lamp and wrote the weather in his logbook. "
    "Ships passed in the dark, and each one flashed a signal back, which he noted with the time and the "
    "direction of the wind. In winter the storms came from the north and the spray reached the windows of "
    "the lamp room; in summer the sea was calm and the nights were short, and he read by the light of the "
    "lamp until the sun came up over the hills behind the harbour.",
    "To install the package, first create a virtual environment with python -m venv .venv and activate it. "
    "Then run pip install with the requirements file, and check that the command line tool prints its "
    "version. The configuration lives in a YAML file next to the data directory; copy the example file, "
    "set the path of the model and the port of the server, and start it with the serve command. Logs go to "
    "standard error unless a log file is given; the health endpoint answers once the model is loaded, and "
    "the metrics endpoint exposes the request counters and latency histograms for Prometheus.",
]
EDITS = [("lighthouse", "tower"), ("package", "library")]
QUESTIONS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe a day in the life of a honeybee.",
    "Give me some ideas for a birthday party for a friend who loves astronomy.",
    "Why do cats purr? Tell me what scientists think.",
    "Write a poem about autumn leaves and the first cold morning.",
    "How does a bicycle stay upright when it is moving?",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2-135m", help="HF model directory or the embedded model")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--batches", default="1,16", help="decode batch sizes, comma-separated")
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated draft model")
    p.add_argument("--methods", default="off,ngram,draft,self",
                   help="comma-separated: off, ngram, draft (truncated target), self (the target as its own draft)")
    p.add_argument("--out", default="speculative.json", help="where the JSON goes")
    return p.parse_args(argv)


def truncated_draft(model_dir: Path, layers: int, dst: Path) -> Path:
    """The target's first `layers` layers (embedding, final norm and LM head kept) as an HF directory."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg))
    keep = {}
    for f in model_dir.glob("*.safetensors"):
        for k, v in load_file(str(f)).items():
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers:
                keep[k] = v
    save_file(keep, str(dst / "model.safetensors"))
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, dst / f.name)
    return dst


def prompts(tok, workload: str, batch: int) -> list[list[int]]:  # noqa: ANN001
    out = []
    for i in range(batch):
        if workload == "repetitive":
            text, (a, b) = PASSAGES[i % len(PASSAGES)], EDITS[i % len(EDITS)]
            msg = f"Here is a text:\n\n{text}\n\nRepeat the text exactly, word for word, but write '{b}' " \
                  f"instead of '{a}'."
        else:
            msg = QUESTIONS[i % len(QUESTIONS)]
        msg = f"(Request {i + 1}.) {msg}"  # distinct prompts
        text = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                       tokenize=False)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def measure(llm: LLM, ids: list[list[int]], tokens: int) -> tuple[float, dict]:
    """(decode tok/s, the run's speculative totals) for one batch. The clock runs from the step after
    which every request has its first token to the last finish: prompts are not counted."""
    from engine.request import Req

    llm.generate(ids[:1], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))  # warm-up
    sp = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    sched = llm.scheduler
    reqs = [Req(rid=f"bench-{i}", token_ids=x, sampling=sp) for i, x in enumerate(ids)]
    for r in reqs:
        sched.add(r)
    while any(r.num_output_tokens == 0 for r in reqs):
        sched.step()
        sched.drain()
    before = dataclasses.replace(sched.stats().spec)
    first = sum(r.num_output_tokens for r in reqs)
    t0 = time.perf_counter()
    while not all(r.finished for r in reqs):
        sched.step()
        sched.drain()
    elapsed = time.perf_counter() - t0
    after = sched.stats().spec
    assert all(r.error is None and r.num_output_tokens == tokens for r in reqs)
    proposed = after.proposed_tokens - before.proposed_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    steps = after.verify_steps - before.verify_steps
    emitted = after.emitted_tokens - before.emitted_tokens
    spec = {"proposed": proposed, "accepted": accepted, "verify_steps": steps,
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "mean_accepted_length": round(emitted / steps, 2) if steps else None,
            "outputs": [r.output_ids for r in reqs]}
    return (len(reqs) * tokens - first) / elapsed, spec


def prefill_ms(runner: ModelRunner, n: int = 512) -> float:
    """Best of 3: one n-token prompt computed in one extend over fresh pages (ms)."""
    from engine.forward.forward_batch import LOGITS_LAST, Segment, forward_segments
    from engine.kvcache.memory import pages_for

    ids = [(7 * i + 3) % 1000 + 100 for i in range(n)]
    best = float("inf")
    for _ in range(4):
        pages = runner.pool.allocator.allocate(pages_for(n, runner.page_size))
        t0 = time.perf_counter()
        forward_segments(runner, [Segment(pages, 0, ids, LOGITS_LAST)])
        best = min(best, time.perf_counter() - t0)
        runner.pool.allocator.free(pages)
    return best * 1000


def draft_kv_choice(runner: ModelRunner, draft_dir: Path, base: EngineConfig, n: int = 512) -> dict:
    """The PD draft-KV figures: the draft's and the target's prefill of an n-token prompt, and the
    draft KV bytes a prefill would send instead (docs/architecture.md, "Speculative decoding")."""
    from engine.forward.draft import draft_engine_config

    spec = SpecConfig(speculative="draft", draft_model=str(draft_dir))
    draft = ModelRunner(draft_engine_config(dataclasses.replace(base, spec=spec, max_total_tokens=4096)))
    out = {"prompt_tokens": n, "draft_prefill_ms": round(prefill_ms(draft, n), 1),
           "target_prefill_ms": round(prefill_ms(runner, n), 1),
           "draft_kv_mb": round(draft.pool.page_bytes / draft.page_size * n / 1e6, 2),
           "target_kv_mb": round(runner.pool.page_bytes / runner.page_size * n / 1e6, 2)}
    print(f"PD draft KV: {n}-token prompt, draft prefill {out['draft_prefill_ms']} ms (target "
          f"{out['target_prefill_ms']} ms), draft KV {out['draft_kv_mb']} MB (target {out['target_kv_mb']} MB)",
          flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = resolve_model_path(a.model)
    base = EngineConfig(model=a.model, max_total_tokens=8192, host_kv_tokens=0, threads=a.threads)
    runner = ModelRunner(base)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tmp = Path(tempfile.mkdtemp(prefix="spec-draft-"))
    specs = {"off": SpecConfig(), "ngram": SpecConfig(speculative="ngram", num_speculative_tokens=a.k)}
    if "draft" in a.methods:
        draft = truncated_draft(model_dir, a.draft_layers, tmp / "draft")
        specs["draft"] = SpecConfig(speculative="draft", draft_model=str(draft), num_speculative_tokens=a.k)
    if "self" in a.methods:  # the target as its own draft: accepts ~all, so its cost is the machinery's
        specs["self"] = SpecConfig(speculative="draft", draft_model=str(model_dir), num_speculative_tokens=a.k)
    methods = [m for m in a.methods.split(",") if m in specs]
    pd_draft = draft_kv_choice(runner, tmp / "draft", base) if "draft" in specs else None
    rows = []
    for workload in ("repetitive", "chat"):
        for batch in [int(b) for b in a.batches.split(",")]:
            ids = prompts(tok, workload, batch)
            base_tps, ref = None, None
            for method in methods:
                llm = LLM(dataclasses.replace(base, spec=specs[method]), runner=runner)
                tps, spec = measure(llm, ids, a.tokens)
                outs = spec.pop("outputs")
                if method == "off":
                    base_tps, ref = tps, outs
                row = {"workload": workload, "batch": batch, "method": method, "decode_tok_s": round(tps, 1),
                       "speedup": round(tps / base_tps, 2) if base_tps else None,
                       "same_tokens": outs == ref if ref is not None else None, **spec}
                rows.append(row)
                print(f"{workload:10} B={batch:<3} {method:6} {tps:8.1f} tok/s  x{row['speedup']}  "
                      f"accept {spec['acceptance_rate']}  tokens/step {spec['mean_accepted_length']}  "
                      f"same {row['same_tokens']}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    result = {"model": a.model, "threads": torch.get_num_threads(), "tokens": a.tokens, "k": a.k,
              "draft_layers": a.draft_layers, "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_avg": os.getloadavg(), "pd_draft_kv": pd_draft, "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
