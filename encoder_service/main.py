"""`pdserve encoder`: the vision encoder of E/P/D serving (vision-language models; issue 50).

Lifecycle of one request here (see docs/architecture.md "Images" for the whole path):
  1. the router posts an image request's body with bootstrap_host/port/room (this encoder's own bootstrap
     server and the room; all required, else 400), as it posts it to the room's prefill
  2. this frontend loads, checks and preprocesses the images as every role does (service/images.py) and sends
     the GenerateReq to the encoder worker (`encoder_service.worker:run_encoder_worker`)
  3. the worker runs the model's vision tower (alone: no language model, no KV pool), puts the rows into pages
     and sends them to the prefill that connects for the room, over the transfer plane (as KV goes to a decode)
  4. once the prefill acknowledged them, the worker reports the request finished; this frontend answers the
     router with a 200 (or the error: a bad image 400, a failed transfer 5xx)
"""

from __future__ import annotations

import sys

from service.launch import run_main


def main(argv: list[str] | None = None) -> int:
    return run_main("encoder", "encoder_service.worker:run_encoder_worker", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
