"""Plain data passed between the drafters, the verifiers and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from specdec import tree


@dataclass(frozen=True)
class Draft:
    """What a drafter proposes: only new tokens, never the prefix; a chain or a token tree.

    parents[i] is the node tokens[i] follows (-1: the last committed token; see `specdec.tree`);
    omitted, the draft is a chain. probs[i] is the exact distribution tokens[i] was drawn from, after the
    same sampling transform as the target's and given everything drawn before it (for a tree's
    later siblings: the draft's distribution with the earlier siblings removed); None means
    point-mass (deterministic) drafts. sources[i] (optional) names what proposed node i, for the
    policy's acceptance statistics: (kind, index) pairs such as ("lookup", 2) or ("model", 7).

    Tokens are always target ids. The distributions' columns may be the draft's own vocabulary:
    columns[c] is the target id of column c (distinct ids; q is 0 at every target id not among
    them), so a draft with a pruned vocabulary never widens q to the target's (`runtime.pruned`).
    None: column c is target id c, the target's whole vocabulary. Every node's token is among the
    columns whenever there are probs.
    """

    tokens: torch.Tensor  # [n] int64
    probs: torch.Tensor | None = None  # [n, len(columns)] float, or [n, vocab] when columns is None
    parents: torch.Tensor = None  # [n] int64; leave it out for a chain (filled in by __post_init__)
    sources: list[list[tuple[str, int]]] | None = None
    columns: torch.Tensor | None = None  # [len(columns)] int64 target ids of probs' columns; None: all, in order

    def __post_init__(self):
        if self.parents is None:
            object.__setattr__(self, "parents", torch.tensor(tree.chain_parents(self.tokens.numel()), dtype=torch.long))

    def __len__(self) -> int:
        return self.tokens.numel()

    # asked several times an iteration, so kept: no field is set again (frozen) nor any tensor written in place
    @cached_property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def depth(self) -> int:
        return max(tree.depths(self.parent_list), default=0)

    @property
    def label(self) -> str | None:
        """What proposed the nodes, e.g. "lookup+model" (None when the drafter does not say)."""
        if self.sources is None:
            return None
        return "+".join(sorted({kind for node in self.sources for kind, _ in node})) or "none"

    def first(self, count: int) -> Draft:
        """The first `count` nodes. Still lossless: parents come before their children, so the cut
        is a tree, and each node keeps only siblings drawn before it, whose draws its stated
        distribution was conditioned on; nothing that was verified is dropped."""
        if count >= len(self):
            return self
        probs = None if self.probs is None else self.probs[:count]
        sources = None if self.sources is None else self.sources[:count]
        return Draft(self.tokens[:count], probs, self.parents[:count], sources, self.columns)


@dataclass
class VerifyResult:
    """accepted: how many draft tokens were kept (0..n).

    tokens: the accepted draft tokens followed by exactly one more — the recovered token after a
    rejection, or the bonus token when every draft was accepted. Always accepted + 1 long.
    """

    accepted: int
    tokens: list[int]
    path: list[int] = field(default_factory=list)  # the accepted nodes, root side first


@dataclass
class GenerationStats:
    """What happened during one generation; formatting lives elsewhere."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0  # one per iteration; the prompt's prefill is not counted
    draft_forwards: int = 0
    drafted: int = 0  # draft depth summed over iterations: drafted tokens for chains, deepest path for trees
    accepted: int = 0
    iterations: int = 0
    tree_nodes: list[int] = field(default_factory=list)  # draft tokens the target scored, per iteration
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)  # accepted count per iteration
    gammas: list[int] = field(default_factory=list)  # draft length asked for per iteration
    # per iteration: what proposed the draft ("lookup+model", "none" ...)
    drafters: list[str] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # per iteration: the draft's depth (its deepest path)
    # per source ("model", "lookup"): [nodes verification reached, accepted]
    source_trials: dict[str, list[int]] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens whose cache entries an earlier generation had computed (prefix reuse)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    def record(self, drafted: int, accepted: int, gamma: int, nodes: int | None = None,
               drafter: str | None = None) -> None:
        """drafted: the draft's depth (its length for a chain); nodes: its size (default: drafted);
        drafter: what proposed it."""
        self.iterations += 1
        self.depths.append(drafted)
        if drafter is not None:
            self.drafters.append(drafter)
        self.tree_nodes.append(drafted if nodes is None else nodes)
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_lengths.append(accepted)
        self.gammas.append(gamma)
        grow = drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < accepted

    def record_trials(self, draft: Draft, path: list[int]) -> None:
        """Count, per source, the nodes verification reached and those it accepted."""
        for node, accepted in tree.trials(draft.parent_list, path):
            for kind in {kind for kind, _ in draft.sources[node]}:
                counts = self.source_trials.setdefault(kind, [0, 0])
                counts[0] += 1
                counts[1] += accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of the drafts offering a token at position i whose first i + 1 tokens were all accepted."""
        return [a / d for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_target_forward(self) -> float | None:
        return self.generated_tokens / self.target_forwards if self.target_forwards else None

    @property
    def tokens_per_second(self) -> float | None:
        # end to end, prefill included: what the user waits for
        return self.generated_tokens / self.total_seconds if self.total_seconds > 0 else None

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "iterations": self.iterations,
            "tree_nodes": self.tree_nodes,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "accepted_lengths": self.accepted_lengths,
            "gammas": self.gammas,
            "drafters": self.drafters,
            "depths": self.depths,
            "source_trials": self.source_trials,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "tokens_per_second": self.tokens_per_second,
            "cached_tokens": self.cached_tokens,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
        }
