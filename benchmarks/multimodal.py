"""Images served (issue 50): single-image chat TTFT colocated vs P/D vs E/P/D on the same cores, a repeated
image vs a new one, and the vision tower's images/s.

One run writes a random-weight Qwen2.5-VL (--size: tiny, the tests' model; medium, default: a 512-hidden 8-layer
text model and a 256-hidden 8-block tower, images up to --image-tokens tokens) or takes --model, then:

1. Steady load, per layout (--layouts colocated,pd,epd): one stack of local processes (colocated: one service;
   pd: router + prefill + decode; epd: router + encoder + prefill + decode), each worker with --threads
   max(1, CPUs // workers), so every layout computes on the same cores. --requests streamed chat requests, each
   with one NEW image (random pixels, --image-size) and a short text, sent at --rate requests/s (Poisson
   arrivals), --output-len tokens each; TTFT (send to first content token, client side) p50/p90/p99 and the
   end-to-end p50. The ratio each layout / colocated is printed.
2. Repeated vs new image (on the colocated service): --repeats requests of one image already seen (its prefix
   cached: the tower is skipped and its tokens are not recomputed) vs as many of new images, one at a time;
   TTFT p50 of each and their ratio.
3. The tower alone, in this process (engine/models/loader.load_tower): images/s over --tower-images images of
   --image-size, one per call and in batches of 8.

    python benchmarks/multimodal.py --out docs/bench/multimodal.json

Smoke test: --size tiny --requests 6 --repeats 3 --tower-images 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration")]

from router_harness import Proc, free_port, start_router  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.cpus import cpu_budget  # noqa: E402
from engine.models.loader import load_tower  # noqa: E402
from service.images import ImageProcessor  # noqa: E402
from tests.vl_models import data_url, random_image, write_qwen2_5_vl  # noqa: E402

MEDIUM_TEXT = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                          "mrope_section": [8, 12, 12]})
MEDIUM_VISION = dict(depth=8, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=512,
                     window_size=112, fullatt_block_indexes=[3, 7])


def chat_body(url: str, output_len: int) -> dict:
    return {"model": "m", "stream": True, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "Describe this image."}]}]}


async def one(client: httpx.AsyncClient, base: str, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "status": r.status_code, "error": r.text[:200]}
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and ttft is None:
                ev = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in ev.get("choices", [])):
                    ttft = time.perf_counter() - t0
    return {"ok": True, "ttft": ttft, "e2e": time.perf_counter() - t0}


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def steady(base: str, a: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    w, h = a.image_size
    bodies = [chat_body(data_url(random_image(w, h, seed * 100_000 + i)), a.output_len) for i in range(a.requests)]
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, base, chat_body(data_url(random_image(w, h, 7)), 2))  # warm-up
        tasks = []
        for body in bodies:
            tasks.append(asyncio.ensure_future(one(client, base, body)))
            await asyncio.sleep(rng.expovariate(a.rate))
        res = await asyncio.gather(*tasks)
    ok = [r for r in res if r["ok"]]
    ttfts = [r["ttft"] for r in ok]
    return {"requests": len(res), "ok": len(ok), "errors": [r for r in res if not r["ok"]][:3],
            "ttft_p50": pct(ttfts, 0.5), "ttft_p90": pct(ttfts, 0.9), "ttft_p99": pct(ttfts, 0.99),
            "e2e_p50": pct([r["e2e"] for r in ok], 0.5)}


async def repeated_vs_new(base: str, a: argparse.Namespace) -> dict:
    w, h = a.image_size
    seen = data_url(random_image(w, h, 424242))
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, base, chat_body(seen, a.output_len))  # now cached
        rep, new = [], []
        for i in range(a.repeats):
            rep.append((await one(client, base, chat_body(seen, a.output_len)))["ttft"])
            fresh = chat_body(data_url(random_image(w, h, 500_000 + i)), a.output_len)
            new.append((await one(client, base, fresh))["ttft"])
    r, n = statistics.median(rep), statistics.median(new)
    return {"repeated_ttft_p50": r, "new_ttft_p50": n, "repeated_over_new": r / n}


def tower_rate(model: Path, a: argparse.Namespace) -> dict:
    torch.set_num_threads(cpu_budget())
    mc = ModelConfig.from_dir(model)
    tower = load_tower(model, mc, "float32", "cpu")
    proc = ImageProcessor.from_model_dir(model)
    w, h = a.image_size
    ims = [proc.process(random_image(w, h, 900 + i)) for i in range(a.tower_images)]
    out = {"image_tokens": ims[0].tokens}
    tower.encode_images(torch.from_numpy(ims[0].pixel_values), torch.tensor([list(ims[0].grid_thw)]))  # warm-up
    for batch in (1, 8):
        t0 = time.perf_counter()
        for i in range(0, len(ims), batch):
            part = ims[i : i + batch]
            tower.encode_images(torch.cat([torch.from_numpy(p.pixel_values) for p in part]),
                                torch.tensor([list(p.grid_thw) for p in part]))
        out[f"images_per_s_batch{batch}"] = len(ims) / (time.perf_counter() - t0)
    return out


class Stack:
    """The processes of one layout; `url` is where clients send."""

    def __init__(self, layout: str, model: Path, threads: int) -> None:
        self.procs: list[Proc] = []
        common = ["--model", str(model), "--device", "cpu", "--threads", str(threads), "--log-level", "warning"]
        kv = ["--page-size", "16", "--max-total-tokens", "32768", "--host-kv-tokens", "4096"]
        if layout == "colocated":
            self.url = self._start("colocated", *common, *kv)
            return
        pre_boot = free_port()
        pre = self._start("prefill", *common, *kv, "--bootstrap-port", str(pre_boot))
        dec = self._start("decode", *common, *kv, "--local-prefill-threshold", "0")
        workers = ["--prefill", f"{pre},bootstrap_port={pre_boot}", "--decode", dec]
        if layout == "epd":
            boot = free_port()
            enc = self._start("encoder", *common, "--bootstrap-port", str(boot))
            workers += ["--encoder", f"{enc},bootstrap_port={boot}"]
        for p in self.procs:
            p.wait_healthy(600)
        router = start_router(workers)
        self.procs.append(router)
        router.wait_healthy(60)
        self.url = router.url

    def _start(self, role: str, *args: str) -> str:
        port = free_port()
        p = Proc(f"{role}-{port}", [sys.executable, "-m", "pdserve", role, "--port", str(port), *args],
                 f"http://127.0.0.1:{port}")
        self.procs.append(p)
        if role == "colocated":
            p.wait_healthy(600)
        return p.url

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a vision-language model directory (default: write a random-weight one)")
    p.add_argument("--size", choices=("tiny", "medium"), default="medium", help="the written model's size")
    p.add_argument("--image-tokens", type=int, default=256, help="the written model's max image tokens (max_pixels)")
    p.add_argument("--image-size", type=int, nargs=2, default=(448, 448), metavar=("W", "H"))
    p.add_argument("--layouts", default="colocated,pd,epd")
    p.add_argument("--requests", type=int, default=40, help="steady-load requests per layout")
    p.add_argument("--rate", type=float, default=0.5, help="steady-load arrivals per second (Poisson)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10, help="repeated-image and new-image requests each")
    p.add_argument("--tower-images", type=int, default=32)
    p.add_argument("--out", help="write the figures here as JSON")
    a = p.parse_args()
    model = Path(a.model) if a.model else Path(tempfile.mkdtemp(prefix="pdserve-mm-")) / "qwen2_5_vl"
    if not a.model:
        big = a.size == "medium"
        write_qwen2_5_vl(model, MEDIUM_TEXT if big else None, MEDIUM_VISION if big else None, a.image_tokens)
    cpus = cpu_budget()
    res: dict = {"model": str(model), "size": a.size if not a.model else "given", "cpus": cpus,
                 "load_avg_at_start": os.getloadavg()[0], "args": vars(a) | {"image_size": list(a.image_size)}}
    print(f"model {model} ({res['size']}), {cpus} CPUs, load {res['load_avg_at_start']:.2f}", flush=True)
    res["tower"] = tower_rate(model, a)
    print(f"tower: {res['tower']}", flush=True)
    res["layouts"] = {}
    for i, layout in enumerate(a.layouts.split(",")):
        workers = {"colocated": 1, "pd": 2, "epd": 3}[layout]
        stack = Stack(layout, model, max(1, cpus // workers))
        try:
            res["layouts"][layout] = asyncio.run(steady(stack.url, a, i + 1))
            if layout == "colocated":
                res["repeated_vs_new"] = asyncio.run(repeated_vs_new(stack.url, a))
                print(f"repeated vs new image: {res['repeated_vs_new']}", flush=True)
        finally:
            stack.stop()
        print(f"{layout}: {res['layouts'][layout]}", flush=True)
    base = res["layouts"].get("colocated", {}).get("ttft_p50")
    print(f"\n{'layout':<10}{'ok':>6}{'ttft p50':>10}{'p90':>8}{'p99':>8}{'e2e p50':>9}{'/ colo p50':>12}")
    for layout, r in res["layouts"].items():
        f = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
        ratio = f"{r['ttft_p50'] / base:.2f}x" if base and r["ttft_p50"] else "-"
        print(f"{layout:<10}{r['ok']:>6}{f(r['ttft_p50']):>10}{f(r['ttft_p90']):>8}{f(r['ttft_p99']):>8}"
              f"{f(r['e2e_p50']):>9}{ratio:>12}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
