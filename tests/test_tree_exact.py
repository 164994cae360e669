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
from specdec.drafters import ModelDrafter, PromptLookupDrafter, TreeShape
from specdec.drafters.base import ContextDrafter, DraftRequest
from specdec.runtime.base import forward_each
from specdec.types import Draft
from specdec.params import SamplingParams
from specdec.verify import verify_tree, verify_tree_greedy
from reference import path_to
from test_verify_exact import CASES, Conditional, completions, enumerator, target_joint  # noqa: F401 (enumerator: a fixture)


def grow(draft: Conditional, branching: list[int], sampled: bool, columns=None):
    """Children of every node at depth d: pick_children(q, branching[d]); breadth first. columns:
    the target ids of the draft table's columns (None: the table covers the vocabulary)."""
    ids = list(range(draft.vocab)) if columns is None else list(columns)
    tokens, parents, probs, histories = [], [], [], {-1: ()}
    level = [-1]
    for count in branching:
        new = []
        for node in level:
            for column, drawn_from in model_module.pick_children(draft(histories[node]), count, sampled, rng=None):
                tokens.append(ids[column])
                parents.append(node)
                probs.append(drawn_from)
                histories[len(tokens) - 1] = histories[node] + (ids[column],)
                new.append(len(tokens) - 1)
        level = new
    probs = torch.stack(probs) if sampled else None
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), probs, histories


def tree_iteration_joint(enumerator, target, draft, branching, sampled, columns=None) -> dict[tuple, float]:
    length = len(branching) + 1
    joint: dict[tuple, float] = {}

    def iteration():
        tokens, parents, probs, histories = grow(draft, branching, sampled, columns)
        target_probs = torch.stack([target(histories[node]) for node in range(-1, len(tokens))])
        where = None if columns is None else torch.tensor(columns)
        result = verify_tree(tokens, parents, probs, target_probs, None, None, where)
        assert result.tokens[:-1] == tokens[result.path].tolist()
        assert result.path == path_to(parents, result.path[-1]) if result.path else True
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


# (vocab, children per node at each depth, the draft's columns: fewer target ids than the vocabulary)
COLUMN_TREES = [(4, [2], [3, 0, 1]), (5, [2, 1], [4, 1, 2]), (4, [1, 2], [2, 0]), (5, [3], [0, 4, 2])]


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "top"])
@pytest.mark.parametrize("vocab,branching,columns", COLUMN_TREES)
def test_tree_iteration_with_q_over_fewer_columns_keeps_target_distribution(enumerator, vocab, branching, columns, sampled):
    """Children picked in the draft's own columns (a pruned vocabulary's) and mapped to target ids;
    verify_tree reads q at each child's column."""
    target = Conditional(vocab, seed=vocab * 17 + len(branching))
    draft = Conditional(len(columns), seed=600 + vocab)
    got = tree_iteration_joint(enumerator, target, draft, branching, sampled, columns)
    want = target_joint(target, len(branching) + 1)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) < 1e-9


def test_tree_enumeration_catches_a_stale_residual(enumerator, monkeypatch):
    """The harness can fail: not updating the residual after a rejected sibling is caught."""
    monkeypatch.setattr(verify_module, "residual", lambda rest, draft_probs, token, columns=None: rest)
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


# ---------------------------------------------------------------- the real drafter, exactly


class TableLM:
    """A stand-in for a runtime: its next-token distribution after a history is a Conditional table
    (history counted after the prompt). Like a transformer, a new entry learns its history only
    from its parent entry; truncate and keep edit its cache like the real ones."""

    # the capabilities a drafter asks a draft model about (`runtime.base.CausalLM`)
    columns = None  # logits over the whole vocabulary (`PrunedTableLM` has its own)
    reads_target_states = False
    device_logits = False

    def __init__(self, table: Conditional, prompt, max_length: int = 64):
        self.table, self.prompt, self.max_length, self.vocab_size = table, tuple(prompt), max_length, table.vocab

    def sequence(self) -> TableSequence:
        return TableSequence(self)

    def verify_room(self, root_position: int) -> int:
        return self.max_length - 1 - root_position

    def forward_batch(self, feeds):
        return forward_each(feeds)


class PrunedTableLM(TableLM):
    """A TableLM whose table covers only `columns` (target ids), as a pruned draft's logits do
    (`runtime.pruned`); it takes any target id."""

    def __init__(self, table: Conditional, prompt, columns: list[int], max_length: int = 64):
        super().__init__(table, prompt, max_length)
        self.columns = torch.tensor(columns, dtype=torch.long)


