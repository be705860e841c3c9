"""Prometheus text exposition parsing, enough to read counters off the workers' /metrics."""

from __future__ import annotations

import math
import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted labels)


def parse(text: str) -> dict[Sample, float]:
    """Samples of a /metrics page; comment lines skipped, bad lines raise ValueError."""
    out: dict[Sample, float] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"/metrics line {n} is not Prometheus text: {line[:120]!r}")
        name, labels, value = m.groups()
        lab = tuple(sorted(_LABEL.findall(labels or "")))
        try:
            v = float(value)
        except ValueError as e:
            raise ValueError(f"/metrics line {n}: bad value {value!r}") from e
        out[(name, lab)] = v
    return out


def total(samples: dict[Sample, float], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`; NaN when there is none."""
    vals = [v for (n, lab), v in samples.items()
            if n == name and all((k, want) in lab for k, want in labels.items())]
    return math.fsum(vals) if vals else math.nan


def names_with_prefix(samples: dict[Sample, float], prefix: str) -> list[str]:
    return sorted({n for n, _ in samples if n.startswith(prefix)})


def matching(samples: dict[Sample, float], prefix: str, word: str) -> list[str]:
    """Samples (rendered `name{labels}`) under `prefix` whose name or a label value contains `word`."""
    out = []
    for name, lab in samples:
        if name.startswith(prefix) and (word in name or any(word in v for _, v in lab)):
            out.append(name + ("{" + ",".join(f'{k}="{v}"' for k, v in lab) + "}" if lab else ""))
    return sorted(out)
