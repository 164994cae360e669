"""One loop: propose -> verify -> commit/rollback. Plain decoding is the same loop with no drafts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Iterator

import torch

from specdec import tree
from specdec.costs import LiveCosts
from specdec.penalties import RowShaper
from specdec.drafters.base import ChainSource, Drafter, DraftRequest, DraftSlot, attempt, empty_draft
from specdec.policy import CostFollowing, DraftPolicy
from specdec.runtime import CachedSequence, CausalLM
from specdec.runtime.base import Feed
from specdec.runtime.prefix import PrefixCache
from specdec.sampling import RandomStreams, StepNoise, probs_from_logits
from specdec.types import Draft, GenerationStats
from specdec.params import SamplingParams
from specdec.verify import verify_tree, verify_tree_coupled, verify_tree_greedy

# prompt tokens per prefill forward, on every path (a server feeds one such chunk per job and round
# between batch steps; a lone generation feeds them back to back): a prompt is cut in the same places
# however it is served, and so computes the same cache (llama.cpp's forwards hold 128 tokens too)
PREFILL_CHUNK = 128


@dataclass
class StepResult:
    """The tokens one iteration committed, and why generation ended there (None: it goes on).
    drafted / accepted: the draft's depth and how many of its tokens were kept. logprobs (when the
    state asks for them): per token, its log-probability under the target and the most likely
    alternatives, as `TokenLogprob`s. error: what ended this row alone (its drafting or its
    verification failed; finish_reason "error"), the other rows of the step going on."""

    tokens: list[int]
    finish_reason: str | None = None
    drafted: int = 0
    accepted: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: Exception | None = None

    @classmethod
    def failed(cls, error: Exception) -> StepResult:
        return cls([], "error", error=error)


@dataclass
class TokenLogprob:
    """The target's own log-probability (its raw logits, before any sampling transform) of an
    emitted token, and the `top` most likely tokens at that position as (token, log-probability)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class DecodeState:
    """One generation between steps: everything `Engine.step` needs for its row of a batch.

    Invariant between steps (while `sequence` is open): the target's sequence holds context[:-1];
    the last committed token is fed together with the next draft (a chain or a tree), so accepted
    tokens are never recomputed.
    """

    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    gamma_policy: DraftPolicy  # how deep to draft, per step
    streams: RandomStreams
    stats: GenerationStats = field(default_factory=GenerationStats)
    stop_tokens: frozenset[int] = frozenset()
    context: list[int] = field(default_factory=list)
    # tokens this generation may emit in all: max_new_tokens, capped by the context left when it opened
    token_limit: int = 0
    generated: int = 0
    finish_reason: str | None = None
    sequence: CachedSequence | None = None  # the target's slot
    draft_slot: DraftSlot | None = None
    logprobs: int | None = None  # report each token's log-probability and this many alternatives (None: no)
    # the request's own chain sources (a prediction, its history), for the default drafter
    chains: tuple[ChainSource, ...] = ()
    scope: Hashable = None  # who may reuse the cache it leaves (`specdec.scopes`)
    # what changes the target's rows before verification, each row on its own path, in order: penalties and
    # a bias, then a constraint's mask (structured outputs); each follows the committed text
    shapers: tuple[RowShaper, ...] = ()


