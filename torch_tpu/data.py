"""The shipped text corpus, a character-level tokenizer and a batch sampler."""

from __future__ import annotations

import os
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ["CORPUS_PATH", "load_corpus", "CharTokenizer", "batches"]

CORPUS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "corpus.txt")


def load_corpus(path: Optional[str] = None) -> str:
    """Returns the text of ``data/corpus.txt`` (or of ``path``)."""
    path = path or CORPUS_PATH
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found; regenerate it with `python scripts/make_corpus.py`")
    with open(path, encoding="utf-8") as f:
        return f.read()


class CharTokenizer:
    """Maps each distinct character of a text to an id (sorted, so the
    vocabulary depends only on the set of characters)."""

    def __init__(self, text: str):
        self.chars: List[str] = sorted(set(text))
        self.stoi: Dict[str, int] = {c: i for i, c in enumerate(self.chars)}
        self.itos: Dict[int, str] = dict(enumerate(self.chars))

    @classmethod
    def from_corpus(cls, path: Optional[str] = None) -> "CharTokenizer":
        return cls(load_corpus(path))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> List[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.itos[int(i)] for i in ids)

    def encode_tensor(self, text: str) -> torch.Tensor:
        return torch.tensor(self.encode(text), dtype=torch.long)


def batches(
    tokens: torch.Tensor,
    block_size: int,
    batch_size: int,
    generator: Optional[torch.Generator] = None,
    steps: Optional[int] = None,
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Yields (x, y) pairs of CPU LongTensors of shape (batch_size, block_size),
    y being x shifted by one token, from random offsets drawn with ``generator``
    (a CPU generator). Infinite unless ``steps`` is given."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
    n = tokens.numel() - block_size - 1
    if n < 1:
        raise ValueError(f"{tokens.numel()} tokens are too few for block_size {block_size}")
    offsets = torch.arange(block_size + 1)
    i = 0
    while steps is None or i < steps:
        starts = torch.randint(0, n + 1, (batch_size,), generator=generator)
        chunk = tokens[starts[:, None] + offsets]
        yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        i += 1
