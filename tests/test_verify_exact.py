"""Exact losslessness of one speculative iteration, by enumeration (no sampling).

The real `verify_chain` runs once per branch of its randomness: every acceptance comparison and
every recovered/bonus draw is a branch point, weighted by its exact probability. The uniform it
draws is symbolic, so the weight of "accept" is read off the comparison the code itself makes.
Every iteration's output, completed to γ + 1 tokens by the target, must have the target's joint
distribution to 1e-9.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import specdec.drafters.model as model_module
import specdec.verify as verify_module
from specdec.verify import verify_chain


class SymbolicUniform:
    """u ~ U[0, 1) scaled by a positive factor; a comparison asks the enumerator which branch to take."""

    def __init__(self, enumerator, scale=1.0):
        self.enumerator, self.scale = enumerator, scale

    def __mul__(self, factor):
        assert factor > 0, "the verifier scales u by a draft probability, which must be positive"
        return SymbolicUniform(self.enumerator, self.scale * float(factor))

    __rmul__ = __mul__

    def __truediv__(self, divisor):
        return self * (1.0 / float(divisor))

    def _below(self, threshold) -> float:  # P(scale * u < threshold)
        return float(np.clip(float(threshold) / self.scale, 0.0, 1.0))

    def __lt__(self, t):
        return self.enumerator.branch([(True, self._below(t)), (False, 1 - self._below(t))])

    def __ge__(self, t):
        return not self.__lt__(t)

    def __le__(self, t):  # P(u == t) = 0, so <= and < split the same way
        return self.__lt__(t)

    def __gt__(self, t):
        return not self.__lt__(t)


class Enumerator:
    """Depth-first over every branch of the code's randomness; collects (outcome, probability)."""

    def __init__(self):
        self.script: list[int] = []
        self.position = 0
        self.weight = 1.0
        self.pending: list[list[int]] = []

    def branch(self, options):  # options: [(value, probability)]
        # a branch of probability 0 is never taken (u < 0 never holds): the code is not run there
        options = [option for option in options if option[1] > 0]
        if self.position == len(self.script):  # first time here: take option 0, queue the others
            self.pending += [self.script + [i] for i in range(1, len(options))]
            self.script.append(0)
        value, probability = options[self.script[self.position]]
        self.position += 1
        self.weight *= probability
        return value

    def run(self, function):
        self.pending = [[]]
        while self.pending:
            self.script, self.position, self.weight = self.pending.pop(), 0, 1.0
            outcome = function()
            if self.weight > 0:
                yield outcome, self.weight


@pytest.fixture
def enumerator(monkeypatch):
    """Every uniform and every draw in the verifiers and in the drafter's tree growth branches."""
    enumerator = Enumerator()
    monkeypatch.setattr(verify_module, "uniform", lambda rng: SymbolicUniform(enumerator))

    def sample(probs, rng):
        probs = probs / probs.sum()
        return enumerator.branch([(token, float(p)) for token, p in enumerate(probs) if p > 0])

    monkeypatch.setattr(verify_module, "sample", sample)
    monkeypatch.setattr(model_module, "sample", sample)
    return enumerator


class Conditional:
    """A random next-token table over histories: table(history) -> float64 [vocab]."""

    def __init__(self, vocab, seed, shape=None):
        self.vocab, self.seed, self.shape, self.rows = vocab, seed, shape, {}

    def __call__(self, history: tuple[int, ...]) -> torch.Tensor:
        if history not in self.rows:
            rng = np.random.default_rng([self.seed, len(history), *history])
            row = rng.dirichlet(np.full(self.vocab, 0.7))
            if self.shape is not None:
                row = self.shape(row, rng)
            self.rows[history] = torch.tensor(row / row.sum(), dtype=torch.float64)
        return self.rows[history]


def zero_some(row, rng):
    """q with zeros where p may be positive."""
    row = row * (rng.random(row.size) < 0.5)
    if row.sum() == 0:
        row[rng.integers(row.size)] = 1.0
    return row


