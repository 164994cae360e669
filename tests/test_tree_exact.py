"""Exact losslessness of one tree iteration, by enumeration (no sampling).

The tree is grown by the drafter's own `pick_children` from a random draft table, and verified by
the real `verify_tree`; every draw (of a child, a recovered or a bonus token) and every acceptance
comparison is a branch point of the enumerator from test_verify_exact. The output, completed by the
target to depth + 1 tokens, must have the target's joint distribution to 1e-9.
"""

from __future__ import annotations

import pytest
import torch

import specdec.drafters.model as model_module
import specdec.verify as verify_module
from specdec import tree
from specdec.verify import verify_tree, verify_tree_greedy
from test_verify_exact import CASES, Conditional, Enumerator, SymbolicUniform, completions, target_joint


@pytest.fixture
def enumerator(monkeypatch):
    enumerator = Enumerator()
    monkeypatch.setattr(verify_module, "uniform", lambda rng: SymbolicUniform(enumerator))

    def sample(probs, rng):
        probs = probs / probs.sum()
        return enumerator.branch([(token, float(p)) for token, p in enumerate(probs) if p > 0])

    monkeypatch.setattr(verify_module, "sample", sample)
    monkeypatch.setattr(model_module, "sample", sample)  # the children's draws branch too
    return enumerator


def grow(draft: Conditional, branching: list[int], sampled: bool):
    """Children of every node at depth d: pick_children(q, branching[d]); breadth first."""
    tokens, parents, probs, histories = [], [], [], {-1: ()}
    level = [-1]
    for count in branching:
        new = []
        for node in level:
            for token, drawn_from in model_module.pick_children(draft(histories[node]), count, sampled, rng=None):
                tokens.append(token)
                parents.append(node)
                probs.append(drawn_from)
                histories[len(tokens) - 1] = histories[node] + (token,)
                new.append(len(tokens) - 1)
        level = new
    probs = torch.stack(probs) if sampled else None
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), probs, histories


def tree_iteration_joint(enumerator, target, draft, branching, sampled) -> dict[tuple, float]:
    length = len(branching) + 1
    joint: dict[tuple, float] = {}

    def iteration():
        tokens, parents, probs, histories = grow(draft, branching, sampled)
        target_probs = torch.stack([target(histories[node]) for node in range(-1, len(tokens))])
        result = verify_tree(tokens, parents, probs, target_probs, None, None)
        assert result.tokens[:-1] == tokens[result.path].tolist()
        assert result.path == tree.path_to(parents, result.path[-1]) if result.path else True
        return tuple(result.tokens)

    for output, weight in enumerator.run(iteration):
        for seq, tail_weight in completions(target, output, length):
            joint[seq] = joint.get(seq, 0.0) + weight * tail_weight
    return joint


# (vocab, children per node at each depth): branching up to 3, depth up to 3; sampled trees
# enumerate every draw of every child as well, so they stay smaller
SAMPLED_TREES = [(4, [3]), (8, [2]), (3, [2, 2]), (3, [2, 1, 1]), (5, [1, 2])]
DETERMINISTIC_TREES = [(4, [3]), (8, [3]), (4, [2, 2]), (6, [3, 3, 3]), (5, [1, 2, 3])]
TREES = [(True, *t) for t in SAMPLED_TREES] + [(False, *t) for t in DETERMINISTIC_TREES]


@pytest.mark.parametrize("sampled,vocab,branching", TREES, ids=[f"{'sampled' if s else 'top'}-v{v}-{b}" for s, v, b in TREES])
@pytest.mark.parametrize("case", [c for c in CASES if c != "point-mass q"])
def test_tree_iteration_keeps_target_distribution(enumerator, case, sampled, vocab, branching):
    spec = CASES[case]
    target = Conditional(vocab, seed=vocab * 10 + len(branching), shape=spec.get("target_shape"))
    draft = target if spec["draft_shape"] == "same" else Conditional(vocab, seed=777 + vocab, shape=spec["draft_shape"])
    got = tree_iteration_joint(enumerator, target, draft, branching, sampled)
    want = target_joint(target, len(branching) + 1)
    assert abs(sum(got.values()) - 1) < 1e-9
    worst = max(abs(got.get(seq, 0.0) - p) for seq, p in want.items())
    assert worst < 1e-9, f"largest deviation from the target's joint: {worst:.3g}"


def test_tree_enumeration_catches_a_stale_residual(enumerator, monkeypatch):
    """The harness can fail: not updating the residual after a rejected sibling is caught."""
    monkeypatch.setattr(verify_module, "residual", lambda rest, draft_probs, token: rest)
    target, draft = Conditional(4, seed=1), Conditional(4, seed=2)
    got = tree_iteration_joint(enumerator, target, draft, [3], sampled=True)
    want = target_joint(target, 2)
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) > 1e-3


def test_misreported_sibling_distribution_is_caught(enumerator, monkeypatch):
    """The harness can fail: siblings drawn without replacement but reported as drawn from the
    full q (the distribution verify_tree is told about must be the one actually used)."""
    pick = model_module.pick_children

    def misreported(q, count, sampled, rng, exclude=()):
        for token, _ in pick(q, count, sampled, rng, exclude):
            yield token, q

    monkeypatch.setattr(model_module, "pick_children", misreported)
    target, draft = Conditional(4, seed=1), Conditional(4, seed=2)
    got = tree_iteration_joint(enumerator, target, draft, [3], sampled=True)
    want = target_joint(target, 2)
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) > 1e-3


def test_greedy_tree_follows_the_target_argmax():
    # root's children 1 and 2; node 2's children 0 (node 2) and 3 (node 3); node 3's child 1
    tokens, parents = torch.tensor([1, 2, 0, 3, 1]), torch.tensor([-1, -1, 1, 1, 3])
    logits = torch.zeros(6, 4)
    argmax = [2, 0, 3, 9, 1, 2]  # per row: root, then nodes 0..4 (9: none, row unused)
    for row, token in enumerate(argmax):
        logits[row, token % 4] = 1
    result = verify_tree_greedy(tokens, parents, logits)
    assert (result.path, result.tokens) == ([1, 3, 4], [2, 3, 1, 2])
