"""Frozen configs built by name, never copied field by field.

A config's fields are filled from the attributes of the same name of a source: an argparse Namespace (the
flag's `dest` is the field's name) or another config (a layered one, e.g. the service's PDConfig ->
the transfer layer's TransferConfig). A field added to a config and to its flags flows through with no
copy to update. Values that several flags make, or that are read from files, are passed as `derived`.
Validation stays in each config's __post_init__ (ValueError naming the flag). Pure Python.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def named_values(cls: type, src: object, prefix: str = "") -> dict[str, Any]:
    """{field: getattr(src, prefix + field)} for each field of the dataclass `cls` that `src` has and that is
    not None (a role's parser lacks the other role's flags, and a flag left unset may parse as None: those
    fields keep their defaults, or what a config file gave). `prefix`: a flag group's, e.g. "k8s_"."""
    out = {}
    for f in fields(cls):
        value = getattr(src, prefix + f.name, None)
        if value is not None:
            out[f.name] = value
    return out


def build(cls: type[T], src: object, prefix: str = "", **derived: Any) -> T:
    """`cls(**named_values(cls, src, prefix), **derived)`, `derived` winning: the config built from `src`
    by name."""
    return cls(**(named_values(cls, src, prefix) | derived))
