"""What a forward costs, as the draft policy reads it: a measured profile (`Profile`) and the
same profile corrected by what decoding pays as it goes (`LiveCosts`).

A profile holds
- t_target(k) and t_draft(k): seconds of one forward over k new tokens after a cached prefix, with
  logits for every one of them (what a verify, a tree level or a batch of rows needs), as decoding
  pays it;
- the engine's own time per iteration (sampling, verification, bookkeeping) and the draft model's
  per draft level, outside the forwards: on a fast runtime these decide whether drafting pays at all.

Measuring lives above the engine it drives, in `specdec.profiling`; this module only reads figures.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

CONTENDED = 0.15  # a profile whose forwards waited this share of their time for a core measured other work too


@dataclass
class Profile:
    target: dict[int, float]  # k -> seconds
    draft: dict[int, float] | None = None
    step_overhead: float = 0.0  # seconds an engine iteration spends outside the target's forward
    level_overhead: float = 0.0  # seconds a draft level spends per row outside the draft model's forward
    rounds: int = 0
    load: float | None = None  # 1-minute load average when measured
    measured: str = ""
    # share of the timed forwards' time this process's threads waited for a core (other work ran)
    contention: float = 0.0
    revision: ClassVar[int] = 0  # moves whenever t(k) may have changed (a `LiveCosts` reshaping): what was
    # computed from the costs at one revision holds until the next

    @property
    def trusted(self) -> bool:
        """Measured on cores of its own: foreign work slowed it by less than CONTENDED."""
        return self.contention < CONTENDED

    def verify(self, k: float) -> float:
        """t_target(k), interpolated: the forward alone."""
        return interpolate(self.target, k)

    def step(self, k: float) -> float:
        """An engine iteration's verify phase scoring k tokens: the target's forward and the engine's
        own work (sampling, verification, bookkeeping)."""
        return self.verify(k) + self.step_overhead

    def steps(self, ks: list[float]) -> list[float]:
        """`step` at each k (a chain's every prefix is weighed at once: `policy.Budget.best_prefix`)."""
        return [t + self.step_overhead for t in interpolate_all(self.target, ks)]

    def draft_level(self, rows: float) -> float:
        """One draft level for `rows` rows of a batch: one forward, and each row's own work (0 without a
        draft model)."""
        return interpolate(self.draft, rows) + rows * self.level_overhead if self.draft else 0.0

    def reading(self, unread: int) -> float:
        """What the draft model's reading `unread` committed tokens adds to its next level's forward."""
        return interpolate(self.draft, unread) - interpolate(self.draft, 1) if self.draft and unread > 1 else 0.0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        data = dict(data)
        data["target"] = {int(k): v for k, v in data["target"].items()}
        if data.get("draft"):
            data["draft"] = {int(k): v for k, v in data["draft"].items()}
        return cls(**data)


@dataclass
class Factors:
    """How the times decoding pays compare with a measured curve: a factor per size class (k in
    [2^c, 2^(c+1))), each class following its last ~MEMORY observations (within [1/CLAMP, CLAMP]
    each: a stall does not swing it), interpolated between the classes seen in log k and beyond
    them the nearest's."""

    MEMORY: ClassVar[int] = 32
    CLAMP: ClassVar[float] = 16.0
    # a class has moved once its factor or mean k has moved by more than this (2%) since `mark`: every
    # step moves them a little (a plain step's time jitters by more than 0.5% every few steps), and
    # what is computed again from a move (the curve, whether each source pays) should cost a step
    # that drafts nothing next to nothing; no decision turns on 2% of a cost
    MOVED: ClassVar[float] = 0.02
    classes: dict[int, list[float]] = field(default_factory=dict)  # class -> [seen, mean log factor, mean k]
    _marked: dict[int, tuple[float, float]] = field(default_factory=dict)  # class -> (log factor, k) at `mark`

    def record(self, k: float, factor: float) -> bool:
        """One observation at size k; whether its class has moved since `mark`."""
        size_class = int(k).bit_length() - 1
        entry = self.classes.setdefault(size_class, [0, 0.0, 0.0])
        entry[0] += 1
        weight = 1 / min(entry[0], self.MEMORY)
        entry[1] += weight * (math.log(min(max(factor, 1 / self.CLAMP), self.CLAMP)) - entry[1])
        entry[2] += weight * (k - entry[2])
        marked = self._marked.get(size_class)
        return marked is None or abs(entry[1] - marked[0]) > self.MOVED or abs(entry[2] / marked[1] - 1) > self.MOVED

    def mark(self) -> None:
        """What the factors are now is what was used: `record` tells moves from here."""
        self._marked = {c: (log_factor, k) for c, (_, log_factor, k) in self.classes.items()}

    def at(self, ks) -> list[float]:
        """The factor at each k (1 before anything was seen)."""
        if not self.classes:
            return [1.0] * len(ks)
        points = sorted((math.log(mean_k), log_factor) for _, log_factor, mean_k in self.classes.values())
        xs, ys = [x for x, _ in points], [y for _, y in points]
        factors = []
        for k in ks:
            x = min(max(math.log(max(k, 1)), xs[0]), xs[-1])  # beyond the classes seen: the nearest
            i = bisect.bisect_left(xs, x)
            y = ys[i] if xs[i] == x else ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            factors.append(math.exp(y))
        return factors


@dataclass
class LiveCosts(Profile):
    """A profile whose costs follow what decoding pays.

    The measured curves time each size alone, after a short context; decoding pays more for a
    verify than that curve says (llama.cpp rebuilds its graph whenever the batch shape changes,
    a long context makes attention dear, cache edits and verification add to the forward) and
    often less for a plain step (its graph is reused), and the plain steps right after a drafting
    one pay for it too (see `observe`). The draft model's forwards, between the target's, find
    caches the target has filled and a context as long. So each engine step's verify phase
    (tokens the target scored, seconds) is compared with `Profile.step`, as `Factors` per size
    class, and each proposal's draft-model forwards with the draft curve and level overhead, as
    one factor. t(k) is the measured step scaled by the factor at k over the factor at k = 1, and
    a draft level by the draft's factor over the same: a plain step stays what was measured, and
    the rest keeps its ratio to it as decoding pays it. Decisions that follow timings are still
    lossless (docs/design.md, pitfall 14, rules out only unverified target probabilities). A
    seeded request under the default drafter draws by position, so its text does not follow them
    (`SpeculativeDecoder.request`); a fixed drafter's with gamma "auto" may."""

    AFTERMATH: ClassVar[int] = 16
    UNREAD: ClassVar[int] = 256  # steps observed are taken in when the costs are read, or once this many wait
    _steps: Factors = field(default_factory=Factors, repr=False)  # the verify phases against `Profile.step`
    _drafts: Factors = field(default_factory=Factors, repr=False)  # the draft model's forwards (one class)
    # the last drafting step: tokens, seconds so far, plain steps after it
    _drafted: tuple[int, float, int] | None = field(default=None, repr=False)
    _curve: dict[int, float] | None = field(default=None, repr=False)  # t(k) as decoding pays it, at the measured sizes
    _draft_scale: float | None = field(default=None, repr=False)  # the draft's factor over the plain step's
    _plain: float | None = field(default=None, repr=False)  # the measured `Profile.step(1)`, read every plain step
    # steps observed and not taken in yet, in order (`observe`): every read of the costs takes them in first
    _unread: list[tuple[int, float]] = field(default_factory=list, repr=False)
    _revision: int = field(default=0, repr=False)

    @classmethod
    def of(cls, profile: Profile) -> LiveCosts:
        return cls(**{f.name: getattr(profile, f.name) for f in fields(Profile)})

    def observe(self, tokens: int, seconds: float) -> None:
        """A step's verify phase scored `tokens` tokens in `seconds`: noted, and taken in (`_take`)
        before the costs are next read, so every figure read is what taking each step in as it came
        gives. But a step touches one list here: the forward before it pushed this code and its data
        out of the CPU's caches, so what a step touches is what its host time is (about 1 us taken in
        together, 10 one at a time)."""
        if tokens >= 1 and seconds > 0:
            self._unread.append((tokens, seconds))
            if len(self._unread) >= self.UNREAD:
                self._read()

    @property
    def revision(self) -> int:
        self._read()
        return self._revision

    def _read(self) -> None:
        """Take in the steps observed since the last read, in order."""
        unread, self._unread = self._unread, []
        for tokens, seconds in unread:
            self._take(tokens, seconds)

    def _take(self, tokens: int, seconds: float) -> None:
        """The plain steps after a drafting one run slower than steady ones for a while (llama.cpp
        rebuilds its graph for the shape it changed back to; the draft model's weights pushed the
        target's out of the CPU's caches): their excess over a steady plain step, for up to
        AFTERMATH steps, is charged to the drafting step that caused it, and only steady plain
        steps teach the plain cost."""
        drafted = self._drafted
        if drafted is not None and tokens == 1 and drafted[2] < self.AFTERMATH:
            plain = self._steps.classes.get(0)  # the class itself, not `Factors.at`
            steady = self._measured(1) * math.exp(plain[1]) if plain is not None else math.inf
            if seconds > 1.05 * steady:
                self._drafted = (drafted[0], drafted[1] + seconds - steady, drafted[2] + 1)
                return
        if drafted is not None:
            self._record(drafted[0], drafted[1])
            self._drafted = None
        if tokens == 1:
            self._record(1, seconds)
        else:
            self._drafted = (tokens, seconds, 0)  # recorded once the plain steps after it are steady again

    def observe_draft(self, forwards: list[tuple[int, int]], seconds: float) -> None:
        """A proposal's draft-model forwards (tokens, rows of each) took `seconds`, the drafter's work
        between them included."""
        if not self.draft or seconds <= 0:
            return
        self._read()
        expected = sum(interpolate(self.draft, tokens) + rows * self.level_overhead for tokens, rows in forwards)
        if expected > 0 and self._drafts.record(1, seconds / expected):
            self._moved()

    def _record(self, tokens: int, seconds: float) -> None:
        if self._steps.record(tokens, seconds / self._measured(tokens)):
            self._moved()

    def _moved(self) -> None:
        self._curve = self._draft_scale = None
        self._revision += 1

    def _measured(self, tokens: int) -> float:
        """The measured `Profile.step(tokens)`; step(1), read every plain step, is kept."""
        if tokens != 1:
            return Profile.step(self, tokens)
        if self._plain is None:
            self._plain = Profile.step(self, 1)
        return self._plain

    def factor(self, k: float) -> float:
        """The observed factor of a verify of k (1 before any step was seen)."""
        self._read()
        return self._steps.at([k])[0]

    def step(self, k: float) -> float:
        return interpolate(self._shaped(), k)

    def steps(self, ks: list[float]) -> list[float]:
        return interpolate_all(self._shaped(), ks)

    def draft_level(self, rows: float) -> float:
        return Profile.draft_level(self, rows) * self._scale()

    def reading(self, unread: int) -> float:
        return Profile.reading(self, unread) * self._scale()

    def _shaped(self) -> dict[int, float]:
        """The measured sizes' steps, reshaped: made again once `_record` moved a class."""
        self._read()
        if self._curve is None:
            sizes = sorted(self.target)
            at_one, *factors = self._steps.at([1, *sizes])
            self._curve = {size: Profile.step(self, size) * f / at_one for size, f in zip(sizes, factors)}
            self._steps.mark()
        return self._curve

    def _scale(self) -> float:
        """The draft's factor over a plain step's (1 before a draft forward was seen: it is taken to
        have moved as the target's did)."""
        self._read()
        if self._draft_scale is None:
            seen = bool(self._drafts.classes)
            self._draft_scale = self._drafts.at([1])[0] / self._steps.at([1])[0] if seen else 1.0
            self._drafts.mark()
        return self._draft_scale


def interpolate(costs: dict[int, float], k: float) -> float:
    """t(k) by linear interpolation between measured sizes; beyond the largest, linear in k."""
    return interpolate_all(costs, [k])[0]


def interpolate_all(costs: dict[int, float], ks: list[float]) -> list[float]:
    """`interpolate` at each k, the sizes sorted once."""
    sizes = sorted(costs)
    first, last = sizes[0], sizes[-1]
    out = []
    for k in ks:
        if k <= first:
            out.append(costs[first])
        elif k >= last:
            out.append(costs[last] * k / last)
        else:
            i = bisect.bisect_left(sizes, k)
            low, high = sizes[i - 1], sizes[i]
            out.append(costs[low] + (costs[high] - costs[low]) * (k - low) / (high - low))
    return out


def nearest(costs: dict[int, float], k: float) -> float:
    """t at the measured size nearest k (the smaller of two as near), not interpolated: the bench's
    prediction reads the verify cost that was actually timed."""
    return costs[min(sorted(costs), key=lambda size: abs(size - k))]
