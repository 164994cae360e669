"""How much to draft: fixed, or chosen every iteration from measured costs and what was accepted.

- `FixedGamma`: always γ.
- `CostAwareDepth`: for drafters that grow their own proposals (chains, trees, staged, n-gram):
  each iteration's depth maximises expected tokens per second, Leviathan et al.'s walltime formula
  with measured t_target(k) and t_draft(k) (`specdec.costs`) and the acceptance observed so far.
- `CostAwarePolicy`: the default, for the `AutoDrafter`: node by node, a draft token joins the
  tree when the probability that it is accepted pays for what it costs (see `Budget`).
- `BatchDepth`: one depth cap for a whole batch of a fixed-γ server (rows cost more together).

Losslessness (docs/design.md, pitfall 14): every choice here is a function of the measured costs,
the batch size, outcomes of iterations already verified, and what the drafter itself computed
before the choice (its distributions and the tokens drawn from them); never of target
probabilities of tokens not yet verified. A draft token is kept or not *before* it is drawn (on
its distribution, never on the token), so each drafted token is still distributed as its stated q
given everything before it, and the verifiers' guarantee holds for any tree the policy shapes.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from itertools import accumulate, takewhile
from typing import Protocol, runtime_checkable

from specdec.analysis import expected_tokens, speedup
from specdec.costs import Profile
from specdec.errors import SpecDecError
from specdec.tree import trials
from specdec.types import Draft, VerifyResult

# deepest draft the cost-aware depth policies consider, and the draft model's deepest level in the default
MAX_DEPTH = 12
AUTO_MAX_DEPTH = 64  # deepest draft of the default: looked-up chains run as long as the match and the costs allow
PROBE_EVERY = 64  # steps without drafting before one drafts a token, to keep the acceptance estimate current
PROBE_MODEL_EVERY = 8  # iterations without a draft-model node before the auto drafter tries one anyway
# iterations without a node of a chain source (lookup, prediction, history) before the auto drafter tries it anyway ...
PROBE_CHAIN_EVERY = 8
PROBE_CHAIN_TOKENS = 8  # ... with this many tokens of its chain (fewer if it is shorter)
PROBE_MAX = 256  # the wait between probes doubles after each probe, up to this (see `Probe`)
EXPLORE_SHARE = 0.02  # the most of decoding's time that all probes together may take (`CostAwarePolicy.credit`)
# ... when sampling (unkeyed): a probe finds less there (a drawn node is accepted less often than a greedy one), and
# where nothing pays the share is what the default loses to plain decoding. Interleaved A/B, T 0.7, 4 prompts x 3:
# 1% against 2% raised the demo pair's median in 7 of 10 suite cells (transformers, llama.cpp) and lowered 2 by
# 0.4-0.5%; greedy, 1% lost up to 4% (`complete`: probes find the draft model), so greedy keeps 2%
SAMPLED_EXPLORE_SHARE = 0.01
# chain sources (free to draft, point masses; `drafters.base.ChainSource`): their first token's
# acceptance, and each next one's given the one before was accepted; a client's prediction is likelier
# right than a looked-up match, a match in this text likelier than one in earlier requests' history.
# "copy" is lookup where the text before the match repeats the last COPY_MATCH tokens or more: copying.
# On the demo pair's greedy text a copy's first token was right 84-100% of the time, a lookup's after a
# match of one token 12-26%; sampled, a point mass is accepted with the target's probability of it: at T 0.7,
# over the bench's six suites (859 copies, two runs), a copy's first token 59-61% of the time, each next one
# 68-71% (greedy: 90% and 95%; benchmarks/RESULTS.md, "Steps that draft nothing, and sampled copies"); a
# lookup's (a match of 1-3 tokens) 18% and 58% on transformers (109 drafted), 20-41% and 45-66% by match
# length at every position of plain sampled text (RESULTS.md, "Sampled lookup priced as it is accepted");
# greedy, a lookup's first token 30% of the time in place (20 drafted), 45% at every position
# "forced": what a constraint's grammar forces next (`constraints.Forced`): p_c puts nearly all its mass there
# (all of it unless the model could spell the same text in other tokens the grammar allows too)
CHAIN_PRIORS = {"lookup": (0.4, 0.8), "copy": (0.85, 0.95), "prediction": (0.7, 0.9), "history": (0.4, 0.8),
                "forced": (0.95, 0.95)}
SAMPLED_PRIORS = {"lookup": (0.2, 0.6), "copy": (0.6, 0.7), "prediction": (0.7, 0.9), "history": (0.3, 0.7),
                  "forced": (0.9, 0.9)}
# a node drawn from the draft model (sampling, unkeyed) is accepted with probability sum(min(p, q)), which its
# confidence (q's top probability) says little about: on the demo pair at T 0.7, every position of plain generations
# of the six suites (9.2k), 0.49-0.52 with a top probability under 0.4, 0.55-0.64 at 0.4-0.7, 0.69 / 0.80 / 0.93 at
# 0.7-0.8 / 0.8-0.9 / 0.9-1 (benchmarks/chain_priors.py --model). Its prior is SAMPLED_MODEL_FLOOR * (1 + confidence^2),
# at most 0.07 under those: a prior too low is never corrected (a source that does not pay is not drafted, only
# probed), one too high is, by the first drafts. (Greedy and keyed nodes: their confidence, a calibrated draft's
# chance to spell the target's token; a keyed node is chosen by the noise the target draws with, and agrees as a
# greedy one does.)
SAMPLED_MODEL_FLOOR = 0.45
COPY_MATCH = 4  # matched tokens that make a looked-up continuation "copy" (`prompt_lookup.lookup_match`)
CHAIN_MEMORY = 16  # chain sources' estimates follow recent outcomes closely: text starts and stops copying
SOURCES = ("model", *CHAIN_PRIORS)  # every source the default drafter knows
QUIET_FOR = 32  # iterations a finding of which sources pay stands while nothing is drafted (only the costs, which
# drift slowly, could move it; a verified draft moves the estimates, and the finding is made again at once)
NEGLIGIBLE = 0.005  # a chain's nodes less likely than this to be accepted are never weighed (`Budget.best_prefix`)


class DraftPolicy(Protocol):
    """What the engine asks of one generation's draft policy, every step: how deep to draft before
    it (`depth`, given how many rows the step has), and what was drafted and kept after it
    (`update`). The drafters a policy shapes (`AutoDrafter`) receive it in `DraftRequest.policy`.
    A policy that chooses from measured costs is also `CostFollowing`."""

    def depth(self, batch: int) -> int:
        ...

    def update(self, draft: Draft, result: VerifyResult) -> None:
        ...

    def finish(self) -> None:
        """The generation has ended (not by a failure): hand on what outlives it (`SharedAcceptance`)."""
        ...


@runtime_checkable
class NodePolicy(Protocol):
    """What a drafter shaped node by node (`AutoDrafter`) asks of the policy in `DraftRequest.policy`
    (`CostAwarePolicy`): a budget for this iteration's nodes, each source's chance of acceptance,
    and which sources to probe whatever their estimates say."""

    def probe_model(self, unread: int) -> bool:
        """This iteration drafts at least one model token, the draft model having `unread` committed
        tokens to read first."""
        ...

    def catch_up_cost(self, unread: int) -> float:
        """Seconds the draft model takes to read `unread` committed tokens, beyond a level's own forward."""
        ...

    def budget(self) -> Budget:
        ...

    def may_pay(self, kind: str) -> bool:
        """Whether a source is worth weighing this iteration from an empty budget: a probe of it is
        due, or its first nodes could pay (a source that could not is not looked at: its nodes would
        not be taken)."""
        ...

    def accept_probability(self, source: tuple) -> float:
        ...

    def chain_values(self, kind: str, length: int, at_least: int = 0) -> list[float]:
        """Each of a chain source's first `length` nodes' chance that it and every node before it are
        accepted, while at least NEGLIGIBLE (and for `at_least` nodes whatever they are)."""
        ...

    def model_rate(self) -> float:
        ...

    def probe_tokens(self, kind: str) -> int:
        ...


