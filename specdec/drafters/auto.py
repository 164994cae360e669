"""The default drafter: chain sources and the draft model side by side in one token tree, shaped
node by node by the cost-aware policy (`specdec.policy.CostAwarePolicy`).

Chain sources are free to draft: prompt lookup, and a request's own (`DraftRequest.chains`: a
client's prediction, earlier requests' history). Each iteration, per row:
1. each chain source's continuation enters as a chain while each next token's chance of being
   accepted pays for the verify cost it adds (the policy's `Budget`), the source the policy
   trusts most first;
2. the draft model then grows level by level, each level one forward shared by the batch's rows,
   while the value a level is expected to add pays for its forward: in greedy mode the most likely
   children of the best nodes (a dynamic tree, as in EAGLE-2); for a seeded sampled request
   (`DraftRequest.noise`) the same tree with children ranked by the noise the target's tokens will
   be drawn with; when sampling otherwise, a chain drawn from q.
   A node's value is its parent's times the policy's acceptance estimate for its source; when
   sampling, a drawn child beside a looked-up one is tried only once that one is rejected, so its
   value is what its earlier siblings leave of its parent's (`DraftTree.unclaimed`).

Both sources' nodes share one tree: in greedy mode a token both propose is one node; when sampling,
a lookup token is a point mass, and the draft model's child beside it is drawn from q with the
lookup token removed (renormalised) and carries that distribution: siblings drawn given the earlier
ones, which is what `verify_tree` needs to stay lossless. Whether a model token is drawn at all is
decided on its distribution before the draw, never on the token. The model's q stays in its own
columns (a pruned vocabulary's, `VocabColumns`): a lookup token without a column has q = 0
already, and a chosen column becomes a target id only when it becomes a node.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Callable, Sequence

import torch

from specdec.config import TREE_WIDTH
from specdec.drafters.base import (DraftRequest, DraftSlot, DraftTree, VocabColumns, attempt, draft_timing,
                                   empty_draft)
from specdec.drafters.model import CATCH_UP, ModelDrafter, pick_children
from specdec.drafters.prompt_lookup import Ngrams, PromptLookupDrafter, lookup_match
from specdec.policy import COPY_MATCH, MAX_DEPTH, Budget, NodePolicy, confidence_bin
from specdec.sampling import ranked
from specdec.runtime import CausalLM
from specdec.runtime.base import forward_together
from specdec.types import Draft


Proposal = Callable[[], tuple[str, list[int]]]  # a chain source's (kind, chain), asked for when needed


class AutoDrafter:
    """Prompt lookup and/or a draft model (a chain-mode `ModelDrafter`, whose slots it uses), shaped
    by the `NodePolicy` each request carries. width: children per node and nodes per level of
    greedy trees; max_lookup: the longest looked-up continuation considered (the policy's depth
    bounds it too); max_branches: nodes beside an earlier sibling per tree (each costs a sequence
    id on llama.cpp, for both models). The draft model drafts at most MAX_DEPTH levels."""

    def __init__(self, model: ModelDrafter | None, lookup: PromptLookupDrafter | None = None, width: int = TREE_WIDTH,
                 max_lookup: int = 64, max_branches: int = 3):
        if model is None and lookup is None:
            raise ValueError("the auto drafter needs a draft model, prompt lookup or both")
        if model is not None and (model.tree is not None or model.inner is not None):
            raise ValueError("the auto drafter shapes its own trees: give it a plain ModelDrafter")
        self.model, self.lookup, self.width = model, lookup, width
        self.max_lookup, self.max_branches = max_lookup, max_branches
        self.draft_model = model.model if model is not None else None
        self.reads_target_states = model is not None and model.reads_target_states
        self.state_layers = model.state_layers if self.reads_target_states else None
        # the draft model reads the committed text only when it drafts (a model that seldom pays
        # seldom reads); a head of the final norm's states keeps only the last few, so it reads as they
        # come, while an EAGLE-3 head keeps thousands of positions' states and reads them when it drafts
        self.lazy = model is not None and (not self.reads_target_states or self.state_layers is not None)
        self.trees = True  # False: one chain per iteration, from one source (models that cannot score trees exactly)
        sources = (("draft model", model), ("prompt lookup", lookup))
        self.name = "auto (" + " + ".join(n for n, part in sources if part) + ")"
        # the policy's names of its own sources (a request's chains add theirs)
        self.sources = ("model",) * (model is not None) + ("lookup", "copy") * (lookup is not None)

    takes_chains = keyed_draws = shaped_by_nodes = True
    tree = None  # shaped per iteration

    @property
    def sequence_ids(self) -> int:
        return self.max_branches + 1

    def fit(self, target: CausalLM) -> None:
        """The draft model must fit; trees (a prediction and lookup branching too) are drafted only
        where every model scores them exactly, chains elsewhere."""
        if self.model is not None:
            self.model.fit(target)
        models = [target] + ([self.draft_model] if self.draft_model is not None else [])
        self.trees = self.trees and all(model.tree_refusal() is None for model in models)

    def open(self, prompt: Sequence[int]) -> DraftSlot:
        slot = self.model.open(prompt) if self.model else DraftSlot()
        slot.ngrams = Ngrams(COPY_MATCH) if self.lookup is not None else None
        return slot

    def prefill(self, slot: DraftSlot, budget: int | None = None) -> bool:
        return self.model.prefill(slot, budget) if self.model and not self.lazy else True

    def accept(self, slot: DraftSlot, tokens: list[int]) -> None:
        if self.model:
            self.model.accept(slot, tokens, catch_up=not self.lazy)

    def close(self, slot: DraftSlot) -> None:
        if self.model:
            self.model.close(slot)

    def observe(self, slot: DraftSlot, first: int, states: torch.Tensor) -> None:
        self.model.observe(slot, first, states)

    def propose(self, requests: list[DraftRequest]) -> list[Draft | Exception]:
        # most steps, where little pays, no source could take a first node: those rows end here
        plans = [attempt(partial(self._sources, request)) for request in requests]
        drafts = [plan if isinstance(plan, Exception) else empty_draft() for plan in plans]
        growing = [i for i, plan in enumerate(plans) if isinstance(plan, list)]
        if growing:
            grown = forward_together(self.draft_model, [self._grow(requests[i], plans[i]) for i in growing],
                                     draft_timing([requests[i] for i in growing]))
            for i, draft in zip(growing, grown):
                drafts[i] = draft
        return drafts

    def _sources(self, request: DraftRequest) -> list[tuple[str, Proposal]] | None:
        """Each chain source of the row as (kind, what gives its chain), asked for only where it may be
        drafted (once a node is taken, or where the source could pay from an empty budget: else none of
        its nodes would be); None where no source, the draft model included, could take a first node."""
        policy = request.policy
        if not _shapes_nodes(type(policy)):
            raise ValueError("the auto drafter is shaped node by node by a policy (`NodePolicy`: gamma 'auto')")
        depth = min(request.max_tokens, self.max_lookup)
        sources = [(source.kind, partial(_proposal, source, request.context, depth)) for source in request.chains]
        if self.lookup is not None:
            sources.append(self._looked_up(request, depth, policy))
        kinds = [kind for kind, _ in sources] + (["model"] if self.model is not None else [])
        return sources if any(map(policy.may_pay, kinds)) else None

    def _grow(self, request: DraftRequest, sources: list[tuple[str, Proposal]]):
        """One row's draft, as a generator of its draft-model forwards (see `forward_together`)."""
        policy = request.policy
        budget, nodes = policy.budget(), DraftTree(self.model.columns if self.model is not None else VocabColumns())
        # the likeliest source first: where chains differ, the later ones branch (while branches are left)
        for kind, propose in sorted(sources, key=lambda s: -policy.accept_probability((s[0], 0))):
            if nodes.tokens or policy.may_pay(kind):
                kind, chain = propose()
                self._add_chain(nodes, kind, chain, policy, budget)
        if self.model is not None and (self.trees or not nodes.tokens) and (nodes.tokens or policy.may_pay("model")):
            yield from self._grow_model(nodes, request, policy, budget)
        return nodes.draft()

    def _looked_up(self, request: DraftRequest, depth: int,
                   policy: NodePolicy) -> tuple[str, Proposal]:
        """Prompt lookup as a source: its kind ("copy" or "lookup", `copying`) and what gives its chain.
        The search runs at once where lookup could pay or a copy could: one needs the context's last
        COPY_MATCH tokens earlier in it (`Ngrams.repeats`); else it is "lookup", searched if a node is taken."""
        context, generated = request.context, request.generated

        def search() -> tuple[str, list[int]]:
            chain, matched = lookup_match(context, depth, self.lookup.max_ngram, self.lookup.min_ngram)
            return "copy" if copying(matched, generated) else "lookup", chain

        if policy.may_pay("lookup") or (policy.may_pay("copy") and generated and request.slot.ngrams.repeats(context)):
            found = search()
            return found[0], lambda: found
        return "lookup", search

    def _add_chain(self, nodes: DraftTree, kind: str, chain: list[int], policy: NodePolicy, budget: Budget) -> None:
        """A chain source's best prefix (all its values are known at once), or more when the policy
        probes the source. Where a chain spells what is in the tree already it shares its nodes;
        where it leaves them it branches (if a branch is left)."""
        probe = policy.probe_tokens(kind)
        values = policy.chain_values(kind, len(chain), at_least=probe)
        parent = -1
        for position, token in enumerate(chain[: budget.take_chain(values, at_least=probe)]):
            existing = nodes.child(parent, token)
            if existing is not None:
                nodes.sources[existing].append((kind, position))
                parent = existing
                continue
            if parent in nodes.parents and (not self.trees or nodes.branches >= self.max_branches):
                return  # a branch: none left, or the models cannot score trees
            parent = nodes.add(token, parent, None, values[position], (kind, position))

    def _grow_model(self, nodes: DraftTree, request: DraftRequest, policy: NodePolicy, budget: Budget):
        """The draft model's levels (`ModelDrafter.grow_levels`), while each pays for its forward:
        a level's children are those that pay (`_add_level`), and its best `width` are expanded."""
        model, context, slot = self.model, request.context, request.slot
        depth = min(request.max_tokens, MAX_DEPTH, model.model.verify_room(len(context) - 1))
        room = model.model.max_length - len(context)  # draft cache entries free once the context is in
        if depth <= 0:
            return
        width = self.width if self.trees and request.point_masses and (depth - 1) * self.width <= room else 1
        unread = len(slot.pending)  # committed tokens the draft model reads before its first level
        probe = policy.probe_model(unread)
        # reading them is paid once for the iterations to come: spread over as many as may be left, where the model
        # drafts in them. When sampling, a model that does not pay of its own accord and joins a chain (a probe's,
        # a copy's) seldom does: its drawn nodes are accepted about half the time, it falls behind again and reads
        # it all again when it next joins, so this iteration pays it all. (Interleaved, transformers, T 0.7: 0.981
        # -> 0.998 of plain over four suites; greedy, spread, chat 2.03 and edit 3.29 against 1.86 and 3.09.)
        spread = request.max_tokens if request.point_masses or policy.may_pay("model") else 1
        catch_up = policy.catch_up_cost(unread) / max(1, spread)
        if not (budget.take_level(policy.model_rate(), 1, catch_up) or probe):
            return
        if unread > CATCH_UP:  # in a forward of its own: a batched forward pads every row to the longest
            model.prefill(slot)

        def children(level: int, frontier: list[int], rows: torch.Tensor) -> list[int]:
            return self._add_level(nodes, frontier, rows, level, width, request, policy, budget,
                                   force=probe and level == 1)

        def expand(level: int, grown: list[int]) -> list[int]:
            frontier = sorted(grown, key=lambda node: -nodes.values[node])[:width]
            pays = budget.take_level(sum(nodes.values[node] for node in frontier) * policy.model_rate(), len(frontier))
            return frontier if pays else []

        yield from model.grow_levels(request.slot, nodes, depth, request.sampling, children, expand)

    def _add_level(self, nodes: DraftTree, frontier: list[int], rows: torch.Tensor, level: int, width: int,
                   request: DraftRequest, policy: NodePolicy, budget: Budget, force: bool = False) -> list[int]:
        """The model's children of the frontier (at `level`, 1 for the root's) that pay, best first
        (with `force`, the best one whether it pays or not); returns the level's nodes (lookup nodes
        the model also proposes included, at no cost). Chosen children: greedy, the most likely;
        keyed, those ranked first by the level's noise."""
        candidates = []  # (value, parent, column or None for a draw, q, source); q: [columns]
        columns = nodes.columns
        for parent, q in zip(frontier, rows):
            if request.point_masses:
                chosen = torch.topk(q, min(width, q.numel())).indices.tolist() if request.noise is None else \
                    ranked(q, columns.select(request.noise(level - 1)), width)
                for column in chosen:
                    source = ("model", confidence_bin(float(q[column])))
                    candidates.append((nodes.value(parent) * policy.accept_probability(source), parent, column, q,
                                       source))
            else:  # the decision is taken on q before anything is drawn from it; it is tried after the parent's
                # children so far (a looked-up token), once they are rejected
                source = ("model", confidence_bin(float(q.max())))
                value = nodes.unclaimed(parent) * policy.accept_probability(source)
                candidates.append((value, parent, None, q, source))
        grown = []
        for value, parent, column, q, source in sorted(candidates, key=lambda c: -c[0]):
            existing = nodes.child(parent, columns.token(column)) if column is not None else None
            if existing is not None:  # lookup proposed it too: one node, two sources
                nodes.sources[existing].append(source)
                grown.append(existing)
                continue
            if parent in nodes.parents and nodes.branches >= self.max_branches:
                continue  # no sequence id left for another branch
            if not (budget.take_node(value) or (force and not grown)):
                break
            if column is None:
                drawn = list(pick_children(q, 1, True, request.rng, exclude=columns.inside(nodes.child_tokens(parent))))
                if not drawn:
                    continue
                (column, drawn_from), = drawn
            else:
                drawn_from = None
            grown.append(nodes.add(columns.token(column), parent, drawn_from, value, source))
        return grown


def _proposal(source, context: Sequence[int], depth: int) -> tuple[str, list[int]]:
    return source.kind, source.proposal(context, depth)


def copying(matched: int, generated: int) -> bool:
    """Whether a looked-up continuation is a copy (`policy.CHAIN_PRIORS`): the text before it repeats
    the context's last COPY_MATCH tokens or more, and the generation has written some of them. Before
    its first token the match lies wholly in the prompt, where a repeat is the prompt's own frame (a turn
    marker, "Observation:") and what followed it earlier is an earlier answer: on the demo pair's
    suites such a continuation's first token was right 0 times in 23, a copy's later on 91% of the time
    (benchmarks/RESULTS.md, "The first step's copy")."""
    return matched >= COPY_MATCH and generated > 0


@cache
def _shapes_nodes(policy_type: type) -> bool:
    """Whether a policy of this type is a `NodePolicy` (checked once per type: a protocol's isinstance
    is slow, and asked every iteration)."""
    return issubclass(policy_type, NodePolicy)
