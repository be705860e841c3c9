"""Acceptance of proposed tokens against the target's verify logits (one request at a time).

The verify forward gave fp32 logits rows [K+1, V]: row j scores the token after position kv_len + j
(the request's last token, then drafts d0..d_{K-1}). Tokens are emitted in order, exactly as
non-speculative decoding would emit them, each checked against the stop conditions:

- greedy, and the n-gram method at any temperature: the target samples position j itself (its
  processors, temperature, top-k/p, min-p and position-keyed seed: engine.sampling.sampler) and d_j is
  accepted when the sample equals it. For a point-mass proposal q = 1{x} this IS the standard rule
  (accept x with probability p(x), else draw from p without x, renormalised), and with a seed the
  text is the same as without speculation.
- the draft method when sampling: the standard rule (Leviathan et al., Chen et al. 2023) on the
  target's processed distribution p and the draft's q: accept d_j with probability
  min(1, p(d_j) / q(d_j)), else emit a draw from normalise(max(0, p - q)) and stop.
After K accepted drafts the target's row K gives a bonus token. The first rejected (or stopping)
position ends the run; `accepted` counts the drafts kept.
"""

from __future__ import annotations

import torch

from engine.request import Req
from engine.sampling.logprobs import token_logprobs
from engine.sampling.sampler import Sampler, draw_seed, generated
from engine.sampling.stops import StopChecker

_DRAFT_SALT = 0x5DEECE66D  # keeps the acceptance draws apart from the sampler's own


def rejection_step(p: torch.Tensor, q: torch.Tensor, x: int, gen: torch.Generator) -> tuple[int, bool]:
    """One position of the standard rule. p, q: fp32 [V] probabilities (target, draft); x was drawn
    from q. Returns (token, accepted): x with probability min(1, p(x)/q(x)), else a draw from
    normalise(max(0, p - q)) (which never gives x)."""
    px, qx = float(p[x]), float(q[x])
    u = float(torch.rand((), generator=gen))
    if qx > 0.0 and u * qx < px:
        return x, True
    resid = torch.clamp(p - q, min=0.0)
    total = float(resid.sum())
    if total <= 0.0:  # p == q up to rounding: acceptance was certain; numeric guard
        resid, total = p, float(p.sum())
    return int(torch.multinomial(resid / total, 1, generator=gen)), False


def verify(r: Req, rows: torch.Tensor, sampler: Sampler, stops: StopChecker) -> int:
    """Emit r's tokens for this step from its verify rows (fp32 [len(draft)+1, V]); advance
    kv.kv_len by the positions whose KV is now valid; set r.spec.accepted. Returns tokens emitted."""
    draft, q = r.spec.draft, r.spec.draft_probs
    sp = r.sampling
    fast = rows.argmax(dim=-1).tolist() if sp.greedy and not sp.has_processors else None
    emitted: list[int] = []
    accepted = 0
    for j in range(len(draft) + 1):
        if fast is not None:
            tok = fast[j]
        elif q is not None and not sp.greedy and j < len(draft):
            gen = torch.Generator().manual_seed(
                draw_seed(sp, r.rid, sampler.default_seed, len(generated(r))) ^ _DRAFT_SALT)
            tok, _ = rejection_step(sampler.probs(rows[j], r), q[j], draft[j], gen)
        else:
            tok = sampler.sample(rows[j : j + 1], [r])[0]
        r.append_token(tok)
        emitted.append(tok)
        stops.check(r)
        ok = j < len(draft) and tok == draft[j]
        accepted += ok
        if r.finished or not ok:
            break
    r.kv.kv_len += len(emitted)  # the last token and the accepted drafts now have valid KV
    r.spec.accepted = accepted
    if r.logprobs.on:
        _logprobs(r, rows[: len(emitted)], emitted)
    return len(emitted)


def _logprobs(r: Req, rows: torch.Tensor, tokens: list[int]) -> None:
    """The emitted tokens' logprobs (and top alternatives), as engine.forward.batch records a decode's."""
    lp = r.logprobs
    lps, tops = token_logprobs(rows, tokens, lp.top_k)
    lp.output.extend(lps)
    if lp.top_k:
        lp.output_top.extend((t[0][: lp.top_k], t[1][: lp.top_k]) for t in tops)