def low_half(row, rng):
    row = row.copy(); row[len(row) // 2 :] = 0
    return row


def high_half(row, rng):
    row = row.copy(); row[: len(row) // 2] = 0
    return row


def target_joint(target: Conditional, length: int) -> dict[tuple, float]:
    joint = {}
    for seq in itertools.product(range(target.vocab), repeat=length):
        prob = 1.0
        for i, token in enumerate(seq):
            prob *= float(target(seq[:i])[token])
        joint[seq] = prob
    return joint


def iteration_joint(enumerator, target, draft, gamma, point_mass, columns=None) -> dict[tuple, float]:
    """Joint of one iteration's output completed by the target to gamma + 1 tokens. columns: the
    target ids of the draft table's columns (q in a space smaller than the vocabulary, as a pruned
    draft's); None: the table covers the vocabulary."""
    ids = list(range(draft.vocab)) if columns is None else list(columns)
    joint: dict[tuple, float] = {}
    for cs in itertools.product(range(draft.vocab), repeat=gamma):  # the drafted columns
        xs = tuple(ids[c] for c in cs)
        if point_mass:  # deterministic drafter: the argmax of its table, probability 1
            if any(cs[i] != int(draft(xs[:i]).argmax()) for i in range(gamma)):
                continue
            draft_weight, draft_probs = 1.0, None
        else:
            draft_weight = float(np.prod([float(draft(xs[:i])[cs[i]]) for i in range(gamma)]))
            if draft_weight == 0:
                continue
            draft_probs = torch.stack([draft(xs[:i]) for i in range(gamma)])
        target_probs = torch.stack([target(xs[:i]) for i in range(gamma + 1)])
        tokens, where = torch.tensor(xs, dtype=torch.long), None if columns is None else torch.tensor(ids)
        for result, weight in enumerator.run(lambda: verify_chain(tokens, draft_probs, target_probs, None, None, where)):
            assert len(result.tokens) == result.accepted + 1
            assert tuple(result.tokens[: result.accepted]) == xs[: result.accepted]
            for tail, tail_weight in completions(target, tuple(result.tokens), gamma + 1):
                joint[tail] = joint.get(tail, 0.0) + draft_weight * weight * tail_weight
    return joint


def completions(target, prefix: tuple, length: int):
    """Every way the target continues prefix to `length` tokens, with its probability."""
    if len(prefix) == length:
        yield prefix, 1.0
        return
    for token, p in enumerate(target(prefix).tolist()):
        if p > 0:
            for seq, weight in completions(target, prefix + (token,), length):
                yield seq, p * weight


CASES = {
    "random p and q": dict(draft_shape=None),
    "p equals q": dict(draft_shape="same"),
    "disjoint supports": dict(draft_shape=high_half, target_shape=low_half),
    "q zero where p > 0": dict(draft_shape=zero_some),
    "point-mass q": dict(draft_shape=None, point_mass=True),
}


@pytest.mark.parametrize("vocab,gamma", [(4, 1), (5, 2), (3, 3), (8, 1), (6, 2)])
@pytest.mark.parametrize("case", list(CASES))
def test_chain_iteration_keeps_target_distribution(enumerator, case, vocab, gamma):
    spec = CASES[case]
    target = Conditional(vocab, seed=vocab * 10 + gamma, shape=spec.get("target_shape"))
    draft = target if spec["draft_shape"] == "same" else Conditional(vocab, seed=999 + vocab, shape=spec["draft_shape"])
    got = iteration_joint(enumerator, target, draft, gamma, spec.get("point_mass", False))
    want = target_joint(target, gamma + 1)
    assert abs(sum(got.values()) - 1) < 1e-9
    worst = max(abs(got.get(seq, 0.0) - p) for seq, p in want.items())
    assert worst < 1e-9, f"largest deviation from the target's joint: {worst:.3g}"
    assert set(got) <= {seq for seq, p in want.items() if p > 0}


def test_enumeration_catches_a_wrong_residual(enumerator, monkeypatch):
    """The harness can fail: sampling the recovery from p instead of norm(max(0, p - q)) is caught."""
    monkeypatch.setattr(verify_module, "residual", lambda target_probs, draft_probs, token, columns=None: target_probs)
    target, draft = Conditional(4, seed=1), Conditional(4, seed=2)
    got = iteration_joint(enumerator, target, draft, 2, point_mass=False)
    want = target_joint(target, 3)
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) > 1e-3


def test_residual_without_mass_falls_back_to_target():
    target_probs = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    rest = verify_module.residual(target_probs, target_probs.clone(), token=0)
    assert torch.isfinite(rest).all() and torch.allclose(rest, target_probs)


def test_greedy_verification_keeps_the_agreeing_prefix():
    logits = torch.tensor([[0, 5, 1], [9, 0, 0], [0, 0, 3], [1, 0, 0]], dtype=torch.float64)
    result = verify_module.verify_greedy(torch.tensor([1, 0, 1]), logits)
    assert (result.accepted, result.tokens) == (2, [1, 0, 2])
    result = verify_module.verify_greedy(torch.tensor([1, 0, 2]), logits)
    assert (result.accepted, result.tokens) == (3, [1, 0, 2, 0])


# (vocab, gamma, the draft's columns: target ids, in no particular order, fewer than the vocabulary)
COLUMN_CASES = [(4, 1, [3, 0]), (5, 2, [4, 1, 2]), (6, 2, [5, 0, 2, 3]), (5, 3, [0, 3])]


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled", "point-mass"])
@pytest.mark.parametrize("vocab,gamma,columns", COLUMN_CASES)
def test_chain_iteration_with_q_over_fewer_columns_keeps_target_distribution(enumerator, vocab, gamma, columns, point_mass):
    """q kept in a draft's own columns (`Draft.columns`, a pruned vocabulary's): read at each
    token's column, and the residual max(0, p - q) = p outside them."""
    target = Conditional(vocab, seed=vocab * 13 + gamma)
    draft = Conditional(len(columns), seed=300 + vocab)
    got = iteration_joint(enumerator, target, draft, gamma, point_mass, columns)
    want = target_joint(target, gamma + 1)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) < 1e-9
    outside = [seq for seq in want if seq[0] not in columns]  # first tokens the draft can never propose
    assert sum(got[seq] for seq in outside) > 0.05, "the residual must give them their mass"


