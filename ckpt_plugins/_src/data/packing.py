"""Sequence packing: documents concatenated into rows of a fixed number of tokens, across document
boundaries. The tokens of documents already taken from the loader but not yet packed into a row
are the rank's pending items: `DataState` saves them and hands them out again on load."""
from __future__ import annotations

from typing import Iterable

import torch


class TokenPacker:
    """Packs 1-D token tensors into batches of `rows` x `seq_len` tokens, greedily."""

    def __init__(self, seq_len: int, rows: int = 1, dtype: torch.dtype = torch.int64):
        if seq_len < 1 or rows < 1:
            raise ValueError(f"seq_len and rows must be positive, got {seq_len} and {rows}")
        self.seq_len, self.rows = seq_len, rows
        self.buffer = torch.empty(0, dtype=dtype)

    @property
    def batch_tokens(self) -> int:
        return self.seq_len * self.rows

    def add(self, documents: Iterable[torch.Tensor]) -> None:
        self.buffer = torch.cat([self.buffer, *(d.reshape(-1).to(self.buffer.dtype) for d in documents)])

    def ready(self) -> bool:
        return self.buffer.numel() >= self.batch_tokens

    def take(self) -> torch.Tensor:
        """The next [rows, seq_len] batch (call when `ready()`)."""
        out, self.buffer = self.buffer[:self.batch_tokens], self.buffer[self.batch_tokens:].clone()
        return out.view(self.rows, self.seq_len)

    def pending(self) -> torch.Tensor:
        """Tokens taken in but not packed yet, in order."""
        return self.buffer

    def restore(self, tokens: torch.Tensor) -> None:
        self.buffer = tokens.reshape(-1).to(self.buffer.dtype).clone()