@runtime_checkable
class CostFollowing(Protocol):
    """A policy that chooses from measured costs: where its profile is a `costs.LiveCosts`, the
    engine feeds it what each verify paid (once per step, however many rows share the profile)."""

    profile: Profile


class FixedGamma:
    """Always draft `gamma` tokens."""

    def __init__(self, gamma: int):
        if gamma < 0:
            raise SpecDecError("gamma must be >= 0")
        self.gamma = gamma

    def depth(self, batch: int) -> int:
        return self.gamma

    def update(self, draft: Draft, result: VerifyResult) -> None:
        pass

    def finish(self) -> None:
        pass

    def __repr__(self) -> str:
        return str(self.gamma)


class Acceptance:
    """Accepted and offered counts that follow recent outcomes (older ones fade with `memory`);
    `rate` shrinks them toward a prior worth `weight` outcomes."""

    def __init__(self, memory: float = 256):
        self.offered, self.accepted, self.memory = 0.0, 0.0, memory

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.offered + weight)

    def observe(self, offered: int, accepted: int) -> None:
        fade = max(0.0, 1 - offered / self.memory)
        self.offered = self.offered * fade + offered
        self.accepted = self.accepted * fade + accepted


class BatchDepth:
    """The draft depth for a batch of B rows: argmax over γ ≤ max_gamma of
    B · E[tokens](α, γ) / (t_target(B(γ · width + 1)) + γ · t_draft_level(B) + overhead).

    A tree counts as `width` nodes per level for the target and as a chain for E[tokens]: a
    conservative estimate. When no drafting wins PROBE_EVERY steps in a row, one step drafts a
    single token so that α keeps being measured (a fixed schedule: still lossless)."""

    def __init__(self, profile: Profile, max_gamma: int, models_draft: bool, width: int = 1, prior: float = 0.6):
        self.profile, self.max_gamma, self.models_draft, self.width, self.prior = (
            profile, max_gamma, models_draft, width, prior)
        self.acceptance = Acceptance()
        self.idle = 0

    def finish(self) -> None:
        pass  # α is the generation's own

    @property
    def alpha(self) -> float:
        return self.acceptance.rate(self.prior, weight=16)

    def observe(self, drafted: int, accepted: int) -> None:
        self.acceptance.observe(drafted, accepted)

    def rate(self, batch: int, gamma: int) -> float:
        """Expected tokens per second for the batch at depth γ (`analysis.speedup` over a one-second step)."""
        verify = self.profile.step(batch * (gamma * self.width + 1))
        drafting = gamma * self.profile.draft_level(batch) if gamma and self.models_draft else 0.0
        return speedup(batch * expected_tokens(self.alpha, gamma), drafting, verify)

    def depth(self, batch: int) -> int:
        best = max(range(self.max_gamma + 1), key=lambda gamma: (self.rate(batch, gamma), -gamma))
        self.idle = 0 if best else self.idle + 1
        if self.idle >= PROBE_EVERY and self.max_gamma:
            self.idle = 0
            return 1
        return best


