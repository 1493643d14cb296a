"""pipeline.examples.text: the shipped text and its character tokenizer."""

from __future__ import annotations

import torch

from pipeline.examples.text import CharTokenizer, load_text


def test_the_shipped_text_and_its_tokenizer_round_trip() -> None:
    text = load_text()
    assert len(text) == 154_469 and text.startswith("First Citizen:")  # data/README.md
    tokenizer = CharTokenizer(text)
    assert tokenizer.vocab == len(set(text)) == 61
    ids = tokenizer.encode(text[:500])
    assert ids.dtype == torch.int64 and tokenizer.decode(ids) == text[:500]
