"""Arrivals: Poisson at a rate (inf = all at once), optionally capped at a fixed concurrency.

`run` issues each spec once, or, with a duration, cycles through the specs until the duration has
passed (then waits for what is in flight, each request bounded by the client timeout).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from loadtest.client import ClientConfig, send
from loadtest.metrics import RequestResult
from loadtest.workload import RequestSpec


@dataclass(frozen=True)
class ArrivalConfig:
    request_rate: float = math.inf  # requests/s, Poisson; inf = no pacing
    concurrency: int | None = None  # max requests in flight; None = unbounded
    duration_s: float | None = None  # stop issuing after this long (cycling the specs)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (inf: all at once)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("--duration must be > 0 seconds")
        if math.isinf(self.request_rate) and self.concurrency is None and self.duration_s is not None:
            raise ValueError("--duration needs --request-rate or --concurrency (else it floods)")


class Progress:
    """tqdm when installed, else one status line every few seconds on stderr."""

    def __init__(self, total: int | None, desc: str = "bench", enabled: bool = True) -> None:
        self.done = self.failed = 0
        self.total, self.desc, self.enabled = total, desc, enabled
        self._last = time.monotonic()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)

    def update(self, res: RequestResult) -> None:
        self.done += 1
        self.failed += 0 if res.ok else 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(failed=self.failed, refresh=False)
        elif time.monotonic() - self._last > 2.0 or self.done == self.total:
            self._last = time.monotonic()
            print(f"{self.desc}: {self.done}/{self.total or '?'} done, {self.failed} failed",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _spec_stream(specs: list[RequestSpec], cycle: bool) -> Iterator[RequestSpec]:
    return itertools.cycle(specs) if cycle else iter(specs)


async def run(cfg: ClientConfig, arrival: ArrivalConfig, specs: list[RequestSpec],
              progress: Progress | None = None, t0: float | None = None,
              index_base: int = 0) -> list[RequestResult]:
    """Send the specs with the given arrival process; results in issue order.

    `t0` (a time.monotonic() value) is the clock origin of every result; share it between concurrent
    runs (the mixed experiment) so their timelines line up.
    """
    if not specs:
        raise ValueError("no requests to send")
    t0 = time.monotonic() if t0 is None else t0
    rng = random.Random(arrival.seed)
    limit = arrival.concurrency or 1000
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    start = time.monotonic()
    tasks: list[asyncio.Task] = []

    def expired() -> bool:
        return arrival.duration_s is not None and time.monotonic() - start >= arrival.duration_s

    async def one(client: httpx.AsyncClient, spec: RequestSpec, i: int) -> RequestResult:
        try:
            res = await send(client, cfg, spec, i, t0)
        finally:
            sem.release()
        if progress is not None:
            progress.update(res)
        return res

    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout_s) as client:
        for i, spec in enumerate(_spec_stream(specs, arrival.duration_s is not None)):
            if expired():
                break
            await sem.acquire()
            if expired():
                sem.release()
                break
            tasks.append(asyncio.create_task(one(client, spec, index_base + i)))
            if not math.isinf(arrival.request_rate):
                await asyncio.sleep(rng.expovariate(arrival.request_rate))
        return list(await asyncio.gather(*tasks))