class CostAwareDepth(BatchDepth):
    """`--gamma auto` for a drafter that grows its own proposals: one generation's BatchDepth."""

    def update(self, draft: Draft, result: VerifyResult) -> None:
        if len(draft):
            self.observe(draft.depth, result.accepted)

    def __repr__(self) -> str:
        return "auto"


# ---------------------------------------------------------------- the default: node by node


BINS = 10  # confidence bins of the draft model's nodes


@dataclass
class Budget:
    """One row's iteration while it is planned: `tokens` expected from it and `seconds` it costs
    (its share of the batch step). A node of value v (the probability it is accepted, its
    ancestors' included) at marginal cost c raises tokens/second iff v / c > tokens / seconds;
    a draft level pays when the value it is expected to add does the same for its cost."""

    profile: Profile
    batch: int
    verify_size: float  # tokens the batch's verify scores so far (every row counted alike)
    tokens: float = 1.0  # the token every iteration emits
    seconds: float = 0.0

    def __post_init__(self):
        self.seconds = self.profile.step(self.verify_size) / self.batch

    def added_cost(self, nodes: int, now: float | None = None) -> float:
        """Seconds `nodes` more nodes cost this row (every row adding as many: the batch's verify grows
        B-fold); `now`: the verify's cost as it stands, where it was read already."""
        now = self.profile.step(self.verify_size) if now is None else now
        return max(1e-9 * nodes, (self.profile.step(self.verify_size + self.batch * nodes) - now) / self.batch)

    @property
    def level_cost(self) -> float:
        """This row's share of a draft level (one draft-model forward over the batch's rows)."""
        return self.profile.draft_level(self.batch) / self.batch

    def pays(self, value: float, cost: float) -> bool:
        return value > 0 and value * self.seconds > self.tokens * cost

    def take_node(self, value: float) -> bool:
        """Add a node of this value if it pays."""
        return self.take_chain([value]) == 1

    def best_prefix(self, values: list[float]) -> int:
        """How many of a chain's next nodes (values in order) maximise tokens per second, looking
        past a step in the cost curve that one node alone would not pay for."""
        # a node worth less than NEGLIGIBLE never pays for its place in a verify (nor do those after it)
        values = list(takewhile(lambda value: value >= NEGLIGIBLE, values))
        gained = [0.0, *accumulate(values)]
        # t(verify + batch · count) for every count at once; a count's added cost as `added_cost` computes it
        now, *after = self.profile.steps([self.verify_size + self.batch * count for count in range(len(values) + 1)])
        added = [0.0] + [max(1e-9 * count, (t - now) / self.batch) for count, t in enumerate(after, 1)]
        rates = [(self.tokens + gained[count]) / (self.seconds + added[count]) for count in range(len(values) + 1)]
        return max(range(len(values) + 1), key=lambda count: (rates[count], -count))

    def some_prefix_pays(self, values: list[float]) -> bool:
        """Whether `best_prefix(values)` takes any node: at once where the first node alone raises tokens per
        second (computed as `best_prefix` computes it: then one node beats none, and the best is not none),
        else weighed whole. Asked of every chain source at most iterations of the default (`depth`)."""
        if not values or values[0] < NEGLIGIBLE:
            return False
        now, after = self.profile.steps([self.verify_size, self.verify_size + self.batch])
        first = (self.tokens + values[0]) / (self.seconds + max(1e-9, (after - now) / self.batch))
        return first > self.tokens / self.seconds or self.best_prefix(values) > 0

    def take_chain(self, values: list[float], at_least: int = 0) -> int:
        """Add the `best_prefix` of a chain's next nodes, or at least `at_least` of them (a probe);
        returns the count."""
        best = max(self.best_prefix(values), min(at_least, len(values)))
        if best:
            self.tokens += sum(values[:best])
            self.seconds += self.added_cost(best)
            self.verify_size += self.batch * best
        return best

    def take_level(self, expected_value: float, nodes: int, reading: float = 0.0) -> bool:
        """Pay for a draft-model forward that is expected to add this much value in `nodes` nodes,
        and `reading` seconds more (this iteration's share of the draft model's catching up)."""
        cost = self.level_cost + reading + self.added_cost(nodes)
        if not self.pays(expected_value, cost):
            return False
        self.seconds += self.level_cost + reading
        return True