class Engine:
    """Runs generations in steps over one target and one drafter (or none: plain decoding).

    `open` prefills a generation, `step` advances a whole batch of them by one iteration each:
    drafts for every row (draft-model forwards shared across rows), one target forward scoring
    every row's chain or tree, then per-row verification and commit; `close` gives the slots back.
    A tree's depth, not its size, is bounded by the gamma policy.
    """

    def __init__(self, target: CausalLM, drafter: Drafter | None, prefixes: PrefixCache | None = None):
        """prefixes: finished generations' target sequences, kept; a new one starts from the
        longest prefix it shares with them."""
        self.target, self.drafter, self.prefixes = target, drafter, prefixes
        self.reads_states = keep_target_states(target, drafter)

    def open(self, state: DecodeState) -> None:
        """Start a generation with its prompt prefilled."""
        self.start(state)
        while state.finish_reason is None and not self.prefill(state):
            pass

    def start(self, state: DecodeState) -> None:
        """Take the generation's slots; its prompt is not fed yet (`prefill`)."""
        state.context = list(state.prompt)
        state.token_limit = min(state.max_new_tokens, self.target.max_length - len(state.context))
        # a drafter that reads states gets one from the prefill: at least one prompt token is fed
        reusable = state.context[:-1] if self.reads_states else state.context
        state.sequence = (self.prefixes.take(reusable, state.scope) if self.prefixes is not None
                          else self.target.sequence())
        state.stats.cached_tokens = state.sequence.cache_len
        try:
            if self.drafter is not None:
                state.draft_slot = self.drafter.open(state.context)
        except BaseException:
            self.close(state)
            raise
        if state.token_limit <= 0:
            state.finish_reason = "length"

    def prefill(self, state: DecodeState) -> bool:
        """Feed the next PREFILL_CHUNK prompt tokens to the target, and as many to the draft model;
        True once the whole prompt is in (all but its last token, which the first step feeds). Not
        counted in target_forwards: those are per iteration."""
        started = time.perf_counter()
        fed = state.sequence.cache_len  # invariant while prefilling: the cache holds context[:fed]
        count = min(PREFILL_CHUNK, len(state.context) - 1 - fed)
        try:
            if count > 0:
                state.sequence.forward(state.context[fed : fed + count], last=1)
                if self.reads_states:  # the states of the chunk's last tokens (its last, or all of it)
                    states = state.sequence.states
                    self.drafter.observe(state.draft_slot, fed + count - len(states), states)
            drafter_done = self.drafter is None or self.drafter.prefill(state.draft_slot, PREFILL_CHUNK)
        except BaseException:
            self.close(state)
            raise
        state.stats.prefill_seconds += time.perf_counter() - started
        return drafter_done and state.sequence.cache_len >= len(state.context) - 1

    def run(self, state: DecodeState) -> Iterator[StepResult]:
        """One generation alone (a batch of one), opened here; the slots are given back however the
        iteration ends. The last result carries a finish reason."""
        self.open(state)
        failed = False
        try:
            if state.finish_reason:
                yield StepResult([], state.finish_reason)
            while state.finish_reason is None:
                result = self.step([state])[0]
                if result.error is not None:
                    failed = True
                    raise result.error
                yield result
        finally:
            self.close(state, failed)

    def close(self, state: DecodeState, failed: bool = False) -> None:
        """Give the slots back (llama.cpp's cells are shared by all sequences) and, unless the
        generation failed, keep the target's committed text where there is a prefix cache and tell
        the chain sources what the generation committed; safe to repeat."""
        sequence, slot = state.sequence, state.draft_slot
        state.sequence = state.draft_slot = None
        try:
            if sequence is not None:
                if self.prefixes is not None and not failed:
                    # the cache holds context[:-1] (a prompt being prefilled: its first cache_len
                    # tokens), and nodes past a stop token that cut the last step's tokens
                    self.prefixes.put(sequence, state.context[: min(sequence.cache_len, len(state.context) - 1)],
                                      state.scope)
                else:
                    sequence.release()
                for chain in state.chains if not failed else ():
                    chain.end(state.context)
        finally:
            if slot is not None:
                self.drafter.close(slot)

    def step(self, states: list[DecodeState], gamma_cap: int | None = None) -> list[StepResult]:
        """One iteration for every state (each open and unfinished). gamma_cap bounds every row's
        draft depth (a batch-wide policy's choice; 0 = plain decoding this step).

        A failure of one row's own work (choosing its depth, drafting, verifying) ends that row
        alone: its result carries the error and it is not fed; the others go on. A failed shared
        forward (the target's, or a draft model's for several rows) raises: every row's cache is
        then unknown."""
        gammas = [attempt(lambda: self._gamma(state, gamma_cap, len(states))) for state in states]
        noises = [StepNoise(state.streams, state.generated, self.target.vocab_size) if state.streams.keyed else None
                  for state in states]
        tick = time.perf_counter()
        drafts = self._drafts(states, gammas, noises)
        tock = time.perf_counter()
        results: list[StepResult | None] = [StepResult.failed(d) if isinstance(d, Exception) else None for d in drafts]
        live = [i for i, result in enumerate(results) if result is None]
        # one target forward scores every row's last committed token and draft nodes
        on_device = self.target.device_logits  # verification then reads the device once per row (`_verify`)
        rows = (self.target.forward_batch([_feed(states[i].sequence, states[i].context[-1], drafts[i], on_device)
                                           for i in live]) if live else [])
        for i, logits in zip(live, rows):
            outcome = attempt(lambda: self._advance(states[i], gammas[i], drafts[i], logits, noises[i]))
            results[i] = StepResult.failed(outcome) if isinstance(outcome, Exception) else outcome
        done = time.perf_counter()
        fed = sum(len(drafts[i]) + 1 for i in live)
        profiles = (state.gamma_policy.profile for state in states if _follows_costs(state.gamma_policy))
        for costs in {id(p): p for p in profiles if isinstance(p, LiveCosts)}.values():
            costs.observe(fed, done - tock)  # what this verify paid, for the policies' next choices
        for state in states:  # every row waited for the whole batch
            state.stats.draft_seconds += tock - tick
            state.stats.verify_seconds += done - tock
        return results

    def _gamma(self, state: DecodeState, cap: int | None, batch: int) -> int:
        """γ never asks for more than the tokens left to emit (the verify adds one token itself), nor for
        positions that one forward with the root cannot score exactly."""
        if self.drafter is None:
            return 0
        gamma = state.gamma_policy.depth(batch)
        if not gamma:  # most steps of a default where little pays: they ask nothing more
            return 0
        gamma = min(gamma, state.token_limit - state.generated - 1, self.target.verify_room(len(state.context) - 1))
        return max(0, gamma if cap is None else min(gamma, cap))

    def _drafts(self, states: list[DecodeState], gammas: list[int | Exception],
                noises: list[StepNoise | None]) -> list[Draft | Exception]:
        """Each row's checked draft, or the exception its own drafting raised. noises: each keyed row's
        (None: not keyed)."""
        drafts: list[Draft | Exception] = [gamma if isinstance(gamma, Exception) else empty_draft() for gamma in gammas]
        asked = [i for i, gamma in enumerate(gammas) if not isinstance(gamma, Exception) and gamma > 0]
        if asked:
            requests = [DraftRequest(states[i].draft_slot, states[i].context, gammas[i], states[i].sampling,
                                     states[i].streams.draft, states[i].gamma_policy, states[i].chains, noise=noises[i],
                                     generated=states[i].generated)
                        for i in asked]
            for i, draft in zip(asked, self.drafter.propose(requests)):
                state = states[i]
                if not isinstance(draft, Exception):  # a tree's nodes take cache slots too
                    draft = attempt(lambda: _checked(draft.first(self.target.max_length - len(state.context)),
                                                     gammas[i], self.target.vocab_size, state.sampling))
                drafts[i] = draft
        return drafts

    def _advance(self, state: DecodeState, gamma: int, draft: Draft, logits: torch.Tensor,
                 noise: StepNoise | None) -> StepResult:
        verified = logits  # logprobs stay the raw distribution's
        if state.shapers:
            tokens, parents = draft.tokens.tolist(), draft.parent_list
            for shaper in state.shapers:
                verified = shaper.shape(verified, tokens, parents)
        result = _verify(draft, verified, state.sampling, state.streams, noise)
        if self.reads_states:  # the committed rows: the root's, then the accepted nodes' (the last drew the last token)
            rows = [0] + [1 + node for node in result.path]
            self.drafter.observe(state.draft_slot, len(state.context) - 1, state.sequence.states[rows])
        # drop the rejected nodes: the cache keeps context[:-1] + last + the accepted path, contiguous
        if len(draft):
            kept = state.sequence.cache_len - len(draft)
            state.sequence.keep(kept, [kept + node for node in result.path])
        stats = state.stats
        stats.target_forwards += 1
        stats.draft_forwards = state.draft_slot.forwards if state.draft_slot is not None else 0
        stats.record(draft.depth, result.accepted, gamma, nodes=len(draft),
                     drafter=(None if self.drafter is None
                              else draft.label or (self.drafter.name if len(draft) else "none")))
        if draft.sources is not None and len(draft):
            stats.record_trials(draft, result.path)
        state.gamma_policy.update(draft, result)
        # commit, cutting at a stop token or at the length limit
        step = _commit(result.tokens, state.token_limit - state.generated, state.stop_tokens)
        for shaper in state.shapers:
            shaper.advance(step.tokens)
        state.context += step.tokens
        state.generated += len(step.tokens)
        if step.finish_reason is None and state.generated >= state.token_limit:
            step.finish_reason = "length"
        state.finish_reason = step.finish_reason
        step.drafted, step.accepted = draft.depth, result.accepted
        if state.logprobs is not None:
            step.logprobs = _logprobs(logits, result.path, step.tokens, state.logprobs)
        if step.finish_reason is None and state.draft_slot is not None:
            self.drafter.accept(state.draft_slot, step.tokens)
        return step


