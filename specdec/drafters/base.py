"""The drafter protocol: per-generation slots, batched proposals, told what was accepted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from specdec import tree
from specdec.config import TreeShape
from specdec.costs import LiveCosts
from specdec.policy import NodePolicy
from specdec.runtime import CausalLM
from specdec.types import Draft
from specdec.params import SamplingParams


@dataclass
class DraftSlot:
    """A drafter's state for one generation. forwards: model forwards this generation has cost."""

    forwards: int = 0
    ngrams: Any = None  # the committed text's n-grams, where a drafter looks it up (`prompt_lookup.Ngrams`)


@dataclass
class DraftRequest:
    """One row of a batched proposal: up to `max_tokens` deep after `context` (the whole committed text).
    policy: the row's draft policy, for drafters it shapes (`AutoDrafter`); chains: the request's own
    chain sources (a `Prediction`, a `HistoryView`: see `ChainSource`), for drafters that use them.
    generated: tokens the generation has emitted before this draft.
    noise: for a generation whose draws are keyed (`verify.verify_tree_coupled`), offset -> the
    noise the target's token that many places after the context will be drawn with (0: the root's
    children); its draft holds point masses only, a draft model's ranked by that noise
    (`sampling.ranked`), so they spell the target's draw about as often as the two models agree."""

    slot: DraftSlot
    context: Sequence[int]
    max_tokens: int
    sampling: SamplingParams
    rng: torch.Generator
    policy: NodePolicy | None = None
    chains: tuple[ChainSource, ...] = ()
    noise: Callable[[int], torch.Tensor] | None = None
    generated: int = 0

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
    # What it is, declared: the decoder, the server and the bench ask these, never a drafter's class.
    draft_model: CausalLM | None  # the model whose forwards it pays for (None: it drafts from text alone)
    reads_target_states: bool  # it reads the target's states (`observe`): the engine keeps them
    state_layers: tuple[int, ...] | None  # which: the inputs of these target layers, or None for the final norm's
    takes_chains: bool  # it drafts a request's own chain sources (a prediction, the history) too
    keyed_draws: bool  # given `DraftRequest.noise` it drafts point masses only: a seed then keys draws by position
    shaped_by_nodes: bool  # a `NodePolicy` shapes every iteration's draft (else it drafts the depth asked for)
    tree: TreeShape | None  # the fixed token tree it drafts (None: chains, or a tree shaped per iteration)
    sequence_ids: int  # sequence ids one generation takes of each model on llama.cpp (one per branch)

    def fit(self, target: CausalLM) -> None:
        """Refuse (SpecDecError) a target it cannot draft for exactly (another vocabulary, trees a
        model cannot score), and settle what depends on the target; called once, by the decoder."""
        ...

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

    def observe(self, slot: DraftSlot, first: int, states: torch.Tensor) -> None:
        """Where `reads_target_states`: the target's states [n, width] at positions first .. first + n - 1
        of the committed text (the state at p gave the logits that drew the token at p + 1). The engine
        turns on the target's `keep_states(layers=state_layers)` and reports, after every prefill
        chunk, the states the target left (its last, or every token's), and after every verify the
        root's and the accepted nodes'."""
        ...


class ContextDrafter:
    """A drafter that reads only the committed text (n-gram, prompt lookup): nothing per slot.
    Subclasses implement `propose_one`."""

    name = "context"
    draft_model, tree = None, None
    reads_target_states = takes_chains = keyed_draws = shaped_by_nodes = False
    state_layers = None
    sequence_ids = 1

    def fit(self, target: CausalLM) -> None:
        pass

    def open(self, prompt: Sequence[int]) -> DraftSlot:
        return DraftSlot()

    def prefill(self, slot: DraftSlot, budget: int | None = None) -> bool:
        return True

    def propose(self, requests: list[DraftRequest]) -> list[Draft | Exception]:
        return [attempt(lambda: self.propose_one(r.context, r.max_tokens, r.sampling, r.rng)) for r in requests]

    def propose_one(self, context: Sequence[int], max_tokens: int, sampling: SamplingParams,
                    rng: torch.Generator) -> Draft:
        raise NotImplementedError

    def accept(self, slot: DraftSlot, tokens: list[int]) -> None:
        pass

    def close(self, slot: DraftSlot) -> None:
        pass


class VocabColumns:
    """Which target token each column of a draft model's distributions stands for: ids[c] for
    column c (a pruned vocabulary's, `runtime.pruned`), or c itself when ids is None (the target's
    whole vocabulary: every method is then the identity, at no cost). Drafters choose columns and
    map only the chosen ones to target ids; q is 0 at a target id outside the columns."""

    def __init__(self, ids: torch.Tensor | None = None):  # [columns] int64 distinct target ids, or None
        self.ids = ids
        self._tokens = None if ids is None else ids.tolist()
        self._columns = None if ids is None else {token: c for c, token in enumerate(self._tokens)}

    def token(self, column: int) -> int:
        return column if self._tokens is None else self._tokens[column]

    def column(self, token: int) -> int | None:
        """The column of target id `token`, None outside the columns (where q is 0)."""
        return token if self._columns is None else self._columns.get(token)

    def inside(self, tokens: Sequence[int]) -> list[int]:
        """The columns of those `tokens` that have one (to exclude them from q: the others are 0 there)."""
        return list(tokens) if self._columns is None else [self._columns[t] for t in tokens if t in self._columns]

    def leading(self, tokens: Sequence[int]) -> list[int]:
        """The columns of `tokens` up to the first that has none."""
        if self._columns is None:
            return list(tokens)
        columns = []
        for token in tokens:
            if token not in self._columns:
                break
            columns.append(self._columns[token])
        return columns

    def select(self, full: torch.Tensor) -> torch.Tensor:
        """[..., vocab] indexed by target id -> [..., columns]."""
        return full if self.ids is None else full[..., self.ids]


