"""Frozen configs whose fields declare their own flags, built from parsed flags by name.

Declared once: a field says `x: int = option(16, "help", ...)` (its dataclass metadata holds a `Flag`:
help, choices, flag name, group, the roles that take it, the parser's default where it differs from
the field's); the flag's type comes from the field's annotation. `add_flags` generates a command's
flags from its config (nested configs expand in place), so one declaration serves every command that
takes the flag (colocated, prefill, decode, `pdserve up`); `specs` lists them and `to_argv` turns
parsed values back into flags (`pdserve up` passes the worker flags it was given on to its workers).

Built by name, never copied field by field: `build` fills a config from the attributes of the same name
of a source, an argparse Namespace (a flag's dest is its field's name) or another config (a layered one,
e.g. the service's PDConfig -> the transfer layer's TransferConfig). Values that several flags make, or
that are read from files, are passed as `derived`. Validation stays in each config's __post_init__
(ValueError naming the flag).

Pure Python (dataclasses and argparse only): engine/ may import it (tests/unit/test_import_rules.py).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass, replace
from typing import Any, TypeVar

T = TypeVar("T")


class _FieldDefault:
    def __repr__(self) -> str:
        return "FIELD"


FIELD: Any = _FieldDefault()  # Flag.cli_default: the parser's default is the field's
_KEY = "pdserve.flag"
_NEST = "pdserve.nested"
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class Group:
    """A titled group of flags in --help (argparse argument group)."""

    title: str
    description: str | None = None


@dataclass(frozen=True)
class Flag:
    """What a config field declares about its flag (dataclass field metadata, made by `option`).

    help    the --help text; `{default}` (or `{default:g}`) stands for the default shown
    name    the flag ("" = `--` + the field's name with dashes, after the caller's prefix)
    dest    the Namespace attribute ("" = the field's name: `build` reads it by name; another dest means
            the field is derived from it, e.g. a token read from `--internal-token-file`)
    action  "" (by the annotation: store_true for a bool), "store_false" (a `--disable-x` flag whose
            field is True by default on the command line) or "optional" (`--x/--no-x`)
    cli_default  the parser's default where it is not the field's (e.g. "auto", resolved when the config is
            built; None for a flag that must not override a config file)
    roles   the commands that take the flag (() = every one); role_defaults: a parser default per role
    """

    help: str
    group: Group | None = None
    name: str = ""
    dest: str = ""
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    nargs: str | None = None
    action: str = ""
    type: Any = None
    cli_default: Any = FIELD
    roles: tuple[str, ...] = ()
    role_defaults: Mapping[str, Any] | None = None


def option(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, **flag: Any) -> Any:  # noqa: A002
    """A dataclass field with `default` (or `factory`) that declares its flag (the keywords of `Flag`)."""
    return field(default=default, default_factory=factory, metadata={_KEY: Flag(help=help, **flag)})


def nested(factory: Any, prefix: str = "") -> Any:  # noqa: ANN401
    """A field holding a sub-config whose flags are the parent's too (`prefix` before their names)."""
    return field(default_factory=factory, metadata={_NEST: prefix})


@dataclass(frozen=True)
class Spec:
    """One generated flag: the declaring field, its flag and the argparse keywords."""

    field: str
    flag: Flag
    name: str
    dest: str
    kwargs: dict[str, Any]

    def argv(self, value: Any) -> list[str]:  # noqa: ANN401
        """The command-line words that give this flag `value` (for a child process)."""
        if self.flag.action in ("store_true", "store_false"):
            return [self.name] if value == (self.flag.action == "store_true") else []
        if self.flag.action == "optional":
            return [self.name if value else "--no-" + self.name[2:]]
        if self.flag.nargs:
            return [self.name, *map(str, value)] if value else []
        return [self.name, str(value)]


def _type(f: Field) -> Any:  # noqa: ANN401
    """The argparse type of a field's annotation (a string under `from __future__ import annotations`):
    int, float, str or bool (`X | None` as X, `tuple[str, ...]` as str); None for anything else (a string)."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    base = parts[0].split("[")[0] if len(parts) == 1 else ""
    return _TYPES.get(base)


def _field_default(f: Field) -> Any:  # noqa: ANN401
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _shown(text: str, value: Any) -> str:  # noqa: ANN401
    return re.sub(r"\{default(?::([^}]*))?\}", lambda m: format(value, m.group(1) or ""), text)


def _spec(f: Field, flag: Flag, role: str, prefix: str, default: Any) -> Spec:  # noqa: ANN401
    name = flag.name or "--" + (prefix + f.name).replace("_", "-")
    dest = flag.dest or prefix + f.name
    parser_default = (flag.role_defaults or {}).get(role, flag.cli_default)
    if parser_default is FIELD:
        parser_default = _field_default(f)
    shown = parser_default if parser_default is not None else _field_default(f)
    kw: dict[str, Any] = {"dest": dest, "help": _shown(flag.help, shown),
                          "default": parser_default if default is FIELD else default}
    kind = flag.type or _type(f)
    if flag.action in ("store_true", "store_false") or (kind is bool and not flag.action):
        flag = flag if flag.action else replace(flag, action="store_true")
        kw["action"] = flag.action
    elif flag.action == "optional":
        kw["action"] = argparse.BooleanOptionalAction
    else:
        metavar = flag.metavar or (None if flag.choices else name[2:].upper().replace("-", "_"))
        kw.update(type=None if kind is str else kind, choices=flag.choices, nargs=flag.nargs,
                  metavar=None if metavar == dest.upper() else metavar)  # argparse's own: the dest's
    return Spec(f.name, flag, name, dest, {k: v for k, v in kw.items() if v is not None or k == "default"})


def specs(cls: type, role: str = "", prefix: str = "", default: Any = FIELD) -> Iterator[Spec]:  # noqa: ANN401
    """The flags the fields of the config `cls` declare for `role`, in field order, a nested config's in
    its place. `default` replaces every parser default (argparse.SUPPRESS: a flag not given is absent)."""
    for f in fields(cls):
        flag = f.metadata.get(_KEY)
        if flag is not None and (not flag.roles or not role or role in flag.roles):
            yield _spec(f, flag, role, prefix, default)
        elif _NEST in f.metadata and is_dataclass(f.default_factory):
            yield from specs(f.default_factory, role, prefix + f.metadata[_NEST], default)


def add_flags(p: argparse.ArgumentParser, items: Sequence[Spec], title_prefix: str = "") -> dict[str | None, Any]:
    """Add each flag to its group of `p` (made in the order the groups first appear, titled `title_prefix` +
    the group's title; no group: `p`, or a group titled `title_prefix`). Returns the groups by title (None: the
    ungrouped flags'), for flags added by hand."""
    groups: dict[str | None, Any] = {None: p.add_argument_group(title_prefix.rstrip(": ")) if title_prefix else p}
    for s in items:
        g = s.flag.group
        if g is not None and g.title not in groups:
            groups[g.title] = p.add_argument_group(title_prefix + g.title, g.description)
        groups[g.title if g else None].add_argument(s.name, **s.kwargs)
    return groups


def to_argv(items: Sequence[Spec], values: Mapping[str, Any]) -> list[str]:
    """The words giving each flag of `items` whose dest is in `values` that value, in `items`' order."""
    return [w for s in items if s.dest in values for w in s.argv(values[s.dest])]


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
