"""N-gram proposals (prompt lookup): the tokens that followed the latest earlier occurrence of the
request's last n tokens in its own prompt and output, n from ngram_max down to ngram_min. No model:
a proposal costs a scan of the request's token list (numpy, O(len * n))."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: Sequence[int], k: int, nmin: int, nmax: int) -> list[int]:
    """Up to `k` tokens: those after the latest earlier match of the longest suffix of `tokens` (of
    nmax .. nmin tokens) that occurs earlier with at least one token after it; [] when none does."""
    n_tok = len(tokens)
    if k <= 0 or n_tok <= nmin:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    head = arr[: n_tok - 1]  # a match must end before the last token, so something follows it
    for n in range(min(nmax, n_tok - 1), nmin - 1, -1):
        suffix = arr[n_tok - n :]
        windows = sliding_window_view(head, n)  # [n_tok - n, n]: windows starting at 0 .. n_tok-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []
