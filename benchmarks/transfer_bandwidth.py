"""KV transfer bandwidth: TransferManager vs a raw ucxx tag send of the same bytes, two processes.

For each prompt length (default 1k, 8k, 32k tokens) the prefill process (this one) streams a room's
KV pages, KV of the embedded model's shape (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64,
page_size 16, fp32 by default), in chunks of --chunk-tokens, to a decode process; the time runs
from the first send() to the sender's SUCCESS (decode's ack included). In the same run the same
bytes go as one raw ucxx tag message between two bare UCX workers (time until the receiver's
completion notice arrives). Writes JSON: bytes, seconds, bytes/s for both and their ratio.

    python benchmarks/transfer_bandwidth.py --out /tmp/transfer_bandwidth.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 16


def pool_for(tokens: int, dtype: str):
    import torch

    pages = tokens // PAGE_SIZE + 1  # page 0 reserved
    # [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]
    return torch.ones(pages, LAYERS, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=getattr(torch, dtype))


def compat(dtype: str):
    from transfer import CompatInfo

    return CompatInfo("smollm2-135m", dtype, PAGE_SIZE, "page_major", LAYERS, KV_HEADS, HEAD_DIM)


def raw_worker():
    import ucxx._lib.libucxx as ucx_api

    ctx = ucx_api.UCXContext(config_dict={"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"},
                             feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    return ucx_api, ctx, ucx_api.UCXWorker(ctx)


def decode_proc(conn, max_tokens: int, dtype: str) -> None:
    from ucxx._lib.arr import Array

    from transfer import TransferConfig, TransferManager
    from transfer.layout import page_view
    from transfer.state import TERMINAL

    pool = pool_for(max_tokens, dtype).zero_()
    ucx_api, _ctx, worker = raw_worker()
    with TransferManager(TransferConfig(role="decode"), pool, compat(dtype)) as mgr:
        conn.send(worker.address.tobytes())
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            if cmd[0] == "room":
                _, room, addr, dst = cmd
                r = mgr.create_receiver(room, addr, dst)
                while r.poll() not in TERMINAL:
                    mgr.progress()
                conn.send(r.poll().name)
                r.release()
            elif cmd[0] == "raw":
                _, nbytes, tag = cmd
                buf = page_view(pool).reshape(-1)[:nbytes].numpy()
                req = worker.tag_recv(Array(buf), ucx_api.UCXXTag(tag))
                conn.send("posted")
                while not req.completed:
                    worker.progress()
                req.check_error()
                conn.send("ok")


def run_room(mgr, conn, room: int, tokens: int, chunk_tokens: int) -> float:
    from transfer import KVPoll

    pages = list(range(1, tokens // PAGE_SIZE + 1))
    conn.send(("room", room, f"127.0.0.1:{mgr.bootstrap_port}", pages))
    s = mgr.create_sender(room)
    while s.poll() == KVPoll.BOOTSTRAPPING:
        mgr.progress()
    per = chunk_tokens // PAGE_SIZE
    t0 = time.perf_counter()
    for k in range(0, len(pages), per):
        s.send(pages[k:k + per], is_last=k + per >= len(pages))
        mgr.progress()
    while s.poll() == KVPoll.TRANSFERRING:
        mgr.progress()
    dt = time.perf_counter() - t0
    assert s.poll() == KVPoll.SUCCESS and conn.recv() == "SUCCESS", s.error
    s.release()
    return dt


def run_raw(worker, ucx_api, ep, conn, pool, nbytes: int, tag: int) -> float:
    from ucxx._lib.arr import Array

    from transfer.layout import page_view

    buf = page_view(pool).reshape(-1)[:nbytes].numpy()
    conn.send(("raw", nbytes, tag))
    assert conn.recv() == "posted"
    t0 = time.perf_counter()
    req = ep.tag_send(Array(buf), ucx_api.UCXXTag(tag))
    while not req.completed:
        worker.progress()
    req.check_error()
    assert conn.recv() == "ok"
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,8192,32768", help="comma-separated prompt lengths")
    ap.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk size in tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="KV dtype (the engine's CPU default is float32)")
    ap.add_argument("--iters", type=int, default=3, help="timed repetitions per size (best is kept)")
    ap.add_argument("--tls", default="tcp", help="UCX_TLS for both processes ('' = UCX's choice)")
    ap.add_argument("--out", default="", help="write the JSON here too")
    args = ap.parse_args()
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    sizes = [int(t) for t in args.tokens.split(",")]

    from transfer import TransferConfig, TransferManager

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=decode_proc, args=(child_conn, max(sizes), args.dtype))
    child.start()
    pool = pool_for(max(sizes), args.dtype)
    ucx_api, _rctx, worker = raw_worker()
    peer = ucx_api.UCXAddress.create_from_buffer(conn.recv())
    ep = ucx_api.UCXEndpoint.create_from_worker_address(worker, peer, False)
    results = []
    with TransferManager(TransferConfig(role="prefill", bootstrap_port=0), pool, compat(args.dtype)) as mgr:
        room = 1
        for tokens in sizes:
            nbytes = tokens // PAGE_SIZE * mgr.page_bytes
            run_room(mgr, conn, room, tokens, args.chunk_tokens)  # warm-up (connections)
            run_raw(worker, ucx_api, ep, conn, pool, nbytes, room)
            room += 1
            t_mgr, t_raw = [], []
            for _ in range(args.iters):
                t_mgr.append(run_room(mgr, conn, room, tokens, args.chunk_tokens))
                t_raw.append(run_raw(worker, ucx_api, ep, conn, pool, nbytes, room))
                room += 1
            bw_mgr, bw_raw = nbytes / min(t_mgr), nbytes / min(t_raw)
            results.append({"tokens": tokens, "bytes": nbytes, "transfer_s": min(t_mgr), "raw_s": min(t_raw),
                            "transfer_Bps": bw_mgr, "raw_Bps": bw_raw, "ratio": bw_mgr / bw_raw})
            print(f"{tokens:>6} tok {nbytes / 1e6:8.1f} MB  transfer {bw_mgr / 1e9:6.2f} GB/s  "
                  f"raw {bw_raw / 1e9:6.2f} GB/s  ratio {bw_mgr / bw_raw:5.2f}", file=sys.stderr)
    conn.send(("stop",))
    child.join(timeout=30)
    report = {"model_shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                              "page_size": PAGE_SIZE, "dtype": args.dtype},
              "chunk_tokens": args.chunk_tokens, "ucx_tls": os.environ.get("UCX_TLS", ""),
              "iters": args.iters, "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