@dataclass
class Probe:
    """When to try a source that the estimates say does not pay: after `wait` iterations without
    it, one iteration drafts it anyway (`due`). A probe is worth its cost only if it changes what
    the estimates choose: the wait doubles after every probe, up to PROBE_MAX, and starts over
    once the source is drafted of its own accord (its estimate pays again). So a source that is
    accepted but still does not pay for itself (a draft model right 60% of the time where a verify
    is dear) is probed ever more rarely, not every `every` iterations for ever. A schedule fixed
    by past iterations' verified outcomes and the policy's own choices: still lossless."""

    every: int
    wait: int = 0
    idle: int = 0  # iterations since the source was last drafted
    due: bool = False
    not_before: float = 0.0  # idle iterations the probe's own cost asks for (see `CostAwarePolicy.probe_model`)

    def __post_init__(self):
        self.wait = self.every

    def start(self, enabled: bool = True) -> None:
        """A new iteration begins."""
        self.due = enabled and self.idle >= max(self.wait, self.not_before)

    def observe(self, tried: bool, iterations: int = 1) -> None:
        """The last `iterations` iterations tried the source (one) or did not."""
        if tried:
            self.wait = min(PROBE_MAX, 2 * self.wait) if self.due else self.every
        self.idle = 0 if tried else self.idle + iterations


