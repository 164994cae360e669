"""A smaller checkpoint sharing the target's tokenizer drafts a chain or a token tree.

Three ways to grow a draft, one class:
- chain (no `tree`): one token per draft forward, as in Leviathan et al.;
- tree (`tree=TreeShape(...)`): level by level; the best `width` nodes of a level are scored in
  one batched tree forward, so draft forwards per iteration = depth, not node count;
- staged (`inner=` a cheaper drafter): the draft model's own continuation (the *spine*) is decoded
  speculatively with the inner "draft²" (Spector & Ré), losslessly for the draft model, so q stays
  the draft model's distribution; with a `tree`, siblings along the spine come from the same forwards.

Children are deterministic (the most likely tokens, point masses; a staged spine is then the
draft's most likely continuation) in greedy mode or with `TreeShape(sampled=False)`; otherwise
each child is drawn from the draft's distribution with its earlier siblings removed (without
replacement, so no node is spent on a duplicate) and carries that distribution, which is what
`verify_tree` needs.

A draft model with a pruned vocabulary (`runtime.pruned`) gives logits over its own columns: q
stays there, children are chosen as columns, and only they are mapped to target ids
(`VocabColumns`); a target id to exclude from q (an earlier sibling) is mapped to its column, and
one without a column has q = 0 already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specdec import tree
from specdec.config import INNER_GAMMA, TreeShape
from specdec.drafters.base import (ContextDrafter, DraftRequest, DraftSlot, DraftTree, VocabColumns, draft_timing,
                                    empty_draft)
from specdec.errors import check_integer
from specdec.runtime import CausalLM, check_same_vocabulary, require_trees
from specdec.runtime import base as runtime
from specdec.runtime.base import Feed, forward_together
from specdec.sampling import argmax, probs_from_logits, sample
from specdec.types import Draft
from specdec.params import SamplingParams
from specdec.verify import verify_chain, verify_greedy

SIBLING_MASS = 0.1  # a sampled node draws another child only while this much of q is not yet drawn
CATCH_UP = 16  # committed tokens a slot may hold unfed (steps without drafting) before they are fed


def pick_children(q: torch.Tensor, count: int, sampled: bool, rng: torch.Generator, exclude: Sequence[int] = ()):
    """Up to `count` children for a node whose draft distribution is q ([columns]), never a column
    in `exclude` (those are earlier siblings). Yields (column, the distribution it was drawn from
    or None).

    Deterministic: the most likely tokens with q > 0. Sampled: each child is drawn from q with the
    earlier siblings removed and renormalised; after the first, another is drawn only while at
    least SIBLING_MASS of q is undrawn. That rule looks only at earlier siblings, so every child is
    drawn from its stated distribution given everything before it, as `verify_tree` requires.
    """
    rest = q.clone()
    rest[list(exclude)] = 0
    for _ in range(count):
        left = float(rest.sum())
        if left <= 0 or (sampled and exclude and left < SIBLING_MASS):
            return
        if sampled:
            drawn_from = rest / left if exclude else q
            token = sample(drawn_from, rng)
        else:
            drawn_from, token = None, argmax(rest)
        yield token, drawn_from
        rest[token] = 0
        exclude = [*exclude, token]


def _add_children(nodes: DraftTree, parent: int, q: torch.Tensor, count: int, sampled: bool, rng,
                  exclude: Sequence[int] = ()) -> list[int]:
    """Children of `parent`, whose draft distribution is q ([columns]), from `pick_children`, never
    a target id in `exclude`, each worth its path's draft probability; returns their indices."""
    columns = nodes.columns
    return [nodes.add(columns.token(column), parent, drawn_from, nodes.value(parent) * float(q[column]))
            for column, drawn_from in pick_children(q, count, sampled, rng, columns.inside(exclude))]


def _settled(nodes: DraftTree, frontier: list[int], budget: int) -> bool:
    """No deeper node can enter the best `budget` of a deterministic tree: children are worth no
    more than their parents, so once the budget-th best value reaches the frontier's best,
    feeding the frontier would be wasted."""
    if len(nodes.tokens) < budget:
        return False
    kept = nodes.best(list(range(len(nodes.tokens))), budget)
    return nodes.values[kept[-1]] >= max(nodes.values[i] for i in frontier)


@dataclass
class _Slot(DraftSlot):
    """The draft model's state for one generation. Its cache holds `cached` committed entries, then
    the draft nodes fed last (`branch_tokens` / `branch_parents`, parents in branch indices, -1 =
    the last committed entry). `pending`: committed tokens not fed yet."""

    cache: runtime.CachedSequence = None
    cached: int = 0
    pending: list[int] = field(default_factory=list)
    branch_tokens: list[int] = field(default_factory=list)
    branch_parents: list[int] = field(default_factory=list)
    branch_index: dict[int, int] = field(default_factory=dict)  # tree node -> branch index, while growing