def keep_target_states(target: CausalLM, drafter: Drafter | None) -> bool:
    """Turn on the target's states the drafter reads of what was verified (`Drafter.observe`: a draft head's,
    the final norm's; an EAGLE-3 head's, the inputs of the layers it names); whether it reads any."""
    reads = drafter is not None and drafter.reads_target_states
    if reads:
        target.keep_states(layers=drafter.state_layers)
    return reads


def _checked(draft: Draft, gamma: int, vocab_size: int, sampling: SamplingParams) -> Draft:
    """The draft, its drafter's contract checked: a broken drafter would silently break losslessness."""
    if not len(draft):  # nothing drafted: nothing to check (most steps of a default that finds nothing to draft)
        return draft
    tree.check_parents(draft.parent_list)
    if draft.depth > gamma:
        raise ValueError(f"the drafter proposed {draft.depth} tokens deep; at most {gamma} were asked for")
    if draft.probs is not None and not sampling.greedy:
        width = vocab_size if draft.columns is None else _checked_columns(draft.columns, vocab_size)
        if tuple(draft.probs.shape) != (len(draft), width):
            raise ValueError(f"draft probs must be [{len(draft)}, {width}], got {list(draft.probs.shape)}")
    return draft


def _checked_columns(columns: torch.Tensor, vocab_size: int) -> int:
    """How many columns a draft's distributions have: distinct target ids (two columns with one id
    would make q's mass at it ambiguous and the residual's scatter undefined)."""
    if columns.dim() != 1 or columns.dtype != torch.long or not len(columns):
        raise ValueError(f"draft columns must be a non-empty [columns] int64 tensor, got {columns.dtype} "
                         f"{list(columns.shape)}")
    low, high = columns.aminmax()
    if low < 0 or high >= vocab_size:
        raise ValueError(f"draft columns must be target ids in [0, {vocab_size})")
    order = torch.arange(len(columns), dtype=torch.int32)
    owner = torch.empty(vocab_size, dtype=torch.int32)
    owner[columns] = order  # a repeated id keeps one of its columns, so another reads back wrong
    if not torch.equal(owner[columns], order):
        raise ValueError("draft columns must be distinct target ids")
    return len(columns)


