"""`pdserve colocated`: one service doing prefill and decode (mixed chunked prefill), the single-node
product and the baseline of every PD measurement.

Processes: this frontend (FastAPI/uvicorn, tokenizer, detokenizer) and one worker
(`colocated_service.worker:run_colocated_worker`: model, KV pool, scheduler loop), joined by zmq over ipc.
Bootstrap fields in request bodies are accepted and ignored.
"""

from __future__ import annotations

import sys

from service.launch import run_main


def main(argv: list[str] | None = None) -> int:
    return run_main("colocated", "colocated_service.worker:run_colocated_worker", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
