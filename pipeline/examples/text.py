"""The shipped text (Shakespeare's Coriolanus, public domain) and a tokenizer by character."""

from __future__ import annotations

from importlib import resources

import torch

__all__ = ["CharTokenizer", "load_text"]


def load_text() -> str:
    """The shipped public-domain text (pipeline/examples/data/shakespeare.txt; its README says
    where it comes from)."""
    return (resources.files("pipeline.examples") / "data" / "shakespeare.txt").read_text("utf-8")


class CharTokenizer:
    """One id per distinct character of a text, in sorted order."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._ids[c] for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())
