"""The drafter protocol: propose new tokens after a committed context."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specdec.types import Draft, SamplingParams


class Drafter(Protocol):
    """Proposes up to `max_tokens` continuations of `context` (the whole committed sequence).

    Returns only new tokens and, for stochastic drafts, the exact distributions they were sampled
    from (after `sampling`'s transform). In greedy mode (sampling.greedy) drafts are deterministic.
    A drafter with a cache keeps it in step with `context` itself: the engine may have rejected
    any suffix of what was proposed last time.
    """

    name: str
    forwards: int  # model forwards spent since reset(); 0 for model-free drafters

    def reset(self) -> None:
        """A generation begins or has ended: forget (and give back) what the last one cached."""

    def propose(
        self, context: Sequence[int], max_tokens: int, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft: ...


def empty_draft() -> Draft:
    return Draft(tokens=torch.zeros(0, dtype=torch.long))
