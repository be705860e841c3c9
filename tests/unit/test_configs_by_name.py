"""Configs built from parsed flags by name (common/configs.py): no field copied by hand, so a flag whose
dest is a field's name reaches the config, and the layered PDConfig -> TransferConfig keeps every value.
Flags declared once: each field declares its flag (option), the parsers are generated from them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from common.configs import Group, add_flags, build, named_values, nested, option, specs, to_argv
from engine.config import CPU_DEFAULT_TOKENS
from service.config import PDConfig, add_server_args, build_parser, server_config_from_args, server_specs


@dataclass(frozen=True)
class _Cfg:
    port: int = 1
    name: str = "a"
    extra: float = 0.5

    def __post_init__(self) -> None:
        if self.port < 0:
            raise ValueError("--port must be >= 0")


def test_by_name_skips_missing_and_none_and_derived_wins():
    ns = argparse.Namespace(port=7, name=None, unrelated=3, x_extra=2.0)
    assert named_values(_Cfg, ns) == {"port": 7}
    assert build(_Cfg, ns) == _Cfg(port=7)
    assert build(_Cfg, ns, name="b") == _Cfg(port=7, name="b")
    assert build(_Cfg, ns, prefix="x_") == _Cfg(extra=2.0)
    with pytest.raises(ValueError, match="--port"):
        build(_Cfg, argparse.Namespace(port=-1))


def test_every_transfer_flag_reaches_the_transfer_config(tmp_path):
    token = tmp_path / "t"
    token.write_text("s3cret\n")
    p = argparse.ArgumentParser()
    add_server_args(p, "prefill")
    ns = p.parse_args(["--device", "cpu", "--bootstrap-port", "0", "--advertise-host", "10.0.0.7",
                       "--transfer-backend", "fake", "--bootstrap-timeout", "7", "--waiting-timeout", "8",
                       "--heartbeat-interval", "2", "--no-transfer-progress-thread", "--cluster-token-file", str(token),
                       "--schedule-aging", "3"])
    cfg = server_config_from_args(ns, "prefill")
    assert cfg.engine.schedule_aging_s == 3 and cfg.engine.prefix_cache
    tc = cfg.pd.transfer_config("prefill")
    assert (tc.role, tc.advertise_host, tc.bootstrap_port, tc.backend) == ("prefill", "10.0.0.7", 0, "fake")
    assert (tc.bootstrap_timeout_s, tc.waiting_timeout_s, tc.heartbeat_interval_s) == (7, 8, 2)
    assert tc.cluster_token == "s3cret" and tc.progress_thread is False
    assert PDConfig().transfer_config("decode").advertise_host == "127.0.0.1"  # built without flags


# --- flags declared once: config fields that declare their flags (common.configs.option) ----------------

G = Group("things", "what the things are")


@dataclass(frozen=True)
class _Sub:
    depth: int = option(3, "how deep (default {default})", group=G)


@dataclass(frozen=True)
class _Declared:
    size: int = option(16, "tokens per page", group=G)
    ratio: float = option(0.5, "a share (default {default:g})", cli_default=None)
    mode: str = option("a", "the mode", choices=("a", "b"), roles=("x",), role_defaults={"x": "b"})
    paths: tuple[str, ...] = option((), "NAME=PATH pairs", nargs="+", metavar="NAME=PATH")
    cache: bool = option(False, "do not cache", name="--disable-cache", action="store_false", cli_default=True)
    thread: bool = option(True, "use a thread", action="optional")
    loud: bool = option(False, "say more")
    token: str | None = option(None, "file holding the token", name="--token-file", dest="token_file")
    sub: _Sub = nested(_Sub, "sub_")
    internal: str = ""  # no flag


def _parser(role: str = "x") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, list(specs(_Declared, role)))
    return p


def test_a_field_declares_its_flag_type_default_choices_and_help():
    p = _parser()
    ns = p.parse_args([])
    assert vars(ns) == {"size": 16, "ratio": None, "mode": "b", "paths": (), "cache": True, "thread": True,
                        "loud": False, "token_file": None, "sub_depth": 3}
    ns = p.parse_args(["--size", "8", "--ratio", "0.25", "--mode", "a", "--paths", "x=/1", "y=/2", "--disable-cache",
                       "--no-thread", "--loud", "--token-file", "/t", "--sub-depth", "4"])
    assert (ns.size, ns.ratio, ns.mode, ns.paths, ns.cache, ns.thread, ns.loud) == (8, 0.25, "a", ["x=/1", "y=/2"],
                                                                                     False, False, True)
    assert (ns.token_file, ns.sub_depth) == ("/t", 4)
    with pytest.raises(argparse.ArgumentError):
        p.parse_args(["--mode", "c"])
    text = p.format_help()
    assert "a share (default 0.5)" in text and "how deep (default 3)" in text  # the field's default, shown
    assert "things:\n  what the things are" in text and "--paths NAME=PATH [NAME=PATH ...]" in text
    assert "--internal" not in text
    assert "--mode" not in _parser("y").format_help()  # a flag for role x only


def test_a_config_is_built_from_its_generated_flags_by_name():
    ns = _parser().parse_args(["--size", "8", "--disable-cache"])
    cfg = build(_Declared, ns, token=None, sub=build(_Sub, ns, prefix="sub_"))
    assert cfg == _Declared(size=8, mode="b", cache=False)  # ratio unset (None): the field's default


def test_to_argv_gives_back_the_flags_of_the_values():
    items = list(specs(_Declared, "x", default=argparse.SUPPRESS))
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, items)
    given = ["--size", "8", "--paths", "x=/1", "--disable-cache", "--no-thread", "--loud", "--token-file", "/t"]
    values = vars(p.parse_args(given))
    assert set(values) == {"size", "paths", "cache", "thread", "loud", "token_file"}  # only what was given
    assert to_argv(items, values) == given
    assert vars(p.parse_args(to_argv(items, values))) == values


def test_every_service_flag_is_generated_from_a_field_and_explained():
    """Each role's parser: every flag from a config field's declaration (but the shared observability pair),
    with help text; the engine's, spec's and PD transfer's fields all reachable by name."""
    for role in ("colocated", "prefill", "decode"):
        p = build_parser(role)
        declared = {s.name for s in server_specs(role)}
        flags = {o for a in p._actions for o in a.option_strings if o.startswith("--") and not o.startswith("--no-")}
        assert flags - declared == {"--help", "--otlp-endpoint", "--log-format"}, role
        assert all(a.help for a in p._actions), role
        assert ("--schedule-policy" in flags) == (role != "decode")
        assert ("--bootstrap-port" in flags) == (role == "prefill")
        assert ("--local-prefill-threshold" in flags) == (role == "decode")
        assert ("--session-timeout" in flags) == (role == "colocated")
    assert build_parser("prefill").parse_args([]).schedule_policy == "sjf"
    assert build_parser("colocated").parse_args([]).schedule_policy == "fcfs"


def test_service_config_from_generated_flags():
    ns = build_parser("decode").parse_args(["--device", "cpu", "--disable-prefix-cache", "--speculative", "ngram",
                                            "--lora-paths", "a=/x", "--local-prefill-budget", "7",
                                            "--drain-grace", "2"])
    cfg = server_config_from_args(ns, "decode")
    assert cfg.engine.prefix_cache is False and cfg.engine.spec.speculative == "ngram"
    assert cfg.engine.lora_paths == ("a=/x",) and cfg.pd.local_prefill_budget == 7 and cfg.drain_grace_s == 2
    assert cfg.engine.max_total_tokens == CPU_DEFAULT_TOKENS and cfg.engine.dtype == "float32"
    assert server_config_from_args(build_parser("colocated").parse_args(["--device", "cpu"]), "colocated") \
        .engine.prefix_cache is True
    with pytest.raises(ValueError, match="--drain-grace"):
        server_config_from_args(build_parser("colocated").parse_args(["--device", "cpu", "--drain-grace", "-1"]),
                                "colocated")
