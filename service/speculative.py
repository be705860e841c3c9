"""The speculative-decoding flags of every service (engine/extras/speculative; docs/architecture.md,
"Speculative decoding"). A prefill takes them too: they are part of the PD compatibility record, so a
prefill and a decode that disagree are refused with a 412 naming the field."""

from __future__ import annotations

import argparse

from common.configs import build
from engine.extras.speculative.config import SpecConfig


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    d = SpecConfig()
    g = p.add_argument_group(
        "speculative decoding",
        "decode steps verify K proposed tokens in one forward of K+1 positions over the cached KV; the "
        "output is the same as without (greedy: identical; sampling: the target's distribution). Runs on "
        "colocated and PD decodes; structured-output requests decode without it")
    g.add_argument("--speculative", default=d.speculative, choices=("ngram", "draft"),
                   help="ngram: propose the tokens that followed the latest earlier match of the last n tokens "
                        "in the request's own prompt and output (no extra model); draft: a smaller model with "
                        "the same vocabulary (--draft-model) proposes them (default: off)")
    g.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="K, tokens proposed per step (1..16)")
    g.add_argument("--ngram-min", type=int, default=d.ngram_min, help="ngram: shortest suffix matched")
    g.add_argument("--ngram-max", type=int, default=d.ngram_max, help="ngram: longest suffix matched (tried first)")
    g.add_argument("--draft-model", default=d.draft_model,
                   help="draft: HF model directory of the draft model (same tokenizer and vocabulary); it keeps "
                        "its own KV pool, as many tokens as --max-total-tokens, and on a PD decode computes "
                        "each prompt's draft KV locally")
    g.add_argument("--speculative-min-acceptance", type=float, default=d.speculative_min_acceptance,
                   help="switch-off: a request whose recent share of accepted drafts falls below this stops "
                        "speculating for 4, then 8 .. 64 steps, then tries again (0: never)")
    g.add_argument("--speculative-max-batch", type=int, default=d.speculative_max_batch,
                   help="switch-off: with more than this many requests decoding, a step is compute-bound and "
                        "nobody speculates")


def spec_config(ns: argparse.Namespace) -> SpecConfig:
    """The SpecConfig of the parsed flags (by name); ValueError naming the flag."""
    return build(SpecConfig, ns, speculative=getattr(ns, "speculative", None) or "")
