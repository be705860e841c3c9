"""The small value checks every package repeats: `need` (raise with a message unless a condition holds),
`is_int` and `is_num` (JSON numbers, never a bool). Pure Python, no imports: the engine, the router,
the services and the configs all import them from here (docs/architecture.md, "Import rules")."""

from __future__ import annotations

from typing import Any


def need(ok: bool, msg: str, exc: type[Exception] = ValueError) -> None:
    """Raise `exc(msg)` unless `ok` (configs and params raise ValueError, parsers their 400 type)."""
    if not ok:
        raise exc(msg)


def is_int(x: Any) -> bool:
    """An integer, and not a bool (JSON's true is not 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x: Any) -> bool:
    """An int or a float, and not a bool."""
    return isinstance(x, int | float) and not isinstance(x, bool)
