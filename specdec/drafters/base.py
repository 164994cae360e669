"""The drafter protocol: per-generation slots, batched proposals, told what was accepted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from specdec import tree
from specdec.types import Draft, SamplingParams


@dataclass
class DraftSlot:
    """A drafter's state for one generation. forwards: model forwards this generation has cost."""

    forwards: int = 0


@dataclass
class DraftRequest:
    """One row of a batched proposal: up to `max_tokens` deep after `context` (the whole committed text).
    policy: the row's draft policy, for drafters it shapes (`AutoDrafter`); chains: the request's own
    chain sources (a `Prediction`, a `HistoryView`: see `ChainSource`), for drafters that use them.
    noise: for a generation whose draws are keyed (`verify.verify_tree_coupled`), offset -> the
    noise the target's token that many places after the context will be drawn with (0: the root's
    children); its draft holds point masses only, a draft model's ranked by that noise
    (`sampling.ranked`), so they spell the target's draw about as often as the two models agree."""

    slot: DraftSlot
    context: Sequence[int]
    max_tokens: int
    sampling: SamplingParams
    rng: torch.Generator
    policy: object = None
    chains: tuple[ChainSource, ...] = ()
    noise: Callable[[int], torch.Tensor] | None = None

    @property
    def point_masses(self) -> bool:
        """Children are chosen, not drawn (greedy: the most likely tokens; keyed: by `noise`)."""
        return self.sampling.greedy or self.noise is not None


class ChainSource(Protocol):
    """A request's own source of point-mass chains (the text a client predicts, earlier requests'
    history), drafted by the default drafter beside prompt lookup. `kind` names it to the policy
    (`specdec.policy.CHAIN_PRIORS`) and in stats."""

    kind: str

    def proposal(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """Up to max_tokens ids to follow the context (prompt and output so far); [] for none."""
        ...

    def end(self, context: Sequence[int]) -> None:
        """The generation has finished with this context."""
        ...


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

    def propose(self, requests: list[DraftRequest]) -> list[Draft | Exception]:
        """One draft per request (rows of different slots), or the exception that row's own drafting
        raised (the other rows go on); model forwards are shared across rows, and a failed one raises."""
        ...

    def accept(self, slot: DraftSlot, tokens: list[int]) -> None:
        """`tokens` were committed after the slot's text (accepted draft tokens, then one more)."""
        ...

    def close(self, slot: DraftSlot) -> None:
        """The generation has ended: give back what the slot holds."""
        ...

    # A drafter with `reads_target_states = True` (a draft head) also has
    # observe(slot, position, state): the target's final-norm state [hidden] at `position` of the
    # committed text, the one whose logits drew the token at position + 1 (the engine turns on the
    # target's `keep_states` and reports the last such state after every prefill chunk and verify).


class ContextDrafter:
    """A drafter that reads only the committed text (n-gram, prompt lookup): nothing per slot.
    Subclasses implement `propose_one`."""

    name = "context"

    def open(self, prompt: Sequence[int]) -> DraftSlot:
        return DraftSlot()

    def prefill(self, slot: DraftSlot, budget: int | None = None) -> bool:
        return True

    def propose(self, requests: list[DraftRequest]) -> list[Draft | Exception]:
        return [attempt(lambda: self.propose_one(r.context, r.max_tokens, r.sampling, r.rng)) for r in requests]

    def propose_one(self, context: Sequence[int], max_tokens: int, sampling: SamplingParams, rng: torch.Generator) -> Draft:
        raise NotImplementedError

    def accept(self, slot: DraftSlot, tokens: list[int]) -> None:
        pass

    def close(self, slot: DraftSlot) -> None:
        pass


@dataclass
class DraftTree:
    """A draft being grown, by any drafter that grows trees (the draft model's, the default's).
    Node i has a token, a parent (-1: the root, the last committed token), the distribution it
    was drawn from (None: a point mass), its value, and the sources that proposed it. A value is
    a probability of the node's whole path (the draft model's, or the policy's estimate that it is
    accepted): a child's never exceeds its parent's, and the root's is 1."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    drawn_from: list[torch.Tensor | None] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    sources: list[list[tuple[str, int]]] = field(default_factory=list)
    branches: int = 0  # nodes that are not their parent's first child: each needs a branch (a llama.cpp sequence id)

    def add(self, token: int, parent: int, drawn_from: torch.Tensor | None, value: float, source: tuple[str, int] | None = None) -> int:
        self.branches += parent in self.parents
        self.tokens.append(token)
        self.parents.append(parent)
        self.drawn_from.append(drawn_from)
        self.values.append(value)
        self.sources.append([source] if source is not None else [])
        return len(self.tokens) - 1

    def value(self, node: int) -> float:
        return 1.0 if node < 0 else self.values[node]

    def child(self, parent: int, token: int) -> int | None:
        return tree.child(self.parents, self.tokens, parent, token)

    def child_tokens(self, parent: int) -> list[int]:
        return [t for t, p in zip(self.tokens, self.parents) if p == parent]

    def best(self, candidates: list[int], count: int) -> list[int]:
        """The `count` most valuable candidates; ties go to the lower index, so a parent (worth at
        least as much as its children) always comes before them: the best k of a tree are
        ancestor-closed."""
        return sorted(candidates, key=lambda i: (-self.values[i], i))[:count]

    def draft(self, keep: list[int] | None = None) -> Draft:
        """The tree as a Draft, restricted to `keep` (an ancestor-closed set) if given. Point-mass
        nodes beside drawn ones get one-hot rows: a point mass is a distribution too."""
        keep = sorted(range(len(self.tokens)) if keep is None else keep)
        renumber = {old: new for new, old in enumerate(keep)}
        tokens = torch.tensor([self.tokens[i] for i in keep], dtype=torch.long)
        parents = torch.tensor([renumber[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep], dtype=torch.long)
        drawn = [self.drawn_from[i] for i in keep if self.drawn_from[i] is not None]
        probs = None
        if drawn:
            probs = torch.zeros(len(keep), drawn[0].numel(), dtype=drawn[0].dtype)
            for row, i in enumerate(keep):
                if self.drawn_from[i] is None:
                    probs[row, self.tokens[i]] = 1.0
                else:
                    probs[row] = self.drawn_from[i]
        sources = [self.sources[i] for i in keep] if any(self.sources) else None
        return Draft(tokens, probs, parents, sources)


def attempt(work):
    """work(), or the exception it raised: a failure that belongs to one row of a batch."""
    try:
        return work()
    except Exception as error:
        return error


def empty_draft() -> Draft:
    return Draft(tokens=torch.zeros(0, dtype=torch.long))