class CostAwarePolicy:
    """The default policy: decides each iteration how deep and how wide to draft and from which
    source (the `AutoDrafter` asks it node by node, through a `Budget`).

    It keeps, for one generation, the probability that a node is accepted given its parent was:
    for the draft model by confidence bin (its probability of the node's token in greedy mode or of
    its most likely token when sampling, known before the draw); for each chain source (prompt
    lookup, a prediction, the history), one for its first token and one for each next token given
    the one before was accepted (in copied text they run long; when copying stops the first one
    drops within a few iterations). Priors: a calibrated draft model; CHAIN_PRIORS for chains. A
    source whose estimate does not pay is tried anyway on a `Probe` schedule (`explore`; the draft
    model is always probed), so that it is found when the text starts copying, on machines where a
    long verify is dear and the priors alone would never draft."""

    def __init__(self, profile: Profile, max_depth: int = AUTO_MAX_DEPTH, explore: bool = True,
                 shared: SharedAcceptance | None = None, sources: tuple[str, ...] = SOURCES, sampled: bool = False,
                 keyed: bool = False):
        """sources: the kinds this generation drafts from (the drafter's, the request's chains');
        sampled: the generation samples (its chains' priors are SAMPLED_PRIORS); keyed: by position,
        its draft model's nodes chosen by the target's noise (their prior stays the greedy one)."""
        self.profile, self.max_depth, self.explore, self.shared = profile, max_depth, explore, shared
        self.chain_priors = SAMPLED_PRIORS if sampled else CHAIN_PRIORS
        # its draft model's nodes are drawn from q, not chosen (priced by `model_prior`), and its verifier tries a
        # node's children in order, each against what the earlier ones left (`verify_tree`): a child is tried
        # only once its earlier siblings are rejected (`tree.trials`)
        self.draws = sampled and not keyed
        self.explore_share = SAMPLED_EXPLORE_SHARE if self.draws else EXPLORE_SHARE
        self.acceptance: dict[tuple, Acceptance] = {}
        self.batch = 1
        self.probes = {kind: Probe(PROBE_MODEL_EVERY if kind == "model" else PROBE_CHAIN_EVERY) for kind in sources}
        # the sources that could pay (`_paying_sources`; None: not asked yet), and for how many more iterations
        # that finding stands (`depth`)
        self.paying: frozenset[str] | None = None
        self.pays_for = 0
        self._pays_for_key: tuple | None = None  # what `paying` was last computed from (`_paying_sources`)
        self.steady_for = 0  # iterations `depth` answers as it last did without looking again (`_steady_for`)
        self.waited = 0  # iterations that drafted nothing since the probes' idle counts were last moved (`_waits`)
        self._answer = 0  # what it last answered
        self.credit = 0.0  # seconds the probes may still take: `explore_share` of each iteration accrues
        self._accruals: dict[int, float] = {}  # batch -> credit per iteration (`_accrual`)
        if shared is not None:
            shared.seed(self)

    def probe_model(self, unread: int) -> bool:
        """This iteration drafts at least one model token, whatever the estimates say: the probe is
        due and the credit pays for what it costs with `unread` committed tokens to read first
        (`_model_probe_cost`); else it is not due again before the credit would. Asked once per
        iteration, after `depth`."""
        probe = self._waits()["model"]
        if probe.due:
            probe.due = self._affords(probe, self._model_probe_cost(unread))
        return probe.due

    def catch_up_cost(self, unread: int) -> float:
        return self.profile.reading(unread)

    def probe_tokens(self, kind: str) -> int:
        """Tokens of a chain source's chain this iteration drafts at least (when it has one)."""
        probe = self._waits().get(kind)
        if probe is None or not probe.due or not self._affords(probe, self._chain_probe_cost()):
            return 0
        return PROBE_CHAIN_TOKENS

    def depth(self, batch: int) -> int:
        """Called once per iteration, before drafting: 0 when no probe is due and no source could
        pay for a node (then the drafter is not asked: a step that drafts nothing costs what a
        plain one does), else max_depth and the drafter shapes the draft node by node."""
        if batch != self.batch:
            self.pays_for = self.steady_for = 0  # a row's share of the verify moved
        self.batch = batch
        self.credit += self._accrual()
        if self.steady_for:  # nothing it reads has moved since it last looked (`_steady_for`)
            self.steady_for -= 1
            self.pays_for -= 1
            return self._answer
        for kind, probe in self._waits().items():
            probe.start(kind == "model" or self.explore)
            if probe.due:  # due only once the credit could pay for it (a model probe's reading is asked later)
                cost = self._model_probe_cost(0) if kind == "model" else self._chain_probe_cost()
                probe.due = self._affords(probe, cost, spend=False)
        if not self.pays_for:
            key = self._pays_key()
            if key != self._pays_for_key:  # the finding is a function of these: computed again only when they move
                self.paying, self._pays_for_key = self._paying_sources(), key
            self.pays_for = QUIET_FOR
        self.pays_for -= 1
        due = any(probe.due for probe in self.probes.values())
        self._answer = self.max_depth if self.paying or due else 0
        self.steady_for = 0 if due else self._steady_for()
        return self._answer

    def _steady_for(self) -> int:
        """For how many of the next iterations `depth` would answer as now, with no probe due, if
        they draft nothing (`update` ends the count when one does): while the finding of which
        sources pay stands (`pays_for`) and before any probe's wait is over (each probe's idle count
        grows by one an iteration, the credit as it accrues). So the steps that draft nothing, most
        of them where little pays, spend almost no time here: host time is what they add to a
        plain step."""
        waits = [math.ceil(max(probe.wait, probe.not_before)) - probe.idle - 1
                 for kind, probe in self.probes.items() if kind == "model" or self.explore]
        return max(0, min([self.pays_for, *waits]))

    def _pays_key(self) -> tuple:
        """Everything `_paying_sources` reads: the batch, the costs' revision and each source's estimates."""
        chains = sorted(self.probes.keys() & CHAIN_PRIORS.keys())
        return (self.batch, self.profile.revision, self.model_rate() if "model" in self.probes else None,
                *(self.accept_probability((kind, index)) for kind in chains for index in (0, 1)))

    def _paying_sources(self) -> frozenset[str]:
        """The sources whose first nodes pay from an empty budget, by the estimates alone (as the
        drafter decides, and before it reads a chain's tokens or the model's distribution: their
        values are what count). A level of the draft model counts without its catching up, a chain at
        the longest: a shorter one pays only if some prefix of the longest does."""
        model = {"model"} if "model" in self.probes and self.budget().take_level(self.model_rate(), 1) else set()
        empty = self.budget()  # asked of every chain source, never taken from (`some_prefix_pays` only reads it)
        return frozenset(model | {kind for kind in self.probes.keys() & CHAIN_PRIORS.keys()
                                  if empty.some_prefix_pays(self.chain_values(kind, self.max_depth))})

    def may_pay(self, kind: str) -> bool:
        """As `depth` last found (held as it holds it), or a probe of the source is due; before any
        `depth`, every source."""
        probe = self.probes.get(kind)
        return self.paying is None or kind in self.paying or (probe is not None and probe.due)

    # ---- the credit: probes of every source together take at most `explore_share` of decoding's time.
    # A probe is made when it is due (`Probe`) and the credit pays for it: where a verify is nearly
    # free probes cost little and are made on schedule; where it is dear (llama.cpp's CPU kernels,
    # a verify of 2 at 2.4 steps) rarely, and a short generation may make none.

    def _accrual(self) -> float:
        """Credit each iteration adds: `explore_share` of this row's share of a plain step (as measured:
        live costs keep its scale, so it is a function of the batch alone, kept per batch)."""
        accrual = self._accruals.get(self.batch)
        if accrual is None:
            plain_step = Profile.step(self.profile, self.batch)
            accrual = self._accruals[self.batch] = max(1e-12, self.explore_share * plain_step / self.batch)
        return accrual

    def _affords(self, probe: Probe, cost: float, spend: bool = True) -> bool:
        """Whether the credit pays for a probe that costs this much (and, with `spend`, pays);
        if not, the probe is not due again before the credit would."""
        if self.credit < cost:
            probe.not_before = probe.idle + (cost - self.credit) / self._accrual()
            return False
        self.credit -= cost if spend else 0.0
        return True

    def _chain_probe_cost(self) -> float:
        return self.budget().added_cost(PROBE_CHAIN_TOKENS)

    def _model_probe_cost(self, unread: int) -> float:
        """The draft model's reading of the `unread` committed tokens it has not seen (a whole
        prompt, the first time), a level, and one more node in the verify (with live costs, the
        slowdown after it too)."""
        return self.catch_up_cost(unread) + self.profile.draft_level(1) / self.batch + self.budget().added_cost(1)

    def budget(self) -> Budget:
        return Budget(self.profile, self.batch, self.batch)

    def accept_probability(self, source: tuple) -> float:
        kind, index = source
        observed = self._acceptance(source)
        if kind == "model":
            return observed.rate(model_prior((index + 0.5) / BINS, self.draws), weight=4)
        return observed.rate(self.chain_priors[kind][min(index, 1)], weight=2)

    def chain_values(self, kind: str, length: int, at_least: int = 0) -> list[float]:
        # a chain's nodes after its first share one estimate (`_acceptance`): asked twice, not once a node
        first, each_next = self.accept_probability((kind, 0)), self.accept_probability((kind, 1))
        values, value = [], first
        for position in range(length):
            if value < NEGLIGIBLE and position >= at_least:
                break
            values.append(value)
            value *= each_next
        return values

    def model_rate(self) -> float:
        """Acceptance of the draft model's nodes over all confidences: the guess for a level not drafted yet."""
        rates = [a for key, a in self.acceptance.items() if key[0] == "model"]
        prior = model_prior(0.6, self.draws)
        return (sum(a.accepted for a in rates) + prior * 4) / (sum(a.offered for a in rates) + 4)

    def update(self, draft: Draft, result: VerifyResult) -> None:
        """Every node verification tried was a trial of its sources: accepted iff on the path."""
        if not len(draft):  # nothing was tried: every probe waits one iteration more (`_waits`)
            self.waited += 1
            return
        self.steady_for = 0  # a source was drafted: its probe starts over, and `depth` looks again
        for kind, probe in self._waits().items():
            probe.observe(any(k == kind for node in draft.sources or () for k, _ in node))
        if draft.sources is None:
            return
        self.pays_for = 0  # the estimates move: whether a source pays is asked again
        for node, accepted in trials(draft.parent_list, result.path, self.draws):
            for source in draft.sources[node]:
                self._acceptance(source).observe(1, accepted)

    def finish(self) -> None:
        if self.shared is not None:
            self.shared.absorb(self)

    def _waits(self) -> dict[str, Probe]:
        """The probes, each having waited the iterations that drafted nothing since last asked: counted
        as one number until then, so that such an iteration touches no probe."""
        if self.waited:
            for probe in self.probes.values():
                probe.observe(False, self.waited)
            self.waited = 0
        return self.probes

    def _acceptance(self, source: tuple) -> Acceptance:
        """The counts behind a source's estimate: a chain source's positions after the first share one."""
        kind, index = source
        key = (kind, min(index, 1)) if kind in CHAIN_PRIORS else source
        if key not in self.acceptance:
            self.acceptance[key] = Acceptance(memory=CHAIN_MEMORY if kind in CHAIN_PRIORS else 64)
        return self.acceptance[key]

    def __repr__(self) -> str:
        return "auto"


