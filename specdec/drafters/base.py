"""The drafter protocol: per-generation slots, batched proposals, told what was accepted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from specdec.types import Draft, SamplingParams


@dataclass
class DraftSlot:
    """A drafter's state for one generation. forwards: model forwards this generation has cost."""

    forwards: int = 0


@dataclass
class DraftRequest:
    """One row of a batched proposal: up to `max_tokens` deep after `context` (the whole committed text).
    policy: the row's draft policy, for drafters it shapes (`AutoDrafter`); prediction: the text the
    client expects (a `Prediction`), for drafters that use one."""

    slot: DraftSlot
    context: Sequence[int]
    max_tokens: int
    sampling: SamplingParams
    rng: torch.Generator
    policy: object = None
    prediction: object = None


class Drafter(Protocol):
    """Proposes continuations for many generations at once.

    Returns only new tokens and, for stochastic drafts, the exact distributions they were sampled
    from (after the row's sampling transform); in greedy mode drafts are deterministic. After every
    iteration the engine tells the drafter which tokens were committed (`accept`): any suffix of a
    proposal may have been rejected. A drafter keeps whatever it caches in the slot.
    """

    name: str

    def open(self, prompt: Sequence[int]) -> DraftSlot:
        """A generation begins with `prompt` (no model work yet: see `prefill`)."""
        ...

    def prefill(self, slot: DraftSlot, budget: int | None = None) -> bool:
        """Take in up to `budget` more tokens of the prompt (None: all); True when it is all in."""
        ...

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One draft per request (rows of different slots); model forwards are shared across rows."""
        ...

    def accept(self, slot: DraftSlot, tokens: list[int]) -> None:
        """`tokens` were committed after the slot's text (accepted draft tokens, then one more)."""
        ...

    def close(self, slot: DraftSlot) -> None:
        """The generation has ended: give back what the slot holds."""
        ...


class ContextDrafter:
    """A drafter that reads only the committed text (n-gram, prompt lookup): nothing per slot.
    Subclasses implement `propose_one`."""

    name = "context"

    def open(self, prompt: Sequence[int]) -> DraftSlot:
        return DraftSlot()

    def prefill(self, slot: DraftSlot, budget: int | None = None) -> bool:
        return True

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self.propose_one(r.context, r.max_tokens, r.sampling, r.rng) for r in requests]

    def propose_one(self, context: Sequence[int], max_tokens: int, sampling: SamplingParams, rng: torch.Generator) -> Draft:
        raise NotImplementedError

    def accept(self, slot: DraftSlot, tokens: list[int]) -> None:
        pass

    def close(self, slot: DraftSlot) -> None:
        pass


def empty_draft() -> Draft:
    return Draft(tokens=torch.zeros(0, dtype=torch.long))