@dataclass
class DraftTree:
    """A draft being grown, by any drafter that grows trees (the draft model's, the default's).
    Node i has a token (a target id), a parent (-1: the root, the last committed token), the
    distribution it was drawn from (None: a point mass; else over `columns`), its value, and the
    sources that proposed it. A value is a probability of the node's whole path (the draft
    model's, or the policy's estimate that it is accepted): a child's never exceeds its parent's,
    and the root's is 1. Siblings are accepted in disjoint events: where the verifier tries them in
    order (sampling), a later child can have only what the earlier ones left (`unclaimed`)."""

    columns: VocabColumns = field(default_factory=VocabColumns)
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    drawn_from: list[torch.Tensor | None] = field(default_factory=list)  # each [columns]
    values: list[float] = field(default_factory=list)
    sources: list[list[tuple[str, int]]] = field(default_factory=list)
    branches: int = 0  # nodes that are not their parent's first child: each needs a branch (a llama.cpp sequence id)

    def add(self, token: int, parent: int, drawn_from: torch.Tensor | None, value: float,
            source: tuple[str, int] | None = None) -> int:
        self.branches += parent in self.parents
        self.tokens.append(token)
        self.parents.append(parent)
        self.drawn_from.append(drawn_from)
        self.values.append(value)
        self.sources.append([source] if source is not None else [])
        return len(self.tokens) - 1

    def value(self, node: int) -> float:
        return 1.0 if node < 0 else self.values[node]

    def unclaimed(self, node: int) -> float:
        """The chance that verification reaches `node` and rejects every child it has so far."""
        return max(0.0, self.value(node) - sum(v for v, p in zip(self.values, self.parents) if p == node))

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
        if not keep:
            return empty_draft()
        renumber = {old: new for new, old in enumerate(keep)}
        tokens = torch.tensor([self.tokens[i] for i in keep], dtype=torch.long)
        parents = torch.tensor([renumber[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
                               dtype=torch.long)
        drawn = any(self.drawn_from[i] is not None for i in keep)
        probs, columns = self._distributions(keep) if drawn else (None, None)
        sources = [self.sources[i] for i in keep] if any(self.sources) else None
        return Draft(tokens, probs, parents, sources, columns)

    def _distributions(self, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kept nodes' rows ([len(keep), columns]) and their columns' target ids (None: the
        whole vocabulary). A point mass at a token outside the draft's columns (a lookup token the
        draft model cannot propose) gets a column of its own after them, where every drawn row
        is 0, exactly what q is there: the rows stay in the draft's space, never the target's."""
        drawn = next(self.drawn_from[i] for i in keep if self.drawn_from[i] is not None)
        masses = dict.fromkeys(self.tokens[i] for i in keep if self.drawn_from[i] is None)
        extra = [token for token in masses if self.columns.column(token) is None]
        width = drawn.numel()
        column = {token: width + j for j, token in enumerate(extra)}
        column.update((token, self.columns.column(token)) for token in masses if token not in column)
        probs = torch.zeros(len(keep), width + len(extra), dtype=drawn.dtype)
        for row, i in enumerate(keep):
            if self.drawn_from[i] is None:
                probs[row, column[self.tokens[i]]] = 1.0
            else:
                probs[row, :width] = self.drawn_from[i]
        columns = self.columns.ids
        if extra:
            columns = torch.cat([columns, torch.tensor(extra, dtype=torch.long)])
        return probs, columns


def draft_timing(requests: Sequence[DraftRequest]) -> Callable[[list[tuple[int, int]], float], None]:
    """What takes a proposal's draft-model forwards' times (`runtime.forward_together`) to the rows'
    live costs (their policy's profile, where it is `LiveCosts`: one for a batch that shares it).
    Looked for only once a forward was timed: most proposals make none."""

    def observe(forwards: list[tuple[int, int]], seconds: float) -> None:
        live = {id(p): p for p in (getattr(request.policy, "profile", None) for request in requests)
                if isinstance(p, LiveCosts)}
        for costs in live.values():
            costs.observe_draft(forwards, seconds)

    return observe


def attempt(work):
    """work(), or the exception it raised: a failure that belongs to one row of a batch."""
    try:
        return work()
    except Exception as error:
        return error


_EMPTY = Draft(tokens=torch.zeros(0, dtype=torch.long))


def empty_draft() -> Draft:
    """A draft of no nodes (one shared object: nothing changes a draft once made, and a step that
    drafts nothing should cost what a plain one does)."""
    return _EMPTY