def _feed(sequence: CachedSequence, last: int, draft: Draft, on_device: bool = False) -> Feed:
    """The last committed token (the root) and the draft's nodes, as a tree in one forward."""
    if not len(draft):  # plain decoding: one token, continuing the chain
        return Feed(sequence, [last], on_device=on_device)
    root = sequence.cache_len
    parents = [root - 1] + tree.entries(draft.parent_list, root)
    return Feed(sequence, [last] + draft.tokens.tolist(), parents, on_device=on_device)


def _verify(draft: Draft, logits: torch.Tensor, sampling: SamplingParams, streams: RandomStreams,
            noise: StepNoise | None = None):
    """noise: a keyed generation's, None otherwise. Logits may be on a device: the greedy verifier
    reads their argmax once; a sampled one gets the distribution, computed there, in one copy."""
    if sampling.greedy:
        return verify_tree_greedy(draft.tokens, draft.parents, logits)
    target_probs = probs_from_logits(logits, sampling).cpu()  # [len(draft) + 1, vocab]
    if noise is not None:
        if draft.probs is not None:
            raise ValueError("a generation with keyed draws verifies point-mass drafts only; "
                             "the drafter drew from a distribution")
        return verify_tree_coupled(draft.tokens, draft.parents, target_probs, noise.for_verifier)
    return verify_tree(draft.tokens, draft.parents, draft.probs, target_probs, streams.accept, streams.recover,
                       draft.columns)


def _logprobs(logits: torch.Tensor, path: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """Emitted token i was drawn at the root (i = 0) or below the i-th accepted node: its row of
    the target's logits is 0, then 1 + that node. Logits on a device are read three times, not per token."""
    rows = ([0] + [1 + node for node in path])[: len(tokens)]
    logprobs = torch.log_softmax(logits[rows].double(), dim=-1)
    device = logprobs.device
    chosen = logprobs[torch.arange(len(tokens), device=device), torch.tensor(tokens, device=device)].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    ids, values = ((best.indices.tolist(), best.values.tolist()) if best is not None
                   else ([[]] * len(tokens), [[]] * len(tokens)))
    return [TokenLogprob(token, chosen[i], list(zip(ids[i], values[i]))) for i, token in enumerate(tokens)]


def _commit(tokens: list[int], room: int, stop_tokens: frozenset[int]) -> StepResult:
    for i, token in enumerate(tokens[:room]):
        if token in stop_tokens:  # EOS inside accepted tokens ends generation there (pitfall 7)
            return StepResult(tokens[:i], "stop")
    return StepResult(tokens[:room])


_FOLLOWS_COSTS: dict[type, bool] = {}


def _follows_costs(policy) -> bool:
    """Whether the policy reads a cost profile (`CostFollowing`), checked once per type: a protocol's
    isinstance is slow, and asked every step (a protocol with an attribute has no issubclass)."""
    kind = type(policy)
    if kind not in _FOLLOWS_COSTS:
        _FOLLOWS_COSTS[kind] = isinstance(policy, CostFollowing)
    return _FOLLOWS_COSTS[kind]
