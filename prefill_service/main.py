"""`pdserve prefill`: the prefill service of a PD pair.

Lifecycle of one request here (see docs/architecture.md for the whole path):
  1. the router posts the body with bootstrap_host/port/room (all three required, else 400)
  2. this frontend tokenizes and sends a GenerateReq to the prefill worker
     (`prefill_service.worker:run_prefill_worker`)
  3. the worker waits for the decode's TransferInfo for the room, runs chunked prefill, streams KV
  4. once the KV is transferred the worker reports the request finished with the first token
     (and input logprobs when asked); this frontend answers the router with that result
"""

from __future__ import annotations

import sys

from service.launch import run_main


def main(argv: list[str] | None = None) -> int:
    return run_main("prefill", "prefill_service.worker:run_prefill_worker", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
