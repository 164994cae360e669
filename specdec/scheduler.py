"""How deep to draft when many generations share each forward.

Alone, a verify of γ + 1 tokens costs about one step, so drafting pays. In a batch of B rows the
target already scores B tokens per step, and a verify of B(γ + 1) is no longer free: on a CPU,
t_target(k) grows with k. `BatchDepth` picks the γ that maximises expected tokens per second for
the batch from measured costs (Leviathan et al.'s walltime formula with measured t(k)) and the
acceptance rate observed so far.

Losslessness: the choice depends only on past verified outcomes (acceptance counts of earlier
iterations, any request's) and on timings, never on target probabilities of tokens not yet
verified (DESIGN pitfall 14); given γ, every iteration is lossless.
"""

from __future__ import annotations

import bisect
import time

from specdec.drafters import ModelDrafter
from specdec.engine import AdaptiveGamma
from specdec.runtime import CausalLM

PREFIX = 32  # tokens cached before a timed forward: a short context, as in serving
PROBE_EVERY = 64  # steps without drafting before one step drafts a token, to keep the acceptance estimate current
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def measure_costs(model: CausalLM, sizes: tuple[int, ...] = SIZES, repeats: int = 3) -> dict[int, float]:
    """Seconds of one forward of k new tokens after a short cached prefix, logits for every one of
    them (as a verify needs), for each k in `sizes` (those that fit the context): the minimum over
    `repeats` interleaved rounds, robust to noise."""
    sizes = tuple(k for k in sizes if PREFIX + k <= model.max_length)
    best = {k: float("inf") for k in sizes}
    sequence = model.sequence()
    try:
        sequence.forward([i % model.vocab_size for i in range(PREFIX)], last=1)
        for _ in range(repeats):
            for k in sizes:
                started = time.perf_counter()
                sequence.forward([(7 * i) % model.vocab_size for i in range(k)])
                best[k] = min(best[k], time.perf_counter() - started)
                sequence.truncate(PREFIX)
    finally:
        sequence.release()
    return best


def interpolate(costs: dict[int, float], k: int) -> float:
    """t(k) by linear interpolation between measured sizes; beyond the largest, linear in k."""
    sizes = sorted(costs)
    if k <= sizes[0]:
        return costs[sizes[0]]
    if k >= sizes[-1]:
        return costs[sizes[-1]] * k / sizes[-1]
    i = bisect.bisect_left(sizes, k)
    low, high = sizes[i - 1], sizes[i]
    return costs[low] + (costs[high] - costs[low]) * (k - low) / (high - low)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens per iteration with γ drafts each accepted with probability α (Leviathan et al.)."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


class BatchDepth:
    """The draft depth for a batch of B rows: argmax over γ ≤ max_gamma of
    B · E[tokens](α, γ) / (t_target(B(γ + 1)) + γ · t_draft(B)).

    t_draft is None for drafters that run no model (lookup, n-gram): their cost is not modelled.
    A tree counts as `nodes_per_level` nodes per level for the target and as a chain for E[tokens]:
    a conservative estimate.
    α starts at `prior` and follows the acceptance of the last iterations (`observe`)."""

    def __init__(self, target_costs: dict[int, float], draft_costs: dict[int, float] | None, max_gamma: int,
                 prior: float = 0.6, memory: int = 256):
        self.target_costs, self.draft_costs, self.max_gamma = target_costs, draft_costs, max_gamma
        self.drafted, self.accepted = memory / 16, prior * memory / 16  # a weak prior: a few iterations' worth
        self.memory = memory
        self.idle = 0  # steps since the last one that drafted
        self.nodes_per_level = 1  # a tree's width: the target scores up to that many nodes per draft level

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        """One iteration's outcome; older ones fade so the estimate follows the traffic."""
        fade = max(0.0, 1 - drafted / self.memory)
        self.drafted = self.drafted * fade + drafted
        self.accepted = self.accepted * fade + accepted

    def rate(self, batch: int, gamma: int) -> float:
        """Expected tokens per second for the batch at depth γ."""
        seconds = interpolate(self.target_costs, batch * (gamma * self.nodes_per_level + 1))
        if gamma and self.draft_costs:
            seconds += gamma * interpolate(self.draft_costs, batch)
        return batch * expected_tokens(self.alpha, gamma) / seconds

    def depth(self, batch: int) -> int:
        """The best γ for this batch size. When that is 0 for PROBE_EVERY steps in a row, one step
        drafts 1, so that α keeps being measured (a fixed schedule: still lossless)."""
        best = max(range(self.max_gamma + 1), key=lambda gamma: (self.rate(batch, gamma), -gamma))
        self.idle = 0 if best else self.idle + 1
        if self.idle >= PROBE_EVERY and self.max_gamma:
            self.idle = 0
            return 1
        return best


def batch_depth(decoder) -> BatchDepth | None:
    """A BatchDepth for a SpeculativeDecoder, its costs measured now (None: it does not draft)."""
    if decoder.drafter is None:
        return None
    drafter = decoder.drafter
    draft_costs = measure_costs(drafter.model) if isinstance(drafter, ModelDrafter) else None
    max_gamma = AdaptiveGamma().high if decoder.gamma == "auto" else decoder.gamma
    depth = BatchDepth(measure_costs(decoder.target), draft_costs, max_gamma)
    if isinstance(drafter, ModelDrafter) and drafter.tree is not None:
        depth.nodes_per_level = drafter.tree.width
    return depth
