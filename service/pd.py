"""Pieces the prefill and decode workers share: the transfer manager of a worker, the KV
compatibility record (with the side's TP), whether a TP > 1 side stages its pages (`gathers_kv`,
`scatters_kv`), the worker-side admission of a PD request and the transfer metrics.

Services never import each other; both import this.
"""

from __future__ import annotations

import torch

from common.metrics import Histogram
from engine.distributed.tp import SINGLE, TPGroup
from engine.distributed.tp_state import gather_state, rank_specs, scatter_state, whole_spec
from engine.extras.speculative.config import spec_compat
from engine.forward.model_runner import ModelRunner
from engine.kvcache.kv_manager import KVManager
from engine.request import Req
from service import messages as m
from service.config import ServerConfig
from service.stats import Histo, TransferTotals
from service.worker import error_out, req_from_msg
from transfer import CompatInfo, TransferError, TransferManager

KV_LAYOUT = "page_major:[pages,layers,2,page_size,kv_heads,head_dim]"
MLA_LAYOUT = "page_major:[pages,layers,page_size,kv_lora_rank+rope_dim]"  # latent pages, replicated over TP
TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def compat_info(runner: ModelRunner) -> CompatInfo:
    """What this worker's wire page holds: the model's canonical page (all KV heads), and its TP."""
    mc = runner.model_cfg
    states = getattr(runner, "states", None)
    return CompatInfo(model=mc.model_type + f":{mc.num_layers}x{mc.hidden_size}:{mc.vocab_size}",
                      dtype=runner.cfg.dtype, kv_cache_dtype=_kv_cache_dtype(runner.cfg), page_size=runner.page_size,
                      num_layers=mc.num_kv_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                      window=mc.max_window, tp=_tp(runner).size, **spec_compat(getattr(runner.cfg, "spec", None)),
                      state_layout="" if states is None else _state_layout(runner),
                      **_layout(mc))


def _kv_cache_dtype(cfg: object) -> str:
    """What the KV pages store (CompatInfo.kv_cache_dtype): fp8_e4m3, or the model dtype (--kv-cache-dtype auto)."""
    kv = getattr(cfg, "kv_cache_dtype", "auto")
    return cfg.dtype if kv == "auto" else kv  # type: ignore[attr-defined]


IMAGE_LAYOUT = "image_rows:[pages,1+deepstack,page_size,hidden]"


def image_compat(mc: object, dtype: str, page_rows: int) -> CompatInfo:
    """What an encoder -> prefill room's wire page holds: `page_rows` image-embedding rows of the model's hidden
    size, for the tower's output and each deepstack set (engine.extras.multimodal.RowPool)."""
    layers = 1 + mc.deepstack_layers  # type: ignore[attr-defined]
    return CompatInfo(model=f"{mc.model_type}:vision:{mc.hidden_size}", dtype=dtype,  # type: ignore[attr-defined]
                      page_size=page_rows, kv_layout=IMAGE_LAYOUT, num_layers=layers, num_kv_heads=1,
                      head_dim=mc.hidden_size, image_rows=mc.hidden_size)  # type: ignore[attr-defined]


