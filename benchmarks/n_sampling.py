"""n > 1 (issue 16 part 1): one request with n=4 vs 4 separate requests for the same prompt, colocated
and PD, in one process: prompt tokens computed (prefill work), peak KV pages held, wall time.

    python benchmarks/n_sampling.py [--model embedded:smollm2-135m] [--prompt-tokens 512] [--out FILE]

Runs (same prompt, --gen-tokens seeded tokens per sequence, temperature 1, ignore_eos):
  colocated  n4              one request, n=4 (prefix cache on: the choices share the prompt's pages)
             sep4_cache_off  4 requests at once, prefix cache off (every one computes the prompt)
             sep4_cache_on   4 requests at once, prefix cache on (arriving together, none finds the
                             others' prompt in the cache yet: a finished request inserts its pages)
  pd         n4 / sep4       a prefill and a decode role stepped in one process (tests/pd_harness.py:
                             real runners and zmq, --backend data plane); the prefill's cache on, the
                             decode's off (the harness default: the forks share through the
                             private fork tree, the same pages as through a decode cache)
The 4 separate requests use seeds choice_seed(seed, i), the seeds n=4 gives its choices, so the
tokens must be equal (`same_tokens`). Prefill tokens = forward tokens - decode tokens (colocated);
the prefill's forward tokens (PD). Peak pages = the page allocator's high-water mark (inside steps
too). Each run builds its roles afresh and first serves a one-page warm-up request (then the
counters, high-water marks and caches are reset), so no run pays a cold first forward.
`os.getloadavg()` is written before and after: timings swing on a shared box, pages do not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colocated_service.worker import ColocatedRole  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.forward.model_runner import ModelRunner  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402
from engine.scheduling.parallel import choice_seed  # noqa: E402
from service import messages as m  # noqa: E402
from tests.pd_harness import PDPair, collect, kv_manager  # noqa: E402

N = 4


def _sampling(a: argparse.Namespace, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_new_tokens=a.gen_tokens, ignore_eos=True)


def _cfg(a: argparse.Namespace, cache: bool) -> EngineConfig:
    return EngineConfig(model=a.model, device=a.device, max_total_tokens=a.prompt_tokens * 8 + 1024,
                        page_size=a.page_size, chunked_prefill_size=a.prompt_tokens,
                        max_prefill_tokens=a.prompt_tokens * N, prefix_cache=cache, threads=a.threads)


def colocated(a: argparse.Namespace, prompt: list[int], n4: bool, cache: bool) -> dict:
    cfg = _cfg(a, cache)
    runner = ModelRunner(cfg)
    role = ColocatedRole(cfg, runner, kv_manager(runner, cache))
    reqs = [m.GenerateReq(rid="r0", input_ids=prompt, sampling=_sampling(a, a.seed), n=N)] if n4 else [
        m.GenerateReq(rid=f"r{i}", input_ids=prompt, sampling=_sampling(a, choice_seed(a.seed, i)))
        for i in range(N)]
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    role.add(m.GenerateReq(rid="warm", input_ids=prompt[:a.page_size], sampling=_sampling(a, 0)))
    while "warm" not in done:
        collect(role.step(), {}, done)
    del done["warm"]
    role.kv.flush()
    role.sched.exec.forward_tokens = 0
    runner.pool.allocator.high_water = 0
    t0 = time.perf_counter()
    for r in reqs:
        role.add(r)
    while len(done) < N:
        collect(role.step(), tokens, done)
    wall = time.perf_counter() - t0
    assert all(o.error is None for o in done.values())
    forward = role.sched.exec.forward_tokens
    return {"prefill_tokens": forward - N * (a.gen_tokens - 1), "forward_tokens": forward,
            "peak_kv_pages": runner.pool.allocator.high_water, "wall_s": round(wall, 3),
            "tokens": [tokens[k] for k in sorted(tokens)]}


def pd(a: argparse.Namespace, prompt: list[int], n4: bool) -> dict:
    pair = PDPair(_cfg(a, True), backend=a.backend, heartbeat_s=30.0)  # one thread steps both roles
    try:
        pair.run([prompt[:a.page_size]], _sampling(a, 0))  # warm-up, then every counter back to 0
        pair.p_kv.flush()
        pair.prefill.exec.forward_tokens = 0
        pair.decode.tstats.bytes = 0
        pair.p_kv.pool.allocator.high_water = pair.d_kv.pool.allocator.high_water = 0
        t0 = time.perf_counter()
        if n4:
            tokens, done, _ = pair.run([prompt], _sampling(a, a.seed), timeout_s=1800, fields={"n": N})
        else:  # four rooms at once, each with the seed of the matching choice
            tokens, done, _ = pair.run([prompt] * N, [_sampling(a, choice_seed(a.seed, i)) for i in range(N)],
                                       timeout_s=1800)
        wall = time.perf_counter() - t0
        assert all(o.error is None for o in done.values()), [o.error for o in done.values()]
        return {"prefill_tokens": pair.prefill.stats().counters.forward_tokens,
                "prefill_peak_kv_pages": pair.p_kv.pool.allocator.high_water,
                "decode_peak_kv_pages": pair.d_kv.pool.allocator.high_water,
                "kv_bytes_transferred": pair.decode.stats().transfer.bytes, "wall_s": round(wall, 3),
                "tokens": [tokens[k] for k in sorted(tokens)]}
    finally:
        pair.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: the CPU budget)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--backend", choices=("ucx", "fake"), default="ucx", help="PD KV data plane")
    p.add_argument("--out", type=Path, default=Path("n_sampling.json"))
    a = p.parse_args(argv)
    prompt = [(31 * i + 7) % 4000 + 100 for i in range(a.prompt_tokens)]
    result: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                    "loadavg_before": os.getloadavg()}
    runs = {"colocated": {"n4": lambda: colocated(a, prompt, True, True),
                          "sep4_cache_off": lambda: colocated(a, prompt, False, False),
                          "sep4_cache_on": lambda: colocated(a, prompt, False, True)},
            "pd": {"n4": lambda: pd(a, prompt, True), "sep4": lambda: pd(a, prompt, False)}}
    for mode, cases in runs.items():
        result[mode] = {}
        for name, fn in cases.items():
            r = fn()
            result[mode][name] = r
            shown = {k: v for k, v in r.items() if k != "tokens"}
            print(f"{mode:9s} {name:15s} {json.dumps(shown)}", flush=True)
        n4 = result[mode]["n4"]
        result[mode]["same_tokens"] = all(c["tokens"] == n4["tokens"] for c in result[mode].values()
                                          if isinstance(c, dict) and "tokens" in c)
        print(f"{mode}: n=4 tokens equal the 4 separate requests': {result[mode]['same_tokens']}")
    result["loadavg_after"] = os.getloadavg()
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0 if all(result[k]["same_tokens"] for k in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
