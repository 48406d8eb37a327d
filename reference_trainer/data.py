"""Training data: synthetic tokens with a fixed seed, or the small text shipped in ``text/``.

Every rank builds the same global batch for a step (cheap at these sizes) and
takes its own rows and sequence chunks, so any layout sees exactly the tokens
a single process would.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from .config import TrainConfig

TEXT = Path(__file__).resolve().parent / "text" / "tiny_corpus.txt"


@lru_cache(maxsize=1)
def _text_tokens() -> torch.Tensor:
    return torch.tensor(list(TEXT.read_bytes()), dtype=torch.long)


def _text_at_least(length: int) -> torch.Tensor:
    """The shipped text; where a row is as long as the text (the GPU configs' 4,097 tokens against its
    1,803), the text repeated end to end until a row can start anywhere in the first copy."""
    text = _text_tokens()
    return text if length < len(text) else text.repeat(length // len(text) + 2)


def global_batch(cfg: TrainConfig, step: int) -> torch.Tensor:
    """(global_batch, seq_len + 1) token ids for ``step``; inputs are [:, :-1], targets [:, 1:]."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    n, length = cfg.global_batch, cfg.seq_len + 1
    if cfg.data == "text":
        text = _text_at_least(length) % cfg.model.vocab_size
        starts = torch.randint(0, len(text) - length, (n,), generator=g)
        return torch.stack([text[s:s + length] for s in starts.tolist()])
    return torch.randint(0, cfg.model.vocab_size, (n, length), generator=g)


def shard_rows(tokens: torch.Tensor, chunks: int, dp: int, dp_index: int) -> torch.Tensor:
    """The rows of the global batch data rank ``dp_index`` trains on.

    The batch is cut into ``chunks`` (microbatches or accumulation steps), each
    chunk into ``dp`` parts; a rank takes its part of every chunk, in order.
    """
    n = tokens.shape[0]
    if n % (chunks * dp):
        raise ValueError(f"global batch {n} does not split into {chunks} chunks x {dp} data ranks")
    return tokens.view(chunks, dp, n // (chunks * dp), -1)[:, dp_index].reshape(n // dp, -1)
