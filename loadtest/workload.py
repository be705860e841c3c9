"""Request specs for a bench run: synthetic prompts of exact token lengths, or a ShareGPT file.

Synthetic prompts are built from whole-word vocabulary tokens (`Ġword` in a ByteLevel BPE): each
" word" pre-tokenizes and encodes to exactly one token, so a prompt of n words is n tokens. The text is
re-encoded once to check; a tokenizer without such words falls back to decoded random token ids,
re-encoded and trimmed until the count matches.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from engine.models.embedded import resolve_model_path


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    prompt_len: int  # tokens, by the bench's tokenizer (no special tokens)
    output_len: int  # max_tokens, generated exactly with ignore_eos
    tag: str = ""
    # chat endpoint: the whole conversation so far ({"role", "content"} maps); None: one user message
    messages: tuple[dict, ...] | None = None


@dataclass(frozen=True)
class SyntheticConfig:
    num_requests: int
    input_len: int
    output_len: int
    input_len_std: float = 0.0  # normal distribution, truncated to [1, 2*input_len]
    output_len_std: float = 0.0
    seed: int = 0
    tag: str = ""

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if self.input_len_std < 0 or self.output_len_std < 0:
            raise ValueError("--input-len-std / --output-len-std must be >= 0")


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """tokenizer.json of an HF directory; None -> the embedded model (converted once if needed)."""
    if model_dir is None:
        model_dir = resolve_model_path("")
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"--tokenizer {model_dir}: no tokenizer.json there")
    return Tokenizer.from_file(str(path))


def count_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


class PromptMaker:
    """Builds texts of an exact token count from one tokenizer."""

    def __init__(self, tok: Tokenizer, rng: random.Random) -> None:
        self.tok = tok
        self.rng = rng
        vocab = tok.get_vocab()
        words = sorted(t[1:] for t in vocab if t.startswith("Ġ") and t[1:].isascii()
                       and t[1:].isalpha() and t[1:].islower() and len(t) >= 4)
        self.words = [w for w in words[:4000] if count_tokens(tok, " " + w) == 1]

    def make(self, n: int) -> str:
        if self.words:
            text = "".join(" " + self.rng.choice(self.words) for _ in range(n))
            if count_tokens(self.tok, text) == n:
                return text
        return self._from_ids(n)

    def _from_ids(self, n: int) -> str:
        vocab = self.tok.get_vocab_size(with_added_tokens=False)
        ids = [self.rng.randrange(vocab) for _ in range(n)]
        text = self.tok.decode(ids)
        for _ in range(20):
            got = self.tok.encode(text, add_special_tokens=False).ids
            if len(got) == n:
                return text
            if len(got) > n:
                got = got[:n]
            else:
                got = got + [self.rng.randrange(vocab) for _ in range(n - len(got))]
            text = self.tok.decode(got)
        raise ValueError(f"could not build a prompt of exactly {n} tokens with this tokenizer")


def _sample_len(rng: random.Random, mean: int, std: float) -> int:
    if std <= 0:
        return mean
    return int(min(max(round(rng.gauss(mean, std)), 1), 2 * mean))


def synthetic(cfg: SyntheticConfig, tok: Tokenizer) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    maker = PromptMaker(tok, rng)
    specs = []
    for _ in range(cfg.num_requests):
        n_in = _sample_len(rng, cfg.input_len, cfg.input_len_std)
        n_out = _sample_len(rng, cfg.output_len, cfg.output_len_std)
        specs.append(RequestSpec(maker.make(n_in), n_in, n_out, cfg.tag))
    return specs


def sharegpt(path: str | Path, tok: Tokenizer, num_requests: int, seed: int = 0,
             output_len: int | None = None, max_len: int = 4096) -> list[RequestSpec]:
    """First human turn -> prompt; first gpt turn's token count -> output length (or `output_len`).

    Pairs with a prompt or reply under 4 tokens, or prompt + reply over `max_len`, are skipped (they
    say little about serving). Raises ValueError on a file that is not ShareGPT-shaped.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset {path}: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"--dataset {path}: expected a JSON list of conversations")
    rng = random.Random(seed)
    order = list(range(len(data)))
    rng.shuffle(order)
    specs: list[RequestSpec] = []
    for i in order:
        conv = data[i].get("conversations") if isinstance(data[i], dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        human = next((c.get("value") for c in conv if c.get("from") == "human"), None)
        gpt = next((c.get("value") for c in conv if c.get("from") == "gpt"), None)
        if not isinstance(human, str) or not isinstance(gpt, str):
            continue
        n_in = count_tokens(tok, human)
        n_out = output_len or count_tokens(tok, gpt)
        if n_in < 4 or n_out < 4 or n_in + n_out > max_len:
            continue
        specs.append(RequestSpec(human, n_in, n_out))
        if len(specs) == num_requests:
            break
    if not specs:
        raise ValueError(f"--dataset {path}: no usable human/gpt pairs")
    return specs
