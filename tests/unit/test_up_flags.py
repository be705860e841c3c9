"""`pdserve up` declares no worker flag: it takes every prefill/decode flag it does not set itself, generated
from the same config fields, and passes each one given on to the workers that take it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pdserve import up
from service.config import build_parser, server_config_from_args, server_specs


def _argvs(monkeypatch: pytest.MonkeyPatch, flags: list[str]) -> dict[str, list[str]]:
    """Each child's argv of `pdserve up FLAGS` (nothing started)."""
    ports = itertools.count(41000)
    monkeypatch.setattr(up, "free_port", lambda: next(ports))
    out: dict[str, list[str]] = {}
    monkeypatch.setattr(up, "_spawn", lambda name, argv, url, log_dir: out.setdefault(name, argv) and name)
    up.start_all(up.config_from_args(up.build_parser().parse_args(flags)), Path("/tmp"), Path("/tmp/tok"), [])
    return out


def test_up_takes_every_worker_flag_it_does_not_set_itself():
    p = up.build_parser()
    taken = {o for a in p._actions for o in a.option_strings}
    for role in ("prefill", "decode"):
        for s in server_specs(role):
            assert (s.name in taken) or s.dest in up.UP_SETS, s.name
    for name in ("--bootstrap-port", "--tp", "--internal-token-file", "--advertise-host", "--node-rank"):
        assert name not in taken  # up sets these (ports, placement, tokens)
    text = p.format_help()
    assert "worker: model and engine" in text and "worker: prefill/decode transfer" in text
    assert all(a.help for a in p._actions)


def test_up_passes_on_what_was_given_to_the_workers_that_take_it(monkeypatch, tmp_path):
    token = tmp_path / "tok"
    token.write_text("t")
    given = ["--model", "/m", "--max-total-tokens", "999", "--enable-priority-scheduling", "--speculative", "ngram",
             "--lora-paths", "a=/x", "b=/y", "--schedule-policy", "lpm", "--local-prefill-threshold", "0",
             "--no-transfer-progress-thread", "--disable-prefix-cache", "--transfer-backend", "fake"]
    argvs = _argvs(monkeypatch, ["--device", "cpu", "--threads", "1", *given])
    assert set(argvs) == {"router", "prefill-0", "decode-0"}
    configs = {}
    for name in ("prefill-0", "decode-0"):
        role = name.split("-")[0]
        argv = [str(token) if a == "/tmp/tok" else a for a in argvs[name][argvs[name].index(role) + 1:]]
        configs[role] = server_config_from_args(build_parser(role).parse_args(argv), role)
    pre, dec = configs["prefill"], configs["decode"]
    for cfg in (pre, dec):
        eng = cfg.engine
        assert (eng.model, eng.max_total_tokens, eng.enable_priority_scheduling) == ("/m", 999, True)
        assert cfg.engine.spec.speculative == "ngram" and cfg.engine.lora_paths == ("a=/x", "b=/y")
        assert cfg.engine.prefix_cache is False and cfg.pd.progress_thread is False
        assert cfg.pd.transfer_backend == "fake" and cfg.engine.threads == 1
    assert pre.engine.schedule_policy == "lpm" and "--schedule-policy" not in argvs["decode-0"]  # prefill's only
    assert dec.pd.local_prefill_threshold == 0 and "--local-prefill-threshold" not in argvs["prefill-0"]


def test_up_passes_nothing_it_was_not_given(monkeypatch):
    argvs = _argvs(monkeypatch, ["--device", "cpu", "--decode-args", "--local-prefill-threshold 0"])
    dec = argvs["decode-0"]
    assert dec[dec.index("decode") + 1:] == ["--port", dec[dec.index("--port") + 1], "--device", "cpu",
                                             "--internal-token-file", "/tmp/tok", "--log-format", "text",
                                             "--threads", dec[dec.index("--threads") + 1],
                                             "--local-prefill-threshold", "0"]
