"""`pdserve` command line: one subcommand per process kind.

    pdserve up          router + prefill + decode on this machine (the local quick start)
    pdserve router      the OpenAI-compatible router
    pdserve prefill     a prefill service (frontend + worker)
    pdserve decode      a decode service (frontend + worker)
    pdserve colocated   one service doing prefill and decode (single node, the PD baseline)
    pdserve bench       the load generator
    pdserve model       prepare the embedded default model and print its directory
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "up": ("pdserve.up", "start router + prefill + decode locally, wait until healthy"),
    "router": ("router.main", "OpenAI-compatible router that pairs prefill and decode workers"),
    "prefill": ("prefill_service.main", "prefill service: chunked prefill, streams KV to decode"),
    "decode": ("decode_service.main", "decode service: receives KV, runs decode batches"),
    "colocated": ("colocated_service.main", "one service doing prefill and decode (single node)"),
    "encoder": ("encoder_service.main", "vision encoder (E/P/D): runs a vision-language model's tower, sends the "
                "image embeddings to the prefill"),
    "bench": ("loadtest.cli", "load generator: TTFT/ITL/TPOT/throughput, JSON + plots"),
    "model": ("engine.models.embedded", "convert the embedded model once and print its directory"),
}


def usage() -> str:
    lines = ["usage: pdserve COMMAND [--help] [flags]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"pdserve: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
