"""Configs built from parsed flags by name (common/configs.py): no field copied by hand, so a flag whose
dest is a field's name reaches the config, and the layered PDConfig -> TransferConfig keeps every value."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from common.configs import build, named_values
from service.config import PDConfig, add_server_args, server_config_from_args


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
