"""When a chaos fault fires: on a condition read from the victim itself, never after a fixed time.

A fault must meet requests in flight on its victim, else it proves nothing ("the fault hit no request in
flight"). `FaultTrigger` polls on its own thread, while the batch streams, until both hold:
  1. the batch streamed at least `at_tokens` tokens (0: from the first request on; a quarter of the
     expected tokens for a fault "mid-stream"), fed by `on_progress` from the batch's event loop;
  2. `pick()` names a victim with requests in flight by its own count (`busiest`: each candidate's
     /server_info `in_flight`, the requests its frontend received and has not finished),
then calls `inject(victim)` at once. The wait has a deadline: past `timeout` s, or when the batch ends
first, `hit` says what was waited for instead of naming a victim.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from common.http import TOKEN_HEADER

POLL_S = 0.02  # between two reads of the condition


def in_flight(url: str, token: str = "") -> int:
    """Requests in flight on the worker at `url` by its own count (/server_info `in_flight`: received by its
    frontend, not yet finished); 0 when it does not answer (token: the internal one, if any)."""
    headers = {TOKEN_HEADER: token} if token else {}
    try:
        return int(httpx.get(url + "/server_info", headers=headers, timeout=5).json()["in_flight"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return 0


def busiest(workers: dict[str, str], token: str = "") -> tuple[str, int]:
    """Of `workers` (name -> url, at least one), the one with the most requests in flight by its own count,
    and that count (0 when none has any)."""
    counts = {name: in_flight(url, token) for name, url in workers.items()}
    name = max(counts, key=lambda n: counts[n])
    return name, counts[name]


class FaultTrigger:
    """One fault, injected from a thread as soon as its condition holds (module docstring).

    `start()` before the batch, `on_progress(tokens)` from it, `stop()` after it: stop returns `hit`,
    {"node": victim, "in_flight": its count when picked} once injected, else {"error": message naming what
    was waited for}. An exception raised by `pick` or `inject` ends the wait as an error too."""

    def __init__(self, what: str, pick: Callable[[], tuple[str, int]], inject: Callable[[str], None],
                 timeout: float, at_tokens: int = 0) -> None:
        self.what, self.pick, self.inject, self.timeout, self.at_tokens = what, pick, inject, timeout, at_tokens
        self.tokens = 0
        self.hit: dict = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-trigger", daemon=True)

    def on_progress(self, tokens: int) -> None:
        """The batch's tokens streamed so far (called from its event loop: cheap, no I/O)."""
        self.tokens = tokens

    def start(self) -> FaultTrigger:
        self._thread.start()
        return self

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the trigger to have fired or given up; True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> dict:
        """End the wait (the batch is over), wait for an injection under way, and return `hit`."""
        self._done.set()
        self._thread.join()
        if not self.hit:
            self.hit["error"] = f"the batch ended before {self._waited_for()}"
        return self.hit

    def _waited_for(self) -> str:
        gate = f"{self.at_tokens} tokens streamed and " if self.at_tokens else ""
        return f"{gate}{self.what} (tokens streamed: {self.tokens})"

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            while not self._done.is_set():
                if self.tokens >= self.at_tokens:
                    node, n = self.pick()
                    if n > 0 and not self._done.is_set():
                        self.hit.update(node=node, in_flight=n)
                        self.inject(node)
                        return
                if time.monotonic() >= deadline:
                    self.hit["error"] = f"timed out after {self.timeout:g} s waiting for {self._waited_for()}"
                    return
                self._done.wait(POLL_S)
        except Exception as e:  # noqa: BLE001 - reported as the scenario's problem, not lost in a thread
            self.hit = {"error": f"while waiting for {self._waited_for()}: {type(e).__name__}: {e}"}
