"""Drafters with scripted behaviour, for forcing rejections where a test wants them."""

from __future__ import annotations

import torch

from specdec.drafters.base import ContextDrafter
from specdec.types import Draft


class ScriptedDrafter(ContextDrafter):
    """Proposes the known greedy continuation, except a wrong token at chosen absolute positions.

    `expected` is prompt + reference continuation; a draft token at sequence position i in
    `wrong_at` is replaced by another token, so the verifier must reject exactly there.
    """

    name = "scripted"

    def __init__(self, expected: list[int], wrong_at: set[int], vocab_size: int):
        self.expected, self.wrong_at, self.vocab_size = expected, wrong_at, vocab_size

    def propose_one(self, context, max_tokens, sampling, rng) -> Draft:
        start = len(context)
        assert list(context) == self.expected[:start], "the engine committed something the reference did not"
        tokens = []
        for i in range(start, min(start + max_tokens, len(self.expected))):
            token = self.expected[i]
            tokens.append((token + 1) % self.vocab_size if i in self.wrong_at else token)
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long))
