"""One loop: propose -> verify -> commit/rollback. Plain decoding is the same loop with no drafts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from specdec import tree
from specdec.drafters.base import Drafter, empty_draft
from specdec.errors import SpecDecError
from specdec.runtime import CausalLM, Sequence
from specdec.sampling import RandomStreams, probs_from_logits
from specdec.types import Draft, GenerationStats, SamplingParams
from specdec.verify import verify_tree, verify_tree_greedy


class FixedGamma:
    """Always draft `gamma` tokens."""

    def __init__(self, gamma: int):
        if gamma < 0:
            raise SpecDecError("gamma must be >= 0")
        self.gamma = gamma

    def update(self, drafted: int, accepted: int) -> None:
        pass

    def __repr__(self) -> str:
        return str(self.gamma)


class AdaptiveGamma:
    """Grow after a fully accepted draft, shrink after a rejection in its first half."""

    def __init__(self, start: int = 4, low: int = 1, high: int = 16):
        if not 1 <= low <= start <= high:
            raise SpecDecError("adaptive gamma needs 1 <= low <= start <= high")
        self.gamma, self.low, self.high = start, low, high

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:  # the drafter had nothing to say: no evidence about gamma
            return
        if accepted == drafted:
            self.gamma = min(self.high, self.gamma + 1)
        elif accepted < drafted / 2:
            self.gamma = max(self.low, self.gamma - 1)

    def __repr__(self) -> str:
        return "auto"


@dataclass
class StepResult:
    """The tokens one iteration committed, and why generation ended there (None: it goes on)."""

    tokens: list[int]
    finish_reason: str | None = None


def decode(
    target: CausalLM,
    drafter: Drafter | None,
    prompt: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    gamma_policy,
    streams: RandomStreams,
    stats: GenerationStats,
    stop_tokens: frozenset[int] = frozenset(),
) -> Iterator[StepResult]:
    """Yield what each iteration commits; the last yield carries a finish reason.

    Invariant at the top of every iteration: the target's sequence holds context[:-1]; the last
    committed token is fed together with the next draft (a chain or a tree), so accepted tokens
    are never recomputed. A tree's depth, not its size, is bounded by the gamma policy.
    The generation owns one sequence slot of the target, released when it ends; the drafter is
    reset at both ends.
    """
    sequence = target.sequence()
    try:
        yield from _decode(target, sequence, drafter, prompt, sampling, max_new_tokens, gamma_policy, streams, stats, stop_tokens)
    finally:  # the caches go back to their models (llama.cpp's cells are shared by all sequences)
        sequence.release()
        if drafter is not None:
            drafter.reset()


def _decode(target, sequence: Sequence, drafter, prompt, sampling, max_new_tokens, gamma_policy, streams, stats, stop_tokens):
    context = list(prompt)
    room = min(max_new_tokens, target.max_length - len(context))
    if drafter is not None:
        drafter.reset()
    started = time.perf_counter()
    if len(context) > 1:  # the prefill is not counted in target_forwards: those are per iteration
        sequence.forward(context[:-1], last=1)
    stats.prefill_seconds = time.perf_counter() - started
    generated = 0
    while generated < room:
        # 1. draft; γ never asks for more than the room left (the verify adds one token itself),
        #    nor for positions that one forward with the root cannot score exactly
        gamma = min(gamma_policy.gamma, room - generated - 1, target.verify_room(len(context) - 1)) if drafter is not None else 0
        tick = time.perf_counter()
        draft = drafter.propose(context, gamma, sampling, streams.draft) if gamma > 0 else empty_draft()
        draft = draft.first(target.max_length - len(context))  # a tree's nodes take cache slots too
        depth = _check_draft(draft, gamma, target.vocab_size, sampling)
        tock = time.perf_counter()
        # 2. one target forward scores the last committed token and every draft node
        logits = _score(sequence, context[-1], draft)  # [len(draft) + 1, vocab]
        result = _verify(draft, logits, sampling, streams)
        # 3. drop the rejected nodes: the cache keeps context[:-1] + last + the accepted path, contiguous
        if len(draft):
            kept = sequence.cache_len - len(draft)
            sequence.keep(kept, [kept + node for node in result.path])
        stats.target_forwards += 1
        stats.draft_forwards = drafter.forwards if drafter is not None else 0
        stats.draft_seconds += tock - tick
        stats.verify_seconds += time.perf_counter() - tock
        stats.record(depth, result.accepted, gamma, nodes=len(draft))
        gamma_policy.update(depth, result.accepted)
        # 4. commit, cutting at a stop token or at the length limit
        step = _commit(result.tokens, room - generated, stop_tokens)
        context += step.tokens
        generated += len(step.tokens)
        if step.finish_reason is None and generated >= room:
            step.finish_reason = "length"
        yield step
        if step.finish_reason:
            return
    yield StepResult([], "length")


def _check_draft(draft: Draft, gamma: int, vocab_size: int, sampling: SamplingParams) -> int:
    """A drafter's contract, checked because a broken drafter would silently break losslessness.
    Returns the draft's depth."""
    tree.check_parents(draft.parents)
    depth = draft.depth
    if depth > gamma:
        raise ValueError(f"the drafter proposed {depth} tokens deep; at most {gamma} were asked for")
    if draft.probs is not None and not sampling.greedy and tuple(draft.probs.shape) != (len(draft), vocab_size):
        raise ValueError(f"draft probs must be [{len(draft)}, {vocab_size}], got {list(draft.probs.shape)}")
    return depth


def _score(sequence: Sequence, last: int, draft: Draft) -> torch.Tensor:
    """Feed the last committed token (the root) and the draft's nodes in one forward, as a tree."""
    if not len(draft):  # plain decoding: one token, continuing the chain
        return sequence.forward([last])
    root = sequence.cache_len
    parents = [root - 1] + tree.entries(draft.parents, root).tolist()
    return sequence.forward([last] + draft.tokens.tolist(), parents)


def _verify(draft: Draft, logits: torch.Tensor, sampling: SamplingParams, streams: RandomStreams):
    if sampling.greedy:
        return verify_tree_greedy(draft.tokens, draft.parents, logits)
    target_probs = probs_from_logits(logits, sampling)  # [len(draft) + 1, vocab]
    return verify_tree(draft.tokens, draft.parents, draft.probs, target_probs, streams.accept, streams.recover)


def _commit(tokens: list[int], room: int, stop_tokens: frozenset[int]) -> StepResult:
    for i, token in enumerate(tokens[:room]):
        if token in stop_tokens:  # EOS inside accepted tokens ends generation there (pitfall 7)
            return StepResult(tokens[:i], "stop")
    return StepResult(tokens[:room])
