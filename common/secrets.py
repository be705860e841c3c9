"""Secret files: a single token (internal token, cluster token) or a list of keys (API keys)."""

from __future__ import annotations

from pathlib import Path


def read_secret(path: str | None, what: str = "secret file") -> str | None:
    """The stripped content of a token file (None without a path); ValueError naming `what` when empty."""
    if not path:
        return None
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"{what} {path} is empty")
    return text


def read_secret_lines(path: str) -> frozenset[str]:
    """API keys file: one key per line, blank lines and #comments ignored; must hold at least one."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read key file {path}: {e}") from e
    keys = frozenset(s.strip() for s in lines if s.strip() and not s.strip().startswith("#"))
    if not keys:
        raise ValueError(f"key file {path} holds no key")
    return keys