def test_column_enumeration_catches_q_read_at_the_token_id(enumerator, monkeypatch):
    """The harness can fail: reading q at the token's id instead of its column is caught."""
    monkeypatch.setattr(verify_module, "column", lambda columns, token: token % len(columns))
    target, draft = Conditional(4, seed=1), Conditional(2, seed=2)
    got = iteration_joint(enumerator, target, draft, 2, point_mass=False, columns=[3, 0])
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in target_joint(target, 3).items()) > 1e-3


def test_column_enumeration_catches_a_residual_over_the_wrong_columns(enumerator, monkeypatch):
    """The harness can fail: subtracting q at the first columns' ids instead of its own is caught."""
    residual = verify_module.residual
    monkeypatch.setattr(verify_module, "residual", lambda rest, draft_probs, token, columns=None:
                        residual(rest, draft_probs, token, None if columns is None else torch.arange(len(columns))))
    target, draft = Conditional(4, seed=1), Conditional(2, seed=2)
    got = iteration_joint(enumerator, target, draft, 2, point_mass=False, columns=[3, 0])
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in target_joint(target, 3).items()) > 1e-3


def test_residual_over_columns_is_the_full_width_residual():
    """The residual of q over columns equals that of q widened to the vocabulary with zeros; outside
    the columns it is p's own shape."""
    generator = torch.Generator().manual_seed(3)
    target_probs = torch.rand(9, generator=generator, dtype=torch.float64)
    target_probs /= target_probs.sum()
    columns, outside = torch.tensor([7, 2, 5, 0]), torch.tensor([1, 3, 4, 6, 8])
    draft_probs = torch.rand(4, generator=generator, dtype=torch.float64)
    wide = torch.zeros(9, dtype=torch.float64).index_copy_(0, columns, draft_probs)
    assert torch.allclose(verify_module.residual(target_probs, draft_probs, 2, columns), verify_module.residual(target_probs, wide, 2))
    rest = verify_module.residual(target_probs, torch.ones(4, dtype=torch.float64), 2, columns)  # q >= p on every column
    assert float(rest[columns].abs().max()) == 0
    assert torch.allclose(rest[outside], target_probs[outside] / target_probs[outside].sum())


def test_the_engine_checks_a_drafts_columns():
    """A draft's q over columns: as wide as they are, distinct target ids within the vocabulary;
    the verifier refuses a drawn token outside them (it had q = 0: it cannot have been drawn)."""
    from specdec.engine import _checked
    from specdec.params import SamplingParams
    from specdec.types import Draft

    sampling, probs = SamplingParams(1.0), torch.full((2, 3), 1 / 3)
    good = Draft(torch.tensor([7, 2]), probs, columns=torch.tensor([2, 7, 4]))
    assert _checked(good, 2, 9, sampling) is good
    for columns, message in (([2, 7, 7], "distinct"), ([2, 7, 9], r"in \[0, 9\)"), ([2, 7], r"\[2, 2\]")):
        with pytest.raises(ValueError, match=message):
            _checked(Draft(torch.tensor([7, 2]), probs, columns=torch.tensor(columns)), 2, 9, sampling)
    target_probs = torch.full((3, 9), 1 / 9)
    with pytest.raises(ValueError, match="not among its distribution's columns"):
        verify_chain(torch.tensor([5, 2]), probs, target_probs, torch.Generator(), torch.Generator(), torch.tensor([2, 7, 4]))