class TableSequence:
    def __init__(self, owner: TableLM):
        self.owner = owner
        self.entries: list[tuple[int, tuple]] = []  # (position, history through this token) per cache entry

    @property
    def cache_len(self) -> int:
        return len(self.entries)

    def forward(self, tokens, parents=None, last=None):
        tokens, start = torch.as_tensor(tokens).tolist(), len(self.entries)
        parents = list(range(start - 1, start + len(tokens) - 1)) if parents is None else list(parents)
        rows = []
        for token, parent in zip(tokens, parents):
            assert -1 <= parent < len(self.entries), "a parent must be an earlier entry"
            position, history = self.entries[parent] if parent >= 0 else (-1, ())
            self.entries.append((position + 1, history + (token,)))
            rows.append(torch.log(self.owner.table(history[len(self.owner.prompt):] + (token,))))
        rows = torch.stack(rows)
        return rows[-last:] if last else rows

    def truncate(self, length: int):
        del self.entries[length:]

    def keep(self, start: int, indices):
        kept = [self.entries[i] for i in indices]
        assert all(position == start + k for k, (position, _) in enumerate(kept)), "the kept path must follow the text"
        self.entries = self.entries[:start] + kept

    def release(self):
        self.entries = None


class TableDrafter(ContextDrafter):
    """A stochastic inner drafter (draft²) sampling a chain from its own table, with its probs."""

    name = "table"

    def __init__(self, table: Conditional, prompt):
        self.table, self.prompt = table, tuple(prompt)

    def propose_one(self, context, max_tokens, sampling, rng):
        history, tokens, probs = tuple(context[len(self.prompt):]), [], []
        for _ in range(max_tokens):
            probs.append(self.table(history))
            tokens.append(model_module.sample(probs[-1], rng))
            history += (tokens[-1],)
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)


DRAFTER_PROMPT = (0, 1, 2, 0, 1)  # repeats: prompt lookup proposes "2 0 1 ..."
DRAFTERS = {
    "tree sampled 4 w2 d2": (dict(tree=TreeShape(4, 2)), 2),
    "tree sampled 5 w3 d3": (dict(tree=TreeShape(5, 3)), 3),
    "tree top 4 w2 d3": (dict(tree=TreeShape(4, 2, sampled=False)), 3),
    "staged chain, table inner d3": (dict(inner="table"), 3),
    "staged tree sampled, table inner d2": (dict(tree=TreeShape(4, 2), inner="table"), 2),
    "staged tree sampled, lookup inner d3": (dict(tree=TreeShape(4, 2), inner="lookup"), 3),
    "staged tree top, lookup inner d3": (dict(tree=TreeShape(4, 2, sampled=False), inner="lookup"), 3),
}


def proposal_deviation(enumerator, propose, target: Conditional, depth: int) -> float:
    """Largest deviation from the target's joint of one iteration: `propose()` gives a drafter's
    proposal after DRAFTER_PROMPT, the real verify_tree checks it against `target`; every draw of
    the drafter and of the verifier is enumerated."""

    def iteration():
        proposal = propose()
        paths = [path_to(proposal.parents, node) for node in range(len(proposal))]
        histories = [()] + [tuple(proposal.tokens[path].tolist()) for path in paths]
        target_probs = torch.stack([target(h) for h in histories])
        return tuple(verify_tree(proposal.tokens, proposal.parents, proposal.probs, target_probs, None, None, proposal.columns).tokens)

    joint: dict[tuple, float] = {}
    for output, weight in enumerator.run(iteration):
        for seq, tail_weight in completions(target, output, depth + 1):
            joint[seq] = joint.get(seq, 0.0) + weight * tail_weight
    assert abs(sum(joint.values()) - 1) < 1e-9
    return max(abs(joint.get(seq, 0.0) - p) for seq, p in target_joint(target, depth + 1).items())


PRUNED_COLUMNS = [3, 0, 1]  # a pruned draft's columns in a vocabulary of 4: never 2, which lookup proposes first after DRAFTER_PROMPT


