"""TransferManager.stats(): the typed state of one worker's KV transfer link.

Role-specific fields are None on the other role (a prefill has senders, a decode receivers).
Levels describe this instant; totals only grow while the process lives. service/metrics.py exports
the levels as `pdserve_worker_transfer{name=...}` and each total as a `_total` counter.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LinkStats:
    draining: int = 0  # level: transfers of released rooms still completing
    peers: int = 0  # level: connected peer workers
    backend_sinks: int = 0  # level: data-backend receive buffers not yet drained
    senders: int | None = None  # prefill, level: rooms sending
    early_infos: int | None = None  # prefill, level: decode infos that came before their room
    pending_sends: int | None = None  # prefill, level: chunk sends in flight
    receivers: int | None = None  # decode, level: rooms receiving
    pending_recvs: int | None = None  # decode, level: chunk receives in flight
    staging_bytes: int | None = None  # decode, level: bytes held in staging buffers
    background_passes: int = 0  # total: progress-thread passes during forwards
    prefix_refusals: int | None = None  # prefill, total: decode prefix offers refused
    kept_queued: int | None = None  # prefill, total: rooms kept past the bootstrap timeout, queued at their decode
    control_dropped: dict[str, int] = field(default_factory=dict)  # totals by reason (transfer.control.Dropped)

    LEVELS = ("senders", "early_infos", "pending_sends", "receivers", "pending_recvs", "staging_bytes",
              "draining", "peers", "backend_sinks")

    def levels(self) -> dict[str, int]:
        """The levels this role has, by name (the `name` label of pdserve_worker_transfer)."""
        return {k: v for k in self.LEVELS if (v := getattr(self, k)) is not None}

    def to_info(self) -> dict[str, int | dict[str, int]]:
        """The dict /server_info has always shown under `transfer` (None fields left out)."""
        out: dict[str, int | dict[str, int]] = dict(self.levels())
        if self.prefix_refusals is not None:
            out["prefix_refusals"] = self.prefix_refusals
        out["background_passes"] = self.background_passes
        out["control_dropped"] = dict(self.control_dropped)
        return out
