"""`pdserve decode`: the decode service of a PD pair.

Lifecycle of one request here (see docs/architecture.md for the whole path):
  1. the router posts the body with bootstrap_host/port/room (all three required, else 400)
  2. this frontend tokenizes and sends a GenerateReq to the decode worker
     (`decode_service.worker:run_decode_worker`)
  3. the worker reserves KV pages, receives the prompt's KV from the prefill, then decodes
  4. this frontend streams the generated tokens back (SSE or one JSON body)
"""

from __future__ import annotations

import sys

from service.launch import run_main


def main(argv: list[str] | None = None) -> int:
    return run_main("decode", "decode_service.worker:run_decode_worker", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
