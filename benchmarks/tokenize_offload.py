"""Where should the frontend tokenize: on the event loop, a thread, or a tokenizer process?

An asyncio loop ticks every 1 ms (a stand-in for relaying stream events) while `--requests` chat
prompts of `--chars` characters are rendered and tokenized (service.tokenizer, the embedded model)
by each strategy in turn. Reports the loop's largest tick gap and the wall time for all of them:

  inline   on the loop itself (the old frontend)
  thread   one worker thread (the frontend's parse pool)
  process  one worker process holding its own tokenizer (ids pickled back)

    python benchmarks/tokenize_offload.py --requests 8 --chars 400000 --out docs/bench/tokenize_offload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_TOK = None


def _init(model_dir: str) -> None:
    global _TOK
    from service.tokenizer import load_tokenizer

    _TOK = load_tokenizer(model_dir)


def _tokenize(text: str) -> list[int]:
    return _TOK.apply_chat_template([{"role": "user", "content": text}])


async def _run(strategy: str, texts: list[str], pool: Executor | None) -> dict:
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    if pool is None:
        async def inline(text: str) -> list[int]:
            return _tokenize(text)
        out = await asyncio.gather(*(inline(t) for t in texts))
    else:
        out = await asyncio.gather(*(loop.run_in_executor(pool, _tokenize, t) for t in texts))
    wall = time.perf_counter() - t0
    done.set()
    await ticker
    return {"strategy": strategy, "max_gap_ms": round(max(gaps) * 1e3, 1), "wall_s": round(wall, 3),
            "tokens": sum(map(len, out))}


def main() -> None:
    from engine.config import EMBEDDED_MODEL
    from engine.models.embedded import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--chars", type=int, default=400_000)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "tokenize_offload.json")
    a = p.parse_args()
    model_dir = str(resolve_model_path(EMBEDDED_MODEL))
    _init(model_dir)
    texts = [(f"{i} " + "lorem ipsum dolor sit amet " * (a.chars // 27 + 1))[:a.chars] for i in range(a.requests)]
    results = [asyncio.run(_run("inline", texts, None))]
    with ThreadPoolExecutor(1) as pool:
        results.append(asyncio.run(_run("thread", texts, pool)))
    with ProcessPoolExecutor(1, initializer=_init, initargs=(model_dir,)) as pool:
        pool.submit(len, "warm").result()  # the child has loaded its tokenizer
        results.append(asyncio.run(_run("process", texts, pool)))
    for r in results:
        print(f"{r['strategy']:>8}: largest loop gap {r['max_gap_ms']:8.1f} ms, wall {r['wall_s']:.2f} s")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"requests": a.requests, "chars": a.chars, "cpus": os.cpu_count(),
                                 "loadavg": os.getloadavg(), "results": results}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
