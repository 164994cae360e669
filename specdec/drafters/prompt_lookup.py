"""Prompt lookup: find the context's last n tokens earlier in the context, propose what followed."""

from __future__ import annotations

from array import array
from typing import Sequence

import torch

from specdec.drafters.base import ContextDrafter, empty_draft
from specdec.errors import SpecDecError
from specdec.types import Draft, SamplingParams


def lookup_continuation(context: Sequence[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Longest suffix n-gram (max_ngram down to min_ngram) found earlier in the context: what
    followed its latest occurrence that is followed by max_tokens tokens, else by the most.

    Returns up to max_tokens tokens; [] when nothing matches. (The latest occurrence alone would
    cut a repeating pattern short: in "a b a b a b" it is followed by one token only.) The search
    runs in C over the ids packed 4 bytes each, so a long context costs microseconds, not a Python
    loop over every position.
    """
    length = len(context)
    packed = array("I", context).tobytes()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = packed[4 * (length - n) :]
        best: list[int] = []
        end = 4 * (length - 1)  # a match ends by the last token: never the suffix itself
        while (at := packed.rfind(suffix, 0, end)) >= 0:  # latest match first
            end = at + len(suffix) - 1  # the next search: matches starting further left
            if at % 4:
                continue  # bytes of two neighbouring ids, not ids
            follow = context[at // 4 + n : at // 4 + n + max_tokens]
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
