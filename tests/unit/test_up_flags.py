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
    for role in ("prefill", "decode", "encoder"):
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


def _role_config(argv: list[str], role: str, token: Path):
    """The ServerConfig a `role` worker builds from the argv `pdserve up` gave it (its real parser)."""
    argv = [str(token) if a == "/tmp/tok" else a for a in argv[argv.index(role) + 1:]]
    return server_config_from_args(build_parser(role).parse_args(argv), role)


def test_up_starts_encoders_with_their_own_flags_and_registers_them(monkeypatch, tmp_path):
    token = tmp_path / "tok"
    token.write_text("t")
    given = ["--model", "/m", "--dtype", "float32", "--max-total-tokens", "999", "--schedule-policy", "lpm",
             "--speculative", "ngram", "--image-cache-mb", "64", "--image-transfer-tokens", "4096",
             "--transfer-backend", "fake", "--no-transfer-progress-thread", "--max-images-per-request", "3"]
    argvs = _argvs(monkeypatch, ["--device", "cpu", "--threads", "1", "--encoder", "2", *given,
                                 "--worker-args", "--max-running-requests 8",
                                 "--encoder-args", "--image-cache-mb 32 --log-level debug"])
    assert set(argvs) == {"router", "prefill-0", "decode-0", "encoder-0", "encoder-1"}
    encs = [_role_config(argvs[f"encoder-{i}"], "encoder", token) for i in range(2)]
    for name, cfg in zip(("encoder-0", "encoder-1"), encs):
        argv = argvs[name]
        assert argv[argv.index("encoder") - 1:argv.index("encoder")] == ["pdserve"]  # `... -m pdserve encoder`
        assert cfg.role == "encoder" and (cfg.engine.model, cfg.engine.dtype, cfg.engine.device) == ("/m", "float32",
                                                                                                    "cpu")
        assert cfg.engine.image_transfer_tokens == 4096 and cfg.images.max_images_per_request == 3
        assert cfg.engine.image_cache_mb == 32 and cfg.log_level == "debug"  # --encoder-args last: they win
        assert cfg.pd.transfer_backend == "fake" and cfg.pd.progress_thread is False and cfg.engine.threads == 1
        assert cfg.internal_token == "t"
        for flag in ("--max-total-tokens", "--schedule-policy", "--speculative", "--max-running-requests", "--tp"):
            assert flag not in argv, flag  # KV/scheduling flags (and --worker-args) are the prefills' and decodes'
    for name in ("prefill-0", "decode-0"):  # --worker-args and --encoder-args stay where they belong
        assert "--max-running-requests" in argvs[name] and "--log-level" not in argvs[name]
    # each encoder: its own port and bootstrap port, registered with the router under them
    router = argvs["router"]
    registered = [router[i + 1] for i, w in enumerate(router) if w == "--encoder"]
    ports = {(encs[i].port, encs[i].pd.bootstrap_port) for i in range(2)}
    assert sorted(registered) == sorted(f"http://127.0.0.1:{p},bootstrap_port={b}" for p, b in ports)
    assert len({p for pair in ports for p in pair}) == 4
    assert router.count("--prefill") == 1 and router.count("--decode") == 1


def test_up_counts_encoders_in_the_cpu_division(monkeypatch):
    monkeypatch.setattr(up, "threads_per_worker", lambda ranks: 100 + ranks)
    argvs = _argvs(monkeypatch, ["--device", "cpu", "--prefill", "2", "--decode-tp", "2", "--encoder", "3"])
    for name in ("prefill-0", "decode-0", "encoder-2"):
        argv = argvs[name]
        assert argv[argv.index("--threads") + 1] == str(100 + 2 + 2 + 3), name
    # --threads in --encoder-args is the encoders' own; the division still goes to the others
    argvs = _argvs(monkeypatch, ["--device", "cpu", "--encoder", "1", "--encoder-args=--threads=5"])
    assert argvs["encoder-0"].count("--threads=5") == 1 and "--threads" not in argvs["encoder-0"]
    assert argvs["prefill-0"][argvs["prefill-0"].index("--threads") + 1] == str(100 + 3)


def test_up_starts_no_encoder_by_default_and_refuses_a_negative_count(monkeypatch):
    argvs = _argvs(monkeypatch, ["--device", "cpu"])
    assert not any(n.startswith("encoder") for n in argvs) and "--encoder" not in argvs["router"]
    with pytest.raises(ValueError, match="--encoder"):
        up.config_from_args(up.build_parser().parse_args(["--encoder", "-1"]))