class SharedAcceptance:
    """Acceptance counts carried across the generations of one server: a new generation's policy
    starts from them, worth at most `weight` outcomes per source (its own outcomes soon outweigh
    them), and a finished one adds what it saw, older generations fading with `memory`. Earlier
    requests' verified outcomes only: still lossless. Thread-safe: policies are made where
    requests are checked (the event loop, its thread pool) and finished on the batch thread."""

    def __init__(self, weight: float = 8, memory: float = 256):
        self.weight, self.memory = weight, memory
        self._counts: dict[tuple, tuple[float, float]] = {}  # source -> (offered, accepted)
        self._lock = threading.Lock()

    def seed(self, policy: CostAwarePolicy) -> None:
        with self._lock:
            counts = dict(self._counts)
        for source, (offered, accepted) in counts.items():
            scale = min(1.0, self.weight / offered) if offered else 0.0
            acceptance = policy._acceptance(source)
            acceptance.offered, acceptance.accepted = offered * scale, accepted * scale

    def absorb(self, policy: CostAwarePolicy) -> None:
        with self._lock:
            for source, acceptance in policy.acceptance.items():
                offered, accepted = self._counts.get(source, (0.0, 0.0))
                fade = max(0.0, 1 - acceptance.offered / self.memory)
                self._counts[source] = (offered * fade + acceptance.offered, accepted * fade + acceptance.accepted)

    def rates(self) -> dict[tuple, float]:
        """Each source's accepted share so far."""
        with self._lock:
            return {source: accepted / offered for source, (offered, accepted) in self._counts.items() if offered}


def model_prior(confidence: float, drawn: bool) -> float:
    """A draft-model node's chance of acceptance before any is observed, at this confidence: the
    confidence itself (greedy, keyed), or for a drawn node SAMPLED_MODEL_FLOOR * (1 + confidence^2)."""
    return SAMPLED_MODEL_FLOOR * (1 + confidence ** 2) if drawn else confidence


def confidence_bin(probability: float) -> int:
    return min(BINS - 1, int(probability * BINS))

