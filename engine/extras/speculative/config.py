"""SpecConfig: the speculative-decoding flags of one engine (frozen; each field declares its flag, the
parsers are generated from them and the config built by name, service/config.py). Validation raises
ValueError naming the flag."""

from __future__ import annotations

from dataclasses import dataclass

from common.checks import need
from common.configs import Group, option

METHODS = ("", "ngram", "draft")


SPEC = Group("speculative decoding",
             "decode steps verify K proposed tokens in one forward of K+1 positions over the cached KV; the output "
             "is the same as without (greedy: identical; sampling: the target's distribution). Runs on colocated "
             "and PD decodes; structured-output requests decode without it")


@dataclass(frozen=True)
class SpecConfig:
    """Each field declares its flag (common.configs.option). A prefill takes them too: they are part of the PD
    compatibility record, so a prefill and a decode that disagree are refused with a 412 naming the field."""

    speculative: str = option(
        "", "ngram: propose the tokens that followed the latest earlier match of the last n tokens in the request's "
        "own prompt and output (no extra model); draft: a smaller model with the same vocabulary (--draft-model) "
        "proposes them (default: off)", group=SPEC, choices=METHODS[1:])
    num_speculative_tokens: int = option(4, "K, tokens proposed per step (1..16)", group=SPEC)  # a verify: K+1
    ngram_min: int = option(2, "ngram: shortest suffix matched", group=SPEC)  # against the request's own tokens
    ngram_max: int = option(4, "ngram: longest suffix matched (tried first)", group=SPEC)
    draft_model: str = option(
        "", "draft: HF model directory of the draft model (same tokenizer and vocabulary); it keeps its own KV pool, "
        "as many tokens as --max-total-tokens, and on a PD decode computes each prompt's draft KV locally",
        group=SPEC)
    speculative_min_acceptance: float = option(
        0.3, "switch-off: a request whose recent share of accepted drafts falls below this stops speculating for 4, "
        "then 8 .. 64 steps, then tries again (0: never)", group=SPEC)
    speculative_max_batch: int = option(
        8, "switch-off: with more than this many requests decoding, a step is compute-bound and nobody speculates",
        group=SPEC)

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