class StateWire:
    """How a hybrid model's recurrent state rides the KV transfer: the prompt's final state follows its
    last KV page as `pages` extra wire pages in the same room, in the TP-independent layout (every part
    whole: a TP 1 slot, `whole_bytes`; engine/distributed/tp_state.py), so any prefill TP serves any
    decode TP. The prefill gathers it from its ranks and appends it to its last chunk (`with_state`); the
    decode reserves that many landing pages of its own pool after the prompt's, and once the room
    succeeds (`land`) every rank's slot takes its rows of it and the pages are zeroed and freed. A TP > 1 decode
    receives into staging: `keep` takes the landing pages' rows out of what landed (they are not KV
    heads to scatter) until `land` or `drop`. The transfer layer sees pages only."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.states = getattr(runner, "states", None)
        self.pages = 0
        if self.states is None:
            return
        rank_specs(runner)  # every row of the state is some rank's (else a ValueError at start-up)
        self.whole_bytes = whole_spec(runner).layout()[1]
        self.page_bytes = compat_info(runner).page_bytes  # the wire page: all KV heads (a TP > 1 rank 0 holds fewer)
        self.page_view = runner.pool.buffer.view(runner.pool.buffer.shape[0], -1).view(torch.uint8)
        self.pages = -(-self.whole_bytes // self.page_bytes)
        self.staged = scatters_kv(runner)  # a TP > 1 decode receives into staging, not into its pool
        self._rx: dict[int, torch.Tensor] = {}  # staged decode: landing page -> its wire row (uint8 [page_bytes])

    def with_state(self, r: Req, pages: list[int], data: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
        """The last chunk's source pages and wire rows (uint8 [n, page_bytes]; None: the pool's own pages,
        TP 1) with r's whole state appended as `pages` rows (unchanged without a state)."""
        if not self.pages:
            return pages, data
        rows = self.page_view.new_zeros(self.pages, self.page_bytes)  # [pages, wire page_bytes]
        rows.view(-1)[: self.whole_bytes] = gather_state(self.runner, r.kv.state_slot).to(rows.device)
        if data is None and pages:  # TP 1: the pool's pages are wire pages
            data = self.page_view[torch.tensor(pages, dtype=torch.long, device=self.page_view.device)]
        head = data.to(rows.device) if data is not None else rows[:0]
        return pages + [0] * self.pages, torch.cat([head, rows])

    def keep(self, landing: list[int] | None, pages: list[int], data: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """A staged decode's landed message (dst pages, uint8 [n, page_bytes]): the rows of the room's
        `landing` pages are kept for `land`; returns the rest (KV pages to scatter to the ranks)."""
        if not landing or not self.pages:
            return pages, data
        mine = set(landing)
        rest = [i for i, p in enumerate(pages) if p not in mine]
        for i, p in enumerate(pages):
            if p in mine:
                self._rx[p] = data[i].clone()
        idx = torch.tensor(rest, dtype=torch.long, device=data.device)
        return [pages[i] for i in rest], data.index_select(0, idx)

    def land(self, r: Req, landing: list[int]) -> None:
        """The room succeeded: every rank's slot r.kv.state_slot takes its rows of the whole state in the
        landing pages (the pool's, or kept from staging); the caller frees the pages."""
        if self.staged:
            if not all(p in self._rx for p in landing):
                raise ValueError(f"rid {r.rid}: the state's landing pages {landing} never landed")
            flat = torch.cat([self._rx.pop(p) for p in landing])
        else:
            idx = torch.tensor(landing, dtype=torch.long, device=self.page_view.device)
            flat = self.page_view[idx].reshape(-1)  # a copy (advanced indexing): the pages can be scrubbed
            # the state's bytes read as KV would be arbitrary codes (an FP8 row's scale, a bf16 NaN): a page
            # reused for KV must hold zeros in the slots its request has not written yet, as a fresh pool does
            self.page_view[idx] = 0
        scatter_state(self.runner, r.kv.state_slot, flat[: self.whole_bytes])

    def drop(self, landing: list[int]) -> None:
        """A room ended without landing: forget what was kept of its landing pages."""
        for p in landing:
            self._rx.pop(p, None)


def _state_layout(runner: ModelRunner) -> str:
    """The wire's state layout (every part whole, whatever this side's TP): its bytes and parts."""
    whole = whole_spec(runner)
    return f"whole:{whole.layout()[1]}B:{whole.describe()}"


def _layout(mc: object) -> dict:
    """The wire page's layout fields: K/V pages, or MLA latent pages with their geometry."""
    mla = getattr(mc, "mla", None)
    if mla is None:
        return {"kv_layout": KV_LAYOUT}
    return {"kv_layout": MLA_LAYOUT, "kv_lora_rank": mla.kv_lora_rank, "qk_rope_head_dim": mla.qk_rope_head_dim}


def _tp(runner: ModelRunner) -> TPGroup:
    return getattr(runner, "tp", SINGLE)  # a test's stand-in runner may have no group


def gathers_kv(runner: ModelRunner) -> bool:
    """Prefill: rank 0's pool lacks some KV heads (TP > 1), so each chunk's pages are gathered from the
    ranks into full wire pages (engine.distributed.tp_kv.gather) and sent from there. Never for MLA: every rank holds
    the same latent, rank 0 sends its own pages."""
    if runner.pool.buffer.dim() == 4:  # a latent pool (MLA)
        return False
    return runner.pool.buffer.shape[4] != runner.model_cfg.num_kv_heads


def scatters_kv(runner: ModelRunner) -> bool:
    """Decode: other ranks hold KV heads too (TP > 1), so a room's pages land in buffers of full pages
    (a staged receiver) and are scattered to every rank (engine.distributed.tp_kv.scatter) as they land, before
    the request joins the batch."""
    return _tp(runner).size > 1


def make_transfer_manager(cfg: ServerConfig, runner: ModelRunner, role: str) -> TransferManager:
    """The worker's TransferManager over its KV pool, configured from cfg.pd by name (PDConfig.transfer_config)."""
    return TransferManager(cfg.pd.transfer_config(role), runner.pool.buffer, compat_info(runner))


def pd_request(msg: m.GenerateReq, kv: KVManager, role: str, chunk: int) -> Req | m.TokenOut:
    """The request, or the 400 that answers it when the prompt can never fit this worker's KV pool
    computed in chunks of `chunk` tokens (the decode receives it whole: 1): the one check only the
    worker can make (the frontend validated the rest)."""
    err = kv.capacity_error(len(msg.input_ids), chunk)
    return error_out(msg.rid, err, 400) if err else req_from_msg(msg, role)


def transfer_error(err: TransferError | None, role: str) -> tuple[str, int, str]:
    """(message, status, fault) of a failed room on a `role` worker; fault names the peer role when
    the peer caused the failure (the router blames that worker), else ""."""
    if err is None:
        return "KV transfer failed", 500, ""
    fault = ("decode" if role == "prefill" else "prefill") if err.peer_fault else ""
    if err.retry_after:  # the decode refused the room as overloaded: its words, as it answers them itself
        return err.message.partition(": ")[2], int(err.code), fault
    return f"KV transfer failed: {err.message}", int(err.code), fault


class TransferStats:
    """Bytes, rooms and latency of this worker's KV transfers; `totals()` is their typed report."""

    def __init__(self) -> None:
        self.bytes = 0
        self.succeeded = 0
        self.failed = 0
        self.seconds = Histogram("transfer_seconds", "room ready to transfer done", buckets=TRANSFER_BUCKETS,
                                 registry=None)  # shipped to the frontend in StatsOut.info, not exposed here
        self.tail = Histogram("transfer_tail_seconds", "prefill: last chunk sent to the decode's SUCCESS",
                              buckets=TRANSFER_BUCKETS, registry=None)

    def success(self, nbytes: int, seconds: float, tail_s: float | None = None) -> None:
        self.bytes += nbytes
        self.succeeded += 1
        self.seconds.observe(seconds)
        if tail_s is not None:
            self.tail.observe(tail_s)

    def totals(self, reused_bytes: int | None = None) -> TransferTotals:
        """The typed report (service.stats); on /metrics: pdserve_worker_transfer_bytes_total,
        pdserve_worker_transfer_rooms_total{name=...}, histograms pdserve_worker_transfer_seconds and
        pdserve_worker_transfer_tail_seconds. `reused_bytes`: a decode's KV its prefix cache held."""
        return TransferTotals(bytes=self.bytes, rooms_succeeded=self.succeeded, rooms_failed=self.failed,
                              seconds=Histo.of(self.seconds), tail_seconds=Histo.of(self.tail),
                              reused_bytes=reused_bytes)
