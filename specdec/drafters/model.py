"""A smaller checkpoint sharing the target's tokenizer drafts autoregressively."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.drafters.base import empty_draft
from specdec.runtime import CausalLM
from specdec.sampling import probs_from_logits, sample
from specdec.types import Draft, SamplingParams


class ModelDrafter:
    name = "draft-model"

    def __init__(self, model: CausalLM):
        self.model = model
        self.forwards = 0
        self._cached: list[int] = []  # the token behind each cache entry, in order

    def reset(self) -> None:
        self.model.reset()
        self._cached = []
        self.forwards = 0

    def propose(
        self, context: Sequence[int], max_tokens: int, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        max_tokens = min(max_tokens, self.model.max_length - len(context))
        if max_tokens <= 0:
            return empty_draft()
        pending = self.sync(context)
        tokens, probs = [], []
        for _ in range(max_tokens):
            logits = self.model.forward(pending)[-1]  # [vocab]
            self.forwards += 1
            self._cached += pending
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                probs.append(probs_from_logits(logits, sampling))
                token = sample(probs[-1], rng)
            tokens.append(token)
            pending = [token]
        # The last draft token is not in the cache yet; the next sync feeds it if it was accepted.
        return Draft(tokens=torch.tensor(tokens), probs=torch.stack(probs) if probs else None)

    def sync(self, context: Sequence[int]) -> list[int]:
        """Cut the cache back to its longest prefix shared with context[:-1]; return what to feed next.

        Invariant afterwards: the cache holds context[:len(cached)] and at least the last context
        token is pending, so the next forward yields the distribution after the whole context.
        """
        shared = 0
        limit = min(len(self._cached), len(context) - 1)
        while shared < limit and self._cached[shared] == context[shared]:
            shared += 1
        if shared < len(self._cached):
            self.model.truncate(shared)
            del self._cached[shared:]
        return list(context[shared:])
