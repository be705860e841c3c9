"""Per-request parse cost of a service: what its handler does with a body before the worker sees it
(`service.protocol.parse_json_body` + `parse_chat` / `parse_completion` / `parse_generate`).

    python benchmarks/parse_cost.py [--against /tmp/base] [--n 20000] [--rounds 3] [--out FILE]

Typical bodies (a two-message chat, a completion with stop and logprobs, a /generate with
sampling_params; ~300-character prompts) are parsed `--n` times each with a toy tokenizer (one id per
character, so the parser's own cost is measured, not a tokenizer's). Each round runs this checkout and,
with `--against DIR`, another checkout of the code (e.g. the tree before a change) in child processes
one after the other; the table shows each tree's best round in microseconds per request. Prints the
table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 7
BODIES = {
    "chat": {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": PROMPT}],
             "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "stream": True,
             "stream_options": {"include_usage": True}},
    "completion": {"model": "m", "prompt": PROMPT, "max_tokens": 64, "temperature": 0.7, "stop": ["\n"],
                   "logprobs": 1, "seed": 7},
    "generate": {"text": PROMPT, "sampling_params": {"max_new_tokens": 64, "temperature": 0.7, "top_k": 20},
                 "stream": True, "return_logprob": False},
}


class ToyTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


def measure(n: int) -> dict[str, float]:
    """Microseconds per request for each body, in this process (its sys.path picks the tree)."""
    from service import protocol

    limits = protocol.Limits(role="colocated", context_length=4096, vocab_size=1000, model_name="m")
    parsers = {"chat": protocol.parse_chat, "completion": protocol.parse_completion,
               "generate": protocol.parse_generate}
    tok, out = ToyTokenizer(), {}
    for kind, body in BODIES.items():
        raw, parse = json.dumps(body).encode(), parsers[kind]
        for _ in range(n // 10):  # warm-up
            parse(protocol.parse_json_body(raw), tok, limits)
        t0 = time.perf_counter()
        for _ in range(n):
            parse(protocol.parse_json_body(raw), tok, limits)
        out[kind] = (time.perf_counter() - t0) / n * 1e6
    return out


def child(root: Path, n: int) -> dict[str, float]:
    code = f"import sys; sys.path.insert(0, {str(root)!r}); import json, parse_cost; " \
           f"print(json.dumps(parse_cost.measure({n})))"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                       env={"PYTHONPATH": f"{root}:{ROOT / 'benchmarks'}", "PATH": "/usr/bin:/bin"})
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", type=Path, help="another checkout to time the same way (e.g. /tmp/base)")
    p.add_argument("--n", type=int, default=20000, help="parses per body per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    trees = {"this": ROOT, **({"against": a.against.resolve()} if a.against else {})}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(a.rounds):
        for name, root in trees.items():
            runs[name].append(child(root, a.n))
    best = {name: {k: min(r[k] for r in rs) for k in BODIES} for name, rs in runs.items()}
    print(f"{'body':12}" + "".join(f"{name + ' (us)':>16}" for name in trees))
    for kind in BODIES:
        print(f"{kind:12}" + "".join(f"{best[name][kind]:16.1f}" for name in trees))
    report = {"n": a.n, "rounds": a.rounds, "trees": {k: str(v) for k, v in trees.items()}, "best_us": best,
              "runs_us": runs}
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
