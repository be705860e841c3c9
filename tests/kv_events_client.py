"""A KV-event replay client written from vLLM's documented protocol (not pdserve's code), for the tests
of service/kv_events.py: send the 8-byte big-endian start sequence as a REQ client frames it (an empty
delimiter first), read (seq, payload) frames until the end marker, seq -1 with an empty payload."""

from __future__ import annotations

import zmq

END = (-1).to_bytes(8, "big", signed=True)


def replay(endpoint: str, start: int, timeout_ms: int = 10_000) -> list[tuple[int, bytes]]:
    """Every buffered (seq, payload) from `start` on, as the replay socket at `endpoint` sends them."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.connect(endpoint)
    try:
        s.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert s.poll(timeout_ms), "no replay answer"
            empty, seq, payload = s.recv_multipart()
            assert empty == b""
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        s.close()
