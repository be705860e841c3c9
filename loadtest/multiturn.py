"""Multi-turn chat workload for `pdserve bench --conversations N`.

N conversations run in lockstep rounds: turn t of every conversation is sent at once (capped by
--concurrency), and turn t+1 starts when all of turn t has answered. Each turn's prompt is the
whole conversation so far plus a new user message of `turn_len` synthetic tokens: the optional
shared system prompt, every earlier user message and the reply the server streamed to it (chat:
as messages; completions: the texts concatenated). A prefix cache sees each turn's history again.

Reported per turn index: TTFT (p50/p90), mean cached prompt tokens (usage
`prompt_tokens_details.cached_tokens`), and, when `kv_metrics_urls` name PD workers, the KV bytes
transferred per request (the rise of `pdserve_worker_transfer_bytes_total` over the turn / requests).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx
import numpy as np
from tokenizers import Tokenizer

from common.http import TOKEN_HEADER
from loadtest import promtext
from loadtest.client import ClientConfig
from loadtest.metrics import RequestResult
from loadtest.runner import ArrivalConfig, Progress, run
from loadtest.workload import PromptMaker, RequestSpec, count_tokens

TRANSFER_BYTES_METRIC = "pdserve_worker_transfer_bytes_total"


@dataclass(frozen=True)
class MultiTurnConfig:
    conversations: int
    turns: int
    turn_len: int  # tokens of each new user message
    output_len: int  # tokens of each reply
    system_len: int = 0  # tokens of a system prompt shared by every conversation (0: none)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1:
            raise ValueError("--conversations and --turns must be >= 1")
        if self.turn_len < 1 or self.output_len < 1 or self.system_len < 0:
            raise ValueError("--turn-len and --output-len must be >= 1, --system-prompt-len >= 0")


class Conversation:
    def __init__(self, system: str) -> None:
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    def spec(self, user: str, tok: Tokenizer, output_len: int, turn: int) -> RequestSpec:
        msgs = (*self.messages, {"role": "user", "content": user})
        text = "".join(m["content"] for m in msgs)
        return RequestSpec(text, count_tokens(tok, text), output_len, f"turn{turn}", msgs)

    def answered(self, user: str, reply: str) -> None:
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


def transfer_bytes(urls: list[str], token: str | None) -> float | None:
    """Sum of the KV bytes the given workers report as transferred (None without URLs)."""
    if not urls:
        return None
    headers = {TOKEN_HEADER: token} if token else {}
    total = 0.0
    for url in urls:
        r = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10)
        r.raise_for_status()
        total += promtext.total(promtext.parse(r.text), TRANSFER_BYTES_METRIC)
    return total


async def run_multi_turn(cfg: ClientConfig, mt: MultiTurnConfig, tok: Tokenizer, concurrency: int | None,
                         kv_metrics_urls: list[str] | None = None, token: str | None = None,
                         progress: Progress | None = None) -> tuple[list[RequestResult], list[dict]]:
    """Every turn of every conversation; (results in issue order, per-turn rows)."""
    rng = random.Random(mt.seed)
    maker = PromptMaker(tok, rng)
    system = maker.make(mt.system_len) if mt.system_len else ""
    convs = [Conversation(system) for _ in range(mt.conversations)]
    results: list[RequestResult] = []
    rows: list[dict] = []
    for turn in range(mt.turns):
        users = [maker.make(mt.turn_len) for _ in convs]
        specs = [c.spec(u, tok, mt.output_len, turn) for c, u in zip(convs, users)]
        before = transfer_bytes(kv_metrics_urls or [], token)
        got = await run(cfg, ArrivalConfig(concurrency=concurrency), specs, progress, index_base=len(results))
        after = transfer_bytes(kv_metrics_urls or [], token)
        for c, u, r in zip(convs, users, got):
            c.answered(u, r.text)
        results += got
        rows.append(turn_row(turn, got, None if before is None or after is None else after - before))
    return results, rows


def turn_row(turn: int, results: list[RequestResult], kv_bytes: float | None) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    prompt = [r.server_prompt_tokens or r.prompt_len for r in ok]
    return {
        "turn": turn + 1, "requests": len(results), "failed": len(results) - len(ok),
        "prompt_tokens_mean": float(np.mean(prompt)) if prompt else None,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None,
        "cached_tokens_mean": float(np.mean(cached)) if cached else None,
        "kv_bytes_per_request": None if kv_bytes is None or not results else kv_bytes / len(results),
    }


def turn_table(rows: list[dict]) -> str:
    def cell(v: float | None, scale: float = 1.0, fmt: str = ".0f") -> str:
        return "-" if v is None else format(v * scale, fmt)

    lines = [f"{'turn':>4}{'reqs':>6}{'prompt':>8}{'cached':>8}{'ttft p50 ms':>13}{'ttft p90 ms':>13}{'KV B/req':>12}"]
    for r in rows:
        lines.append(f"{r['turn']:>4}{r['requests']:>6}{cell(r['prompt_tokens_mean']):>8}"
                     f"{cell(r['cached_tokens_mean']):>8}{cell(r['ttft_p50_s'], 1000):>13}"
                     f"{cell(r['ttft_p90_s'], 1000):>13}{cell(r['kv_bytes_per_request']):>12}")
    return "\n".join(lines)
