"""Tail transfer time with and without the transfer progress thread (issue 15, part 3).

For each mode a prefill and a decode service (real processes, UCX over TCP on loopback, the embedded
model) serve --requests prompts of about --prompt-tokens tokens one at a time, prefilled in
--chunk-tokens chunks. The prefill's `transfer_tail_seconds` histogram times each room from the
moment its last chunk is queued for sending to the decode's SUCCESS: the KV still to move after the
last forward. Without the thread, bytes move only between engine steps, so most of the prompt's KV
is still queued then; with it, earlier chunks' pages moved while later chunks computed.
Also reported: the time to the first token of each request (prefill + transfer + commit). Both
modes run with 60 s heartbeats and 900 s room timeouts: without the thread, a 4k-token prefill on a busy 2-core box can
outlast the default 3 x 5 s and fail the room (the failure the thread removes).

    python benchmarks/transfer_tail.py --out /tmp/transfer_tail.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.procs import free_port  # noqa: E402
from loadtest.services import LocalServices  # noqa: E402

MODES = {"progress thread off": ["--no-transfer-progress-thread"], "progress thread on": []}


def prompt(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["river", "stone", "light", "garden", "signal", "winter", "copper", "harbor", "orbit", "meadow"]
    return " ".join(rng.choice(words) for _ in range(tokens))  # ~1 token per word for this tokenizer


def run_mode(name: str, flags: list[str], args: argparse.Namespace, log_dir: Path) -> dict:
    common = ["--host", "127.0.0.1", "--device", "cpu", "--threads", str(args.threads), "--log-level", "warning",
              "--max-total-tokens", str(2 * args.prompt_tokens + 1024), "--heartbeat-interval", "60",
              "--waiting-timeout", "900", "--bootstrap-timeout", "900",
              "--chunked-prefill-size", str(args.chunk_tokens), "--max-prefill-tokens", str(args.chunk_tokens), *flags]
    pre, dec, boot = free_port(), free_port(), free_port()
    py = [sys.executable, "-m", "pdserve"]
    with LocalServices(log_dir / name.replace(" ", "_")) as svc:
        svc.spawn("prefill", py + ["prefill", *common, "--port", str(pre), "--bootstrap-port", str(boot)])
        svc.spawn("decode", py + ["decode", *common, "--port", str(dec)])
        p_url, d_url = f"http://127.0.0.1:{pre}", f"http://127.0.0.1:{dec}"
        svc.wait_healthy([p_url + "/health", d_url + "/health"], 600)
        ttft = []
        with httpx.Client(timeout=600) as c:
            for i in range(args.requests + 1):  # the first is a warm-up, not counted
                n = args.prompt_tokens if i else 64  # the warm-up only opens the connections
                body = {"text": prompt(n, i), "stream": False,
                        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                        "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 1000 + i}
                t0 = time.monotonic()
                with cf.ThreadPoolExecutor(2) as ex:  # what a router does: the same body to both
                    a = ex.submit(c.post, p_url + "/generate", json=body)
                    b = ex.submit(c.post, d_url + "/generate", json=body)
                    ra, rb = a.result(), b.result()
                if ra.status_code != 200 or rb.status_code != 200:
                    raise RuntimeError(f"request {i} failed: {ra.status_code} {ra.text[:200]} / {rb.text[:200]}")
                if i == 0:
                    base = c.get(p_url + "/server_info").json()["internal_states"][0]["histograms"]
                    continue
                ttft.append(time.monotonic() - t0)
                print(f"  {name}: request {i}: {rb.json()['meta_info']['prompt_tokens']} prompt tokens, "
                      f"{ttft[-1]:.2f} s", flush=True)
            hist = c.get(p_url + "/server_info").json()["internal_states"][0]["histograms"]
    tail = hist["transfer_tail_seconds"]
    n = tail["count"] - base["transfer_tail_seconds"]["count"]
    mean_tail = (tail["sum"] - base["transfer_tail_seconds"]["sum"]) / n
    return {"requests": n, "tail_mean_s": round(mean_tail, 4), "first_token_mean_s": round(sum(ttft) / len(ttft), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="approximate prompt length")
    ap.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk (--chunked-prefill-size)")
    ap.add_argument("--requests", type=int, default=2, help="measured requests per mode (after a short warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="--threads of each service")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    result: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in MODES.items():
            print(f"{name} ...", flush=True)
            result[name] = run_mode(name, flags, args, Path(tmp))
            print(f"  {json.dumps(result[name])}", flush=True)
    off, on = result["progress thread off"], result["progress thread on"]
    result["tail_ratio_on_over_off"] = round(on["tail_mean_s"] / off["tail_mean_s"], 3)
    result["first_token_ratio_on_over_off"] = round(on["first_token_mean_s"] / off["first_token_mean_s"], 3)
    print(f"tail transfer time, thread on / off: {result['tail_ratio_on_over_off']}; "
          f"first token: {result['first_token_ratio_on_over_off']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
