"""Prompt lookup: find the context's last n tokens earlier in the context, propose what followed."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.drafters.base import ContextDrafter, empty_draft
from specdec.errors import SpecDecError
from specdec.types import Draft, SamplingParams


def lookup_continuation(context: Sequence[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Longest suffix n-gram (max_ngram down to min_ngram) found earlier in the context: what
    followed its latest occurrence that is followed by max_tokens tokens, else by the most.

    Returns up to max_tokens tokens; [] when nothing matches. (The latest occurrence alone would
    cut a repeating pattern short: in "a b a b a b" it is followed by one token only.)
    """
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n :])
        best: list[int] = []
        for start in range(length - n - 1, -1, -1):  # latest match first; never the suffix itself
            if list(context[start : start + n]) == suffix:
                follow = context[start + n : start + n + max_tokens]
                if len(follow) > len(best):
                    best = list(follow)
                if len(best) >= max_tokens:
                    break
        if best:
            return best
    return []


class PromptLookupDrafter(ContextDrafter):
    """Point-mass drafts: the verifier accepts each with the target's own probability of it."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecDecError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose_one(
        self, context: Sequence[int], max_tokens: int, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        tokens = lookup_continuation(context, max_tokens, self.max_ngram, self.min_ngram)
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long)) if tokens else empty_draft()
