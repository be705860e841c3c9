"""GET a few URLs and print one JSON list of {url, status, text}: run inside a node's namespace by the
split-node harness (`ip netns exec NS python -m loadtest.probe URL...`), stdlib only so it starts fast.

With --wait S it polls until every URL answers 200 (or S seconds pass; exit 1 then).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def get(url: str, timeout: float) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return {"url": url, "status": r.status, "text": r.read().decode(errors="replace")}
    except urllib.error.HTTPError as e:
        return {"url": url, "status": e.code, "text": e.read().decode(errors="replace")[:2000]}
    except (urllib.error.URLError, OSError) as e:
        return {"url": url, "status": 0, "text": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.probe", description=__doc__)
    p.add_argument("urls", nargs="+", help="URLs to GET")
    p.add_argument("--wait", type=float, default=0.0, help="poll until all answer 200, at most this many s")
    p.add_argument("--timeout", type=float, default=5.0, help="per-GET timeout in seconds")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.wait
    while True:
        out = [get(u, args.timeout) for u in args.urls]
        if all(o["status"] == 200 for o in out) or time.monotonic() >= deadline:
            break
        time.sleep(0.5)  # polling interval while waiting for services to come up
    print(json.dumps(out))
    return 0 if all(o["status"] == 200 for o in out) else 1


if __name__ == "__main__":
    sys.exit(main())
