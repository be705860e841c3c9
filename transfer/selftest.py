"""Two-process transfer self-test: `python -m transfer.selftest --role prefill|decode ...`.

Both processes derive the same random plan from --seed: for every room, source pages, destination
pages (random non-contiguous lists with some consecutive runs; destinations disjoint across rooms)
and a random chunking. The prefill fills its pool with seeded random bytes and streams every room;
the decode rebuilds the expected source pool from the seed and checks every destination page byte
for byte. Each prints JSON lines on stdout: {"event": "ready", ...} then {"event": "done", ...}
with per-state room counts, errors and the manager's stats after every room was released.
Used by the integration tests (loopback, network namespaces, faults); also a quick check between
two real nodes.

--stall-after N stops driving the manager after N chunks sent (prefill) or N rooms complete
(decode) and prints {"event": "stalled"}: the tests then kill the process to simulate a crash.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass

import torch

from common.configs import build
from transfer import CompatInfo, KVPoll, TransferConfig, TransferManager
from transfer.state import TERMINAL


@dataclass
class RoomPlan:
    room: int
    src: list[int]
    dst: list[int]
    chunks: list[int]  # chunk sizes in pages, summing to len(src)


def _shuffled_runs(rng: random.Random, pages: list[int]) -> list[int]:
    runs, i = [], 0
    while i < len(pages):
        n = rng.randint(1, 6)
        runs.append(pages[i:i + n])
        i += n
    rng.shuffle(runs)
    return [p for run in runs for p in run]


def make_plan(seed: int, rooms: int, max_pages: int, max_chunks: int, num_pages: int) -> list[RoomPlan]:
    rng = random.Random(seed)
    sizes = [rng.randint(1, max_pages) for _ in range(rooms)]
    if sum(sizes) > num_pages - 1:
        raise ValueError(f"pool of {num_pages} pages is too small for {sum(sizes)} destination pages")
    src_order = _shuffled_runs(rng, list(range(1, num_pages)))
    dst_order = _shuffled_runs(rng, list(range(1, num_pages)))
    plans, at = [], 0
    for k, n in enumerate(sizes):
        s0 = rng.randrange(0, num_pages - 1 - n + 1)
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, max_chunks - 1)))) if n > 1 else []
        bounds = [0, *cuts, n]
        plans.append(RoomPlan(rng.getrandbits(63) | k, src_order[s0:s0 + n], dst_order[at:at + n],
                              [b - a for a, b in zip(bounds, bounds[1:])]))
        at += n
    return plans


def source_pool(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.num_pages, args.layers, 2, args.page_size, args.kv_heads, args.head_dim)
    return torch.randint(-1000, 1000, shape, generator=g).float()  # [pages, L, 2, P, H, D] fp32


def compat(args: argparse.Namespace) -> CompatInfo:
    return CompatInfo(args.model, "float32", args.page_size, "page_major", args.layers, args.kv_heads,
                      args.head_dim)


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def _stall() -> None:
    emit(event="stalled")
    while True:
        time.sleep(3600)


def run_prefill(args: argparse.Namespace, mgr: TransferManager, plans: list[RoomPlan]) -> dict:
    senders = {p.room: mgr.create_sender(p.room) for p in plans}
    next_chunk = {p.room: 0 for p in plans}
    sent = 0
    deadline = time.monotonic() + args.deadline
    next_send = 0.0
    while any(s.poll() not in TERMINAL for s in senders.values()) and time.monotonic() < deadline:
        mgr.progress()
        for plan in plans:
            if time.monotonic() < next_send:
                break
            s, k = senders[plan.room], next_chunk[plan.room]
            if s.poll() in (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING) and k < len(plan.chunks):
                a = sum(plan.chunks[:k])
                last = k == len(plan.chunks) - 1
                s.send(plan.src[a:a + plan.chunks[k]], last, {"room": plan.room, "first_token": k} if last
                       else None)
                next_chunk[plan.room] = k + 1
                sent += 1
                next_send = time.monotonic() + args.send_interval
                if args.stall_after and sent >= args.stall_after:
                    _stall()
        mgr.idle_wait(0.001)
    return _finish(mgr, senders)


def run_decode(args: argparse.Namespace, mgr: TransferManager, plans: list[RoomPlan],
               pool: torch.Tensor) -> dict:
    expected = source_pool(args)
    recvs = {p.room: mgr.create_receiver(p.room, args.bootstrap, p.dst) for p in plans}
    deadline = time.monotonic() + args.deadline
    while any(r.poll() not in TERMINAL for r in recvs.values()) and time.monotonic() < deadline:
        mgr.progress()
        done = sum(r.poll() == KVPoll.SUCCESS for r in recvs.values())
        if args.stall_after and done >= args.stall_after:
            _stall()
        mgr.idle_wait(0.001)
    bad = []
    for plan in plans:
        r = recvs[plan.room]
        if r.poll() == KVPoll.SUCCESS:
            ok = torch.equal(pool[plan.dst], expected[plan.src])
            if not ok or r.metadata != {"room": plan.room, "first_token": len(plan.chunks) - 1}:
                bad.append(plan.room)
    out = _finish(mgr, recvs)
    out["mismatched"] = bad
    return out


def _finish(mgr: TransferManager, rooms: dict) -> dict:
    states: dict[str, int] = {}
    errors = []
    for room in rooms.values():
        states[room.poll().name] = states.get(room.poll().name, 0) + 1
        if room.error is not None:
            errors.append({"room": room.room, "code": int(room.error.code), "message": room.error.message})
        room.release()
    for _ in range(20):  # let acks and aborts leave
        mgr.progress()
        mgr.idle_wait(0.005)
    return {"states": states, "errors": errors[:5], "num_errors": len(errors),
            "active_rooms": mgr.active_rooms(), "stats": mgr.stats().to_info()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["prefill", "decode"], required=True, help="which side to run")
    # dests are TransferConfig's field names: the config is built from them by name (common.configs)
    ap.add_argument("--host", default="127.0.0.1", dest="advertise_host", metavar="HOST",
                    help="advertise/bind address of this process")
    ap.add_argument("--port", type=int, default=0, dest="bootstrap_port", metavar="PORT",
                    help="prefill: bootstrap port (0 = free port)")
    ap.add_argument("--bootstrap", default="", help="decode: host:port of the prefill bootstrap server")
    ap.add_argument("--rooms", type=int, default=100, help="number of rooms")
    ap.add_argument("--seed", type=int, default=0, help="plan and data seed (same on both sides)")
    ap.add_argument("--max-pages", type=int, default=10, help="max pages per room")
    ap.add_argument("--max-chunks", type=int, default=4, help="max chunks per room")
    ap.add_argument("--num-pages", type=int, default=1100, help="KV pool pages")
    ap.add_argument("--layers", type=int, default=4, help="KV pool layers")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim")
    ap.add_argument("--model", default="selftest", help="model name in the compatibility hash")
    ap.add_argument("--backend", default="ucx", choices=["ucx", "fake"], help="data backend")
    ap.add_argument("--heartbeat", type=float, default=0.5, dest="heartbeat_interval_s", metavar="HEARTBEAT",
                    help="heartbeat interval, seconds")
    ap.add_argument("--waiting-timeout", type=float, default=60.0, dest="waiting_timeout_s",
                    metavar="WAITING_TIMEOUT", help="decode waiting timeout, s")
    ap.add_argument("--bootstrap-timeout", type=float, default=60.0, dest="bootstrap_timeout_s",
                    metavar="BOOTSTRAP_TIMEOUT", help="prefill bootstrap timeout, s")
    ap.add_argument("--stall-after", type=int, default=0, help="stop driving after N chunks/rooms")
    ap.add_argument("--send-interval", type=float, default=0.0,
                    help="prefill: seconds between chunk sends (spreads a run out in time)")
    ap.add_argument("--deadline", type=float, default=120.0, help="give up after this many seconds")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build(TransferConfig, args)
    plans = make_plan(args.seed, args.rooms, args.max_pages, args.max_chunks, args.num_pages)
    pool = source_pool(args) if args.role == "prefill" else torch.zeros(
        args.num_pages, args.layers, 2, args.page_size, args.kv_heads, args.head_dim)
    with TransferManager(cfg, pool, compat(args)) as mgr:
        if args.role == "prefill":
            emit(event="ready", bootstrap_port=mgr.bootstrap_port, page_bytes=mgr.page_bytes)
            out = run_prefill(args, mgr, plans)
        else:
            emit(event="ready", page_bytes=mgr.page_bytes)
            out = run_decode(args, mgr, plans, pool)
    emit(event="done", role=args.role, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
