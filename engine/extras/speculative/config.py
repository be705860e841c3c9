"""SpecConfig: the speculative-decoding flags of one engine (frozen; built by name from the flags,
service/config.py). Validation raises ValueError naming the flag."""

from __future__ import annotations

from dataclasses import dataclass

from common.checks import need

METHODS = ("", "ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    speculative: str = ""  # "" (off) | ngram (prompt lookup) | draft (a smaller model proposes)
    num_speculative_tokens: int = 4  # K: tokens proposed per step; a verify runs K+1 positions
    ngram_min: int = 2  # ngram: shortest suffix matched against the request's own tokens
    ngram_max: int = 4  # ngram: longest suffix tried first
    draft_model: str = ""  # draft: HF model directory with the target's vocabulary
    speculative_min_acceptance: float = 0.3  # a request whose acceptance falls below this pauses
    speculative_max_batch: int = 8  # no request speculates while more than this many decode (compute-bound)

    def __post_init__(self) -> None:
        need(self.speculative in METHODS, f"--speculative must be ngram or draft, got {self.speculative!r}")
        need(1 <= self.num_speculative_tokens <= 16,
             f"--num-speculative-tokens must be in 1..16, got {self.num_speculative_tokens}")
        need(1 <= self.ngram_min <= self.ngram_max,
             f"--ngram-min ({self.ngram_min}) must be >= 1 and <= --ngram-max ({self.ngram_max})")
        need(self.speculative != "draft" or bool(self.draft_model),
             "--draft-model PATH is needed with --speculative draft")
        need(not self.draft_model or self.speculative == "draft",
             "--draft-model is only used with --speculative draft")
        need(0.0 <= self.speculative_min_acceptance <= 1.0,
             f"--speculative-min-acceptance must be in [0, 1], got {self.speculative_min_acceptance}")
        need(self.speculative_max_batch >= 1,
             f"--speculative-max-batch must be >= 1, got {self.speculative_max_batch}")

    @property
    def on(self) -> bool:
        return bool(self.speculative)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens


def spec_compat(cfg: SpecConfig | None) -> dict[str, str]:
    """The fields of the PD compatibility record (transfer.CompatInfo) that name this config: a
    prefill and a decode with different ones are refused with a 412 naming the field."""
    cfg = cfg or SpecConfig()
    name = cfg.draft_model.rstrip("/").rsplit("/", 1)[-1] if cfg.draft_model else ""
    return {"speculative": cfg.speculative, "draft_model": name}