def drafter_iteration_deviation(enumerator, name, pruned: bool = False) -> float:
    """Largest deviation of one ModelDrafter + verify_tree iteration's joint from the target's.
    pruned: the draft model predicts PRUNED_COLUMNS only, of a vocabulary of 4."""
    options, depth = DRAFTERS[name]
    vocab = 4 if pruned else 3
    target, inner_table = Conditional(vocab, seed=31), Conditional(vocab, seed=33)
    draft = Conditional(len(PRUNED_COLUMNS) if pruned else vocab, seed=32)
    inner = {"table": lambda: TableDrafter(inner_table, DRAFTER_PROMPT), "lookup": PromptLookupDrafter, None: lambda: None}[options.get("inner")]

    def propose():
        model = PrunedTableLM(draft, DRAFTER_PROMPT, PRUNED_COLUMNS) if pruned else TableLM(draft, DRAFTER_PROMPT)
        drafter = ModelDrafter(model, tree=options.get("tree"), inner=inner(), inner_gamma=2)
        slot = drafter.open(DRAFTER_PROMPT)
        return drafter.propose([DraftRequest(slot, list(DRAFTER_PROMPT), depth, SamplingParams(temperature=1.0), None)])[0]

    return proposal_deviation(enumerator, propose, target, depth)


@pytest.mark.parametrize("pruned", [False, True], ids=["whole vocabulary", "pruned"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_model_drafter_iteration_keeps_target_distribution(enumerator, name, pruned):
    """ModelDrafter's own growth (frontier, budget, sibling rule, staged spine and siblings) feeding
    the real verify_tree: every draw of the drafter, its inner stage and the verifier is enumerated.
    Pruned: q stays in the draft's columns, and the inner's guesses are checked there (a guess
    without a column, which both inners make, is rejected against q = 0)."""
    worst = drafter_iteration_deviation(enumerator, name, pruned)
    assert worst < 1e-9, f"largest deviation from the target's joint: {worst:.3g}"


def test_drafter_enumeration_catches_a_guess_cut_before_a_token_without_a_column(enumerator, monkeypatch):
    """The harness can fail: ending the inner's guess before a token without a column, so that the
    draft's own q is drawn there instead of the residual against the inner's guess, is caught
    (the guess was drawn before it was seen to lack a column)."""
    check = ModelDrafter._check_guesses

    def cut(self, guess, guessed, fed, logits, q, sampled, rng):
        return check(self, guess, guessed, len(guessed), logits[: len(guessed) + 1], q[: len(guessed) + 1], sampled, rng)

    monkeypatch.setattr(ModelDrafter, "_check_guesses", cut)
    assert drafter_iteration_deviation(enumerator, "staged chain, table inner d3", pruned=True) > 1e-3


def test_a_pruned_model_drafter_keeps_q_in_its_columns():
    """The drafts themselves: tokens are target ids within the columns, q is as wide as the columns."""
    for name, (options, depth) in DRAFTERS.items():
        inner = {"table": lambda: TableDrafter(Conditional(4, seed=33), DRAFTER_PROMPT), "lookup": PromptLookupDrafter, None: lambda: None}[options.get("inner")]
        drafter = ModelDrafter(PrunedTableLM(Conditional(3, seed=32), DRAFTER_PROMPT, PRUNED_COLUMNS), tree=options.get("tree"), inner=inner(), inner_gamma=2)
        for seed in range(5):
            request = DraftRequest(drafter.open(DRAFTER_PROMPT), list(DRAFTER_PROMPT), depth, SamplingParams(temperature=1.0), torch.Generator().manual_seed(seed))
            proposal, = drafter.propose([request])
            assert set(proposal.tokens.tolist()) <= set(PRUNED_COLUMNS), name
            if proposal.probs is not None:
                assert proposal.columns.tolist() == PRUNED_COLUMNS and proposal.probs.shape == (len(proposal), 3), name


@pytest.mark.parametrize("name", ["tree sampled 5 w3 d3", "staged tree sampled, lookup inner d3"])
def test_drafter_enumeration_catches_misreported_siblings(enumerator, monkeypatch, name):
    """The harness can fail: siblings drawn without replacement but reported as drawn from q."""
    pick = model_module.pick_children

    def misreported(q, count, sampled, rng, exclude=()):
        for token, drawn_from in pick(q, count, sampled, rng, exclude):
            yield token, q if drawn_from is not None else None

    monkeypatch.setattr(model_module, "pick_children", misreported)
    assert drafter_iteration_deviation(enumerator, name) > 1e-3