class ModelDrafter:
    """Drafts with a smaller model; see the module docstring for chain, tree and staged growth.
    Rows of a batch grow side by side: their draft forwards at each level go into one forward."""

    def __init__(self, model: CausalLM, tree: TreeShape | None = None, inner: ContextDrafter | None = None,
                 inner_gamma: int = INNER_GAMMA):
        check_integer(inner_gamma, "the inner draft length")
        self.model, self.tree, self.inner, self.inner_gamma = model, tree, inner, inner_gamma
        self.draft_model = model
        self.reads_target_states = model.reads_target_states
        self.state_layers = model.state_layers if self.reads_target_states else None
        self.columns = VocabColumns(model.columns)  # of the model's logits: a pruned vocabulary's, or all
        self.name = "draft-model" + (f"+{inner.name}" if inner else "") + (f" tree {tree.nodes}" if tree else "")

    takes_chains = keyed_draws = shaped_by_nodes = False

    @property
    def sequence_ids(self) -> int:
        return self.tree.nodes + 1 if self.tree is not None else 1

    def fit(self, target: CausalLM) -> None:
        """The draft model speaks the target's vocabulary; for trees, both models score them exactly."""
        check_same_vocabulary(target.tokenizer, self.model.tokenizer, f"draft model ({self.model.path})")
        if self.tree is not None:
            require_trees(target)
            require_trees(self.model)
        if self.inner is not None:
            self.inner.fit(target)

    def open(self, prompt: Sequence[int]) -> _Slot:
        """A slot with the whole prompt pending: `prefill` feeds it (else the first proposal would)."""
        return _Slot(cache=self.model.sequence(), pending=list(prompt))

    def prefill(self, slot: _Slot, budget: int | None = None) -> bool:
        """Feed up to `budget` pending tokens (None: all) but the last, which the next proposal
        feeds; True when no more are to be fed. A prompt longer than the draft model's context is
        never fed: it leaves no room, and the slot never drafts."""
        if slot.cached + len(slot.pending) > self.model.max_length:
            return True
        count = len(slot.pending) - 1 if budget is None else min(budget, len(slot.pending) - 1)
        if count > 0:
            slot.cache.forward(slot.pending[:count], last=1)
            slot.cached, slot.pending = slot.cached + count, slot.pending[count:]
        return len(slot.pending) <= 1

    def close(self, slot: _Slot) -> None:
        slot.cache.release()

    def observe(self, slot: _Slot, first: int, states: torch.Tensor) -> None:
        """The target's states from position `first` on (see `Drafter`), for a model that reads them (a head)."""
        slot.cache.observe(first, states)

    def accept(self, slot: _Slot, tokens: list[int], catch_up: bool = True) -> None:
        """The branch nodes spelling the committed tokens move next to the committed entries and the
        rest are dropped; a cache entry is never recomputed. The last committed token always stays
        pending, so the next forward yields the distribution after the whole text. `catch_up`:
        feed the pending tokens once more than CATCH_UP wait (else the next proposal feeds them)."""
        path = []
        if slot.branch_tokens:  # else nothing was drafted: the tokens are only pending (most steps where little pays)
            path = self._follow_branch(slot, tokens[:-1])
            slot.cache.keep(slot.cached, [slot.cached + node for node in path])
            slot.branch_tokens, slot.branch_parents = [], []
        slot.cached += len(path)
        slot.pending += tokens[len(path):]
        if catch_up and len(slot.pending) > CATCH_UP and slot.cached + len(slot.pending) <= self.model.max_length:
            # steps without drafting (a big batch) leave committed text unfed; feed it now, so the next
            # proposal's forward stays short (a batched forward pads every row to the longest)
            self.prefill(slot)
            slot.forwards += 1

    def propose(self, requests: list[DraftRequest]) -> list[Draft | Exception]:
        return forward_together(self.model, [self._grow(request) for request in requests], draft_timing(requests))

    def _grow(self, request: DraftRequest):
        """One row's draft, as a generator of its draft-model forwards (see `forward_together`)."""
        slot, context, sampling, rng = request.slot, request.context, request.sampling, request.rng
        depth = min(request.max_tokens, self.model.verify_room(len(context) - 1))
        if depth <= 0:
            return empty_draft()
        slots = self.model.max_length - len(context)  # cache entries free once the context is in
        shape = self.tree or TreeShape(nodes=depth, width=1)  # a chain is a tree of width 1
        # near the context's end: too little room for a tree
        if self.inner is None and (depth - 1) * shape.width > slots:
            shape = TreeShape(nodes=depth, width=1, sampled=shape.sampled)
        sampled = shape.sampled and not sampling.greedy
        depth = min(depth, shape.nodes)
        nodes = DraftTree(self.columns)
        if self.inner is None:
            yield from self._grow_levels(slot, nodes, depth, shape, sampled, sampling, rng)
        else:  # the spine takes depth slots, each draft² guess one more while it is checked
            yield from self._grow_staged(slot, nodes, context, depth, shape, sampled, sampling, rng,
                                         min(self.inner_gamma, slots - depth))
        if sampled or len(nodes.tokens) <= shape.nodes:
            return nodes.draft()
        return nodes.draft(keep=nodes.best(list(range(len(nodes.tokens))), shape.nodes))  # best-first cut

    def grow_levels(self, slot: _Slot, nodes: DraftTree, depth: int, sampling: SamplingParams,
                    children: Callable[[int, list[int], torch.Tensor], list[int]],
                    expand: Callable[[int, list[int]], list[int]]):
        """Grow `nodes` level by level, one draft forward per level: the loop of every drafter that
        grows trees with this model (this one's `tree` shape, the `AutoDrafter`'s policy), as a
        generator of its forwards (see `forward_together`). What differs is passed in:
        `children(level, frontier, rows)` adds the children of the frontier's nodes, whose draft
        distributions are rows ([len(frontier), columns]), at `level` (1: the root's children), and
        returns the level's nodes; `expand(level, grown)` picks those of them fed next, in one
        forward that gives their own distributions ([]: the tree is done). The tree also ends at
        `depth` and at a level that grew nothing."""
        frontier = [-1]  # the root: its distribution comes from feeding the pending committed tokens
        rows = self.distributions((yield from self.feed_committed(slot))[-1:], sampling)  # [1, columns]
        for level in range(1, depth + 1):
            grown = children(level, frontier, rows)
            if level == depth or not grown:
                return
            frontier = expand(level, grown)
            if not frontier:
                return
            logits = yield from self.feed_frontier(slot, frontier, nodes.tokens, nodes.parents)
            rows = self.distributions(logits, sampling)  # [len(frontier), columns]

    def _grow_levels(self, slot: _Slot, nodes: DraftTree, depth: int, shape: TreeShape, sampled: bool, sampling, rng):
        """A `shape`d tree: each frontier node gets up to `width` children (`_add_children`); the best
        `width` of a level are expanded. Sampled trees keep every child drawn, so their budget is
        spent while growing: a level gets what is left after reserving one node for each deeper
        level, and only the nodes that remainder can give children are expanded."""

        def left(level: int) -> int:  # a sampled tree's nodes not yet spent nor reserved for deeper levels
            return shape.nodes - len(nodes.tokens) - (depth - level)

        def children(level: int, frontier: list[int], rows: torch.Tensor) -> list[int]:
            new = []
            for node, q in zip(frontier, rows):
                new += _add_children(nodes, node, q, min(shape.width, left(level)) if sampled else shape.width,
                                     sampled, rng)
            return new

        def expand(level: int, new: list[int]) -> list[int]:
            frontier = nodes.best(new, shape.width)
            if not sampled:
                return [] if _settled(nodes, frontier, shape.nodes) else frontier
            return frontier[: max(1, math.ceil((left(level) + 1) / shape.width))]

        yield from self.grow_levels(slot, nodes, depth, sampling, children, expand)

    def _grow_staged(self, slot: _Slot, nodes: DraftTree, context, depth: int, shape: TreeShape, sampled: bool,
                     sampling, rng, inner_gamma: int):
        """The spine: the draft model's own continuation, decoded speculatively with the inner
        drafter (lossless for the draft model: each spine token is distributed as q given those
        before it), its guesses checked in the draft's columns (`_check_guesses`). With a tree
        shape, siblings are added along the spine from the same rows."""
        spine, spine_columns, rows = [], [], []
        while len(spine) < depth:
            guess = self.inner.propose_one(list(context) + spine, min(inner_gamma, depth - len(spine) - 1),
                                           sampling, rng)
            if not tree.is_chain(guess.parents):
                raise ValueError(f"the inner drafter {self.inner.name} must propose a chain")
            guessed = self.columns.leading(guess.tokens.tolist())
            # one without a column is rejected for sure: none after it matters
            fed = guess.tokens[: len(guessed) + 1].tolist()
            if not spine:
                logits = yield from self.feed_committed(slot, fed)
            else:
                parents = [len(slot.branch_tokens) - 1 + j for j in range(len(fed) + 1)]
                logits = yield from self.feed_nodes(slot, [spine[-1]] + fed, parents)
            q = self.distributions(logits, sampling)  # [len(fed) + 1, columns]
            result = self._check_guesses(guess, guessed, len(fed), logits, q, sampled, rng)
            self._drop_branch_tail(slot, len(fed) - result.accepted)  # the rejected guesses
            spine += [self.columns.token(column) for column in result.tokens]
            spine_columns += result.tokens
            rows += list(q[: result.accepted + 1])
        for i, (column, q) in enumerate(zip(spine_columns, rows)):
            nodes.add(spine[i], i - 1, q if sampled else None, nodes.value(i - 1) * float(q[column]))
        if self.tree is not None:
            self._add_siblings(nodes, rows, shape, sampled, rng)

    def _check_guesses(self, guess: Draft, guessed: list[int], fed: int, logits: torch.Tensor, q: torch.Tensor,
                       sampled: bool, rng):
        """The inner's first `fed` guesses (target ids; the first len(guessed) have those columns)
        verified against the draft's logits and q ([fed + 1, columns]); the result's tokens are
        columns. A last guess without a column gets one of its own after the draft's, where q is 0
        and the inner's probability of it lies: it is rejected and the residual drawn exactly as
        they would be in the target's vocabulary (not q itself: the guess was drawn before it was
        seen to lack a column)."""
        outside = fed > len(guessed)  # never for a draft over the whole vocabulary
        tokens = torch.tensor(guessed + [q.shape[-1]] * outside, dtype=torch.long)
        if not sampled:  # deterministic children: the spine is the draft's most likely continuation
            return verify_greedy(tokens,
                                 torch.nn.functional.pad(logits, (0, 1), value=-torch.inf) if outside else logits)
        probs = None if guess.probs is None else self.columns.select(guess.probs[:fed])  # [fed, columns]
        if outside:
            q = torch.nn.functional.pad(q, (0, 1))
            if probs is not None:
                probs = torch.cat([probs, guess.probs[:fed, guess.tokens[fed - 1]].unsqueeze(1)], dim=1)
        return verify_chain(tokens, probs, q, rng, rng)

    def _add_siblings(self, nodes: DraftTree, rows, shape: TreeShape, sampled: bool, rng) -> None:
        """Leaves beside the spine, root side first: each spine position may get up to width - 1 more
        children. Sampled siblings are drawn after the spine token, which was the first draw."""
        spine = list(nodes.tokens)
        for i, q in enumerate(rows):
            count = shape.width - 1 if not sampled else min(shape.width - 1, shape.nodes - len(nodes.tokens))
            _add_children(nodes, i - 1, q, count, sampled, rng, exclude=[spine[i]])

    def distributions(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """q ([rows, columns]) after the sampling transform; in greedy mode the plain softmax, used
        only to rank nodes."""
        return torch.softmax(logits, dim=-1) if sampling.greedy else probs_from_logits(logits, sampling)

    def feed_committed(self, slot: _Slot, chain: list[int] = ()):
        """Feed the pending committed tokens and a first draft chain below them in one causal forward.

        Returns the logits after the last committed token and after each chain token."""
        logits = yield Feed(slot.cache, slot.pending + list(chain), last=len(chain) + 1)
        slot.forwards += 1
        slot.cached += len(slot.pending)
        slot.pending = []
        slot.branch_tokens, slot.branch_parents = list(chain), tree.chain_parents(len(chain))
        slot.branch_index = {}
        return logits

    def feed_nodes(self, slot: _Slot, tokens: list[int], parents: list[int]):
        """Feed draft nodes (parents in branch indices) in one forward, as a tree."""
        root = slot.cached - 1  # the last committed token's entry; branch node j is entry root + 1 + j
        logits = yield Feed(slot.cache, tokens, tree.entries(parents, root))
        slot.forwards += 1
        slot.branch_tokens += tokens
        slot.branch_parents += parents
        return logits

    def feed_frontier(self, slot: _Slot, frontier: list[int], tokens: list[int], parents: list[int]):
        """Feed tree nodes `frontier` (tokens and parents indexed by tree node; every parent fed
        before, or -1) in one forward, and remember which branch entry each became."""
        branch_parents = [slot.branch_index[parents[node]] if parents[node] >= 0 else -1 for node in frontier]
        logits = yield from self.feed_nodes(slot, [tokens[node] for node in frontier], branch_parents)
        slot.branch_index.update({node: len(slot.branch_tokens) - len(frontier) + j for j, node in enumerate(frontier)})
        return logits

    def _drop_branch_tail(self, slot: _Slot, count: int) -> None:
        if count:
            del slot.branch_tokens[-count:], slot.branch_parents[-count:]
            slot.cache.truncate(slot.cache.cache_len - count)

    @staticmethod
    def _follow_branch(slot: _Slot, tokens: Sequence[int]) -> list[int]:
        """The cached draft nodes spelling the longest prefix of `tokens`, root side first."""
        path, node = [], -1
        for token in tokens:
            node = tree.child(slot.branch_parents, slot.branch_tokens, node, token)
            if node is None:
                break
            path.append(node)
        return path
