"""The cost-aware policy and the auto drafter: exact losslessness with the policy in the loop,
greedy equality, what the policy chooses and why, the cost profile and its cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings, strategies as st
import torch

import specdec
import specdec.drafters.auto as auto_module
from conftest import CHEAP_VERIFY, live_observe, live_observe_draft, measured_profile, reference_greedy
from specdec import costs, profiling
from specdec.drafters import AutoDrafter, ModelDrafter, PromptLookupDrafter
from specdec.drafters.base import DraftRequest
from specdec.policy import BatchDepth, Budget, CostAwareDepth, CostAwarePolicy, confidence_bin, expected_tokens
from specdec.params import SamplingParams
from specdec.runtime.static import StaticHFModel
from test_tree_exact import DRAFTER_PROMPT, PRUNED_COLUMNS, PrunedTableLM, TableLM, proposal_deviation
from test_verify_exact import Conditional, enumerator  # noqa: F401 (enumerator: a fixture)

# costs under which a node pays or not depending on its value: verify nearly flat, draft levels dear
STEEP = costs.Profile(target={1: 1.0, 2: 1.04, 4: 1.12, 8: 1.3}, draft={1: 0.05, 8: 0.1}, step_overhead=0.1, level_overhead=0.01)

DRAFT_SEED = 45


def draft_table() -> Conditional:
    """A draft whose confidence varies from history to history (squared Dirichlet rows)."""
    return Conditional(3, seed=DRAFT_SEED, shape=lambda row, rng: row ** 2)


def trained_policy(depth: int, probing: bool = False) -> CostAwarePolicy:
    """A policy that has seen outcomes: confident draft nodes (max q >= 0.6) are usually accepted,
    unsure ones almost never, lookup's first token a third of the time; so whether a model node is
    drawn depends on q, which depends on what was drawn before it (beside a looked-up token too: it
    leaves two thirds of the root). probing: both sources' probes are due."""
    policy = CostAwarePolicy(STEEP, max_depth=depth)
    for index in range(10):
        policy._acceptance(("model", index)).observe(40, 36 if index >= 6 else 0)
    policy._acceptance(("lookup", 0)).observe(10, 3)
    policy._acceptance(("lookup", 1)).observe(10, 2)
    if probing:
        for probe in policy.probes.values():
            probe.idle = 10**6
        policy.credit = 1e9  # and the credit pays for them
        policy.depth(1)
        assert policy.probe_model(1) and policy.probe_tokens("lookup")
    return policy


def auto_iteration_deviation(enumerator, model: bool, lookup: bool, depth: int = 3, probing: bool = False, pruned: bool = False,
                             seen: list | None = None) -> float:
    """Largest deviation of one AutoDrafter + verify_tree iteration's joint from the target's,
    every draw of the drafter and of the verifier enumerated, the policy deciding in the loop.
    pruned: the draft model predicts PRUNED_COLUMNS only, of a vocabulary of 4 (lookup proposes
    a token outside them); seen: collects the proposals."""
    draft = draft_table()

    def propose():
        table = PrunedTableLM(draft, DRAFTER_PROMPT, PRUNED_COLUMNS) if pruned else TableLM(draft, DRAFTER_PROMPT)
        drafter = AutoDrafter(ModelDrafter(table) if model else None, PromptLookupDrafter() if lookup else None)
        slot = drafter.open(DRAFTER_PROMPT)
        request = DraftRequest(slot, list(DRAFTER_PROMPT), depth, SamplingParams(temperature=1.0), None, trained_policy(depth, probing))
        proposal = drafter.propose([request])[0]
        if seen is not None:
            seen.append(proposal)
        return proposal

    return proposal_deviation(enumerator, propose, Conditional(4 if pruned else 3, seed=41), depth)


@pytest.mark.parametrize("probing", [False, True], ids=["estimates", "probes due"])
@pytest.mark.parametrize("model,lookup", [(True, True), (True, False), (False, True)], ids=["model+lookup", "model", "lookup"])
def test_auto_drafter_iteration_keeps_target_distribution(enumerator, model, lookup, probing):
    """Depth, which source and whether a lookup token stands beside the model's all vary with what
    was drawn, and with the probe schedule; the output still has the target's joint distribution exactly."""
    assert auto_iteration_deviation(enumerator, model, lookup, probing=probing) < 1e-9


@pytest.mark.parametrize("probing", [False, True], ids=["estimates", "probes due"])
@pytest.mark.parametrize("lookup", [False, True], ids=["model", "model+lookup"])
def test_auto_drafter_iteration_with_a_pruned_draft_keeps_target_distribution(enumerator, lookup, probing):
    """The draft model's q in its own columns beside lookup's target ids: a lookup token without a
    column stands beside drawn nodes on a column of its own (`DraftTree`), where q is 0."""
    seen = []
    assert auto_iteration_deviation(enumerator, True, lookup, probing=probing, pruned=True, seen=seen) < 1e-9
    drawn = [d for d in seen if d.probs is not None]
    assert drawn and all(d.columns[: len(PRUNED_COLUMNS)].tolist() == PRUNED_COLUMNS for d in drawn)
    if lookup:
        assert any(len(d.columns) > len(PRUNED_COLUMNS) for d in drawn), "a lookup token without a column beside drawn nodes"


@pytest.mark.parametrize("lookup", [False, True])
def test_the_policy_really_varies_the_draft(lookup):
    """The enumeration above is not vacuous: over the draft's draws the trained policy builds
    drafts of several shapes."""
    draft = draft_table()
    shapes = set()
    for seed in range(40):
        drafter = AutoDrafter(ModelDrafter(TableLM(draft, DRAFTER_PROMPT)), PromptLookupDrafter() if lookup else None)
        slot = drafter.open(DRAFTER_PROMPT)
        request = DraftRequest(slot, list(DRAFTER_PROMPT), 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(seed), trained_policy(3))
        proposal, = drafter.propose([request])
        shapes.add(tuple(proposal.parents.tolist()))
    assert len(shapes) >= 2, shapes


def test_enumeration_catches_a_policy_that_looks_at_the_drawn_token(enumerator, monkeypatch):
    """The harness can fail: dropping a model token after drawing it, because the draft thought it
    unlikely, biases the output (the decision must come before the draw)."""
    pick = auto_module.pick_children

    def peeking(q, count, sampled, rng, exclude=()):
        for token, drawn_from in pick(q, count, sampled, rng, exclude):
            if q[token] >= 0.3:
                yield token, drawn_from

    monkeypatch.setattr(auto_module, "pick_children", peeking)
    assert auto_iteration_deviation(enumerator, model=True, lookup=False) > 1e-3


def test_auto_greedy_equals_reference_with_trees_and_with_chains_only(load64, model_dirs):
    target = load64(model_dirs["mistral"])
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    want = reference_greedy(target, prompt, 40)
    drafter = AutoDrafter(ModelDrafter(load64(model_dirs["mistral-near"])), PromptLookupDrafter())
    for trees in (True, False):
        drafter.trees = trees
        result = specdec.SpeculativeDecoder(target, drafter).generate(prompt, max_new_tokens=40, temperature=0)
        assert result.tokens == want
        sources = {s for label in result.stats.drafters for s in label.split("+")}
        assert result.stats.accepted > 0 and "model" in sources and sources & {"lookup", "copy"}
        if not trees:
            assert all(label in ("lookup", "copy", "model", "none") for label in result.stats.drafters)


def test_a_draft_model_that_never_drafts_reads_nothing_and_the_drafter_is_not_asked(load64, model_dirs, monkeypatch):
    """Where no source's estimate can pay (a verify of k tokens costs k steps) and nothing is probed,
    the default decodes as plain decoding does: the draft model reads neither the prompt nor the
    text, and no step asks the drafter for a draft."""
    from conftest import CHEAP_VERIFY  # noqa: F401 (the autouse fixture's; replaced here)

    linear = costs.Profile(target={1: 1.0, 128: 128.0}, draft={1: 0.5, 128: 64.0})
    monkeypatch.setattr(profiling, "profile", lambda target, draft=None, refresh=False: linear)
    target = load64(model_dirs["llama"])
    drafter = AutoDrafter(ModelDrafter(load64(model_dirs["llama-near"])), PromptLookupDrafter())
    asked = []
    monkeypatch.setattr(drafter, "propose", lambda requests: asked.append(requests) or [])
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 5  # it repeats: a copy's prior alone would pay where a verify is cheap
    result = specdec.SpeculativeDecoder(target, drafter, explore=False).generate(prompt, max_new_tokens=24, temperature=0)
    assert result.tokens == reference_greedy(target, prompt, 24)
    assert not asked and result.stats.draft_forwards == 0 and set(result.stats.drafters) == {"none"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_draft_model_reads_a_long_prompt_when_it_first_drafts(load64, model_dirs, temperature):
    """The draft model is fed nothing before its first level: then it reads the whole prompt (more
    than CATCH_UP tokens, in a forward of its own) and drafts; greedy output is the target's, and
    the sampled path runs the same catching up."""
    from specdec.drafters.model import CATCH_UP

    target = load64(model_dirs["llama"])
    drafter = AutoDrafter(ModelDrafter(load64(model_dirs["llama-near"])), None)
    prompt = list(range(1, 14)) * 3
    assert len(prompt) > CATCH_UP
    result = specdec.SpeculativeDecoder(target, drafter).generate(prompt, max_new_tokens=24, temperature=temperature,
                                                                  seed=3)
    assert result.stats.source_trials.get("model", [0])[0] > 0 and result.stats.draft_forwards > 0
    if temperature == 0:
        assert result.tokens == reference_greedy(target, prompt, 24)


def test_the_default_is_the_policy(model_dirs):
    decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-draft"], device="cpu")
    assert isinstance(decoder.drafter, AutoDrafter) and decoder.gamma == "auto"
    assert isinstance(decoder.policy(), CostAwarePolicy)
    lookup_only = specdec.load(model_dirs["llama"], device="cpu")
    assert isinstance(lookup_only.drafter, AutoDrafter) and lookup_only.drafter.model is None
    fixed = specdec.load(model_dirs["llama"], draft=model_dirs["llama-draft"], gamma=3, device="cpu")
    assert isinstance(fixed.drafter, ModelDrafter) and fixed.policy().depth(1) == 3
    chain_auto = specdec.SpeculativeDecoder(fixed.target, fixed.drafter, "auto")
    assert isinstance(chain_auto.policy(), CostAwareDepth)


def test_stats_say_what_the_policy_chose(model_dirs):
    decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], device="cpu")
    result = decoder.generate([1, 2, 3, 4, 1, 2, 3, 5, 1, 2], max_new_tokens=30, temperature=0)
    stats = result.stats
    assert len(stats.drafters) == stats.iterations == len(stats.tree_nodes) == len(stats.gammas)
    assert stats.to_dict()["drafters"] == stats.drafters
    assert any("model" in label for label in stats.drafters)


# ---------------------------------------------------------------- the policy's arithmetic


def test_a_node_joins_when_it_raises_tokens_per_second():
    budget = Budget(STEEP, batch=1, verify_size=1)
    assert budget.seconds == pytest.approx(1.1)
    assert budget.added_cost(1) == pytest.approx(0.04)  # t(2) - t(1)
    assert not budget.take_node(0.03) and budget.tokens == 1.0  # 0.03 / 0.04 < 1 / 1.1
    assert budget.take_node(0.9) and budget.tokens == pytest.approx(1.9) and budget.seconds == pytest.approx(1.14)
    assert not budget.take_level(0.05, 1)  # a draft forward (0.22 s) for 0.05 expected tokens does not pay
    assert budget.take_level(0.9, 1)


def test_a_chain_looks_past_a_step_in_the_cost_curve():
    """One node alone does not pay for the step from 3 to 4 tokens, but five more do."""
    stepped = costs.Profile(target={1: 1.0, 3: 1.1, 4: 1.5, 9: 1.6})
    values = [0.9, 0.8, 0.7, 0.6, 0.55, 0.5, 0.45, 0.4]
    myopic = Budget(stepped, 1, 1)
    taken = 0
    while taken < len(values) and myopic.take_node(values[taken]):
        taken += 1
    assert taken == 2
    assert Budget(stepped, 1, 1).take_chain(values) == 8
    assert Budget(stepped, 1, 1).take_chain([0.01, 0.01]) == 0


@settings(max_examples=400, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=2, max_size=6), st.lists(st.floats(0.0, 1.0), max_size=12),
       st.integers(1, 8), st.floats(0.0, 3.0), st.floats(0.0, 2.0))
def test_whether_some_prefix_pays_is_whether_the_best_prefix_takes_a_node(costs_at, values, batch, tokens, overhead):
    """`some_prefix_pays` answers from the first node where it can, exactly as `best_prefix(values) > 0`:
    over cost curves of any shape (steps included), batches, budgets part spent and chains of any values."""
    curve = costs.Profile(target={2 ** i: sum(costs_at[: i + 1]) for i in range(len(costs_at))}, step_overhead=overhead)
    budget = Budget(curve, batch, batch * 3)
    budget.tokens += tokens
    assert budget.some_prefix_pays(values) == (budget.best_prefix(values) > 0)


def test_a_negligible_first_node_never_pays_even_for_free_and_a_tie_takes_none():
    nearly_free = Budget(costs.Profile(target={1: 1.0, 2: 1.0 + 1e-7}), 1, 1)
    assert nearly_free.some_prefix_pays([0.01]) and nearly_free.best_prefix([0.01]) == 1
    assert not nearly_free.some_prefix_pays([0.004, 0.9]) and nearly_free.best_prefix([0.004, 0.9]) == 0
    even = Budget(costs.Profile(target={1: 1.0, 2: 1.5}), 1, 1)  # (1 + 0.5) / (1 + 0.5) tokens per second: as none
    assert not even.some_prefix_pays([0.5]) and even.best_prefix([0.5]) == 0


def test_a_big_batch_makes_nodes_dear():
    """In a batch of 64 rows a node costs each row a share of t(128) - t(64): far more than alone."""
    flat_then_linear = costs.Profile(target={1: 1.0, 16: 1.1, 64: 4.0, 128: 8.0})
    alone, crowded = Budget(flat_then_linear, 1, 1), Budget(flat_then_linear, 64, 64)
    assert alone.take_node(0.3)
    assert not crowded.take_node(0.3)


def test_confidence_bins_and_priors():
    assert [confidence_bin(p) for p in (0.0, 0.09, 0.5, 0.99, 1.0)] == [0, 0, 5, 9, 9]
    policy = CostAwarePolicy(STEEP)
    assert policy.accept_probability(("model", 9)) == pytest.approx(0.95)
    assert policy.accept_probability(("lookup", 0)) == pytest.approx(0.4)
    assert policy.accept_probability(("lookup", 3)) == pytest.approx(0.8)  # a next token, given the one before was accepted


def test_observing_counts_every_child_of_a_reached_node():
    from specdec.types import Draft, VerifyResult

    policy = CostAwarePolicy(STEEP)
    # root -> 0 (lookup), 1 (model); 0 -> 2 (lookup); accepted path [0]: nodes 0, 1 and 2 were tried
    draft = Draft(torch.tensor([5, 6, 7]), None, torch.tensor([-1, -1, 0]), [[("lookup", 0)], [("model", 9)], [("lookup", 1)]])
    policy.update(draft, VerifyResult(1, [5, 8], path=[0]))
    counts = {source: (a.offered, a.accepted) for source, a in policy.acceptance.items()}
    assert counts == {("lookup", 0): (1, 1), ("model", 9): (1, 0), ("lookup", 1): (1, 0)}
    assert policy.accept_probability(("lookup", 0)) == pytest.approx((1 + 0.4 * 2) / 3)
    assert policy.accept_probability(("model", 9)) == pytest.approx((0 + 0.95 * 4) / 5)
    # every position after the first shares one estimate: a next token given the one before was accepted
    assert policy.accept_probability(("lookup", 1)) == pytest.approx((0 + 0.8 * 2) / 3)
    assert policy.accept_probability(("lookup", 5)) == policy.accept_probability(("lookup", 1))


def test_sampling_a_child_after_the_accepted_one_was_never_tried():
    """`verify_tree` tries a node's children in order until one is accepted: when sampling, a child
    after the accepted one is no trial (greedy, above, it is: it did not spell the target's token)."""
    from specdec.types import Draft, VerifyResult

    draft = Draft(torch.tensor([5, 6, 7]), None, torch.tensor([-1, -1, 0]), [[("lookup", 0)], [("model", 9)], [("lookup", 1)]])
    for path, tried in (([0], {("lookup", 0): (1, 1), ("lookup", 1): (1, 0)}),
                        ([1], {("lookup", 0): (1, 0), ("model", 9): (1, 1)})):
        policy = CostAwarePolicy(STEEP, sampled=True)
        policy.update(draft, VerifyResult(1, [int(draft.tokens[path[0]]), 8], path=path))
        assert {source: (a.offered, a.accepted) for source, a in policy.acceptance.items() if a.offered} == tried
    keyed = CostAwarePolicy(STEEP, sampled=True, keyed=True)  # keyed draws accept the child spelling the target's token
    keyed.update(draft, VerifyResult(1, [5, 8], path=[0]))
    assert keyed.acceptance[("model", 9)].offered == 1


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_a_model_child_beside_a_looked_up_one_is_worth_what_that_one_leaves(temperature):
    """Sampling, the draft model's child of the root is tried only once the looked-up child before it is
    rejected: its value is what the looked-up one leaves of the root's, times its estimate. Greedy,
    siblings spell different tokens and each is accepted with its own chance, whatever the others."""
    from specdec.drafters.base import DraftTree

    drafter = AutoDrafter(ModelDrafter(TableLM(draft_table(), DRAFTER_PROMPT)), PromptLookupDrafter())
    policy = CostAwarePolicy(costs.Profile(target={1: 1.0, 64: 1.0}), sampled=temperature > 0)  # every node pays
    request = DraftRequest(drafter.open(DRAFTER_PROMPT), list(DRAFTER_PROMPT), 3, SamplingParams(temperature=temperature),
                           torch.Generator().manual_seed(0), policy)
    nodes = DraftTree()
    looked_up = nodes.add(2, -1, None, 0.6, ("copy", 0))
    assert nodes.unclaimed(-1) == pytest.approx(0.4) and nodes.unclaimed(looked_up) == pytest.approx(0.6)
    q = torch.tensor([0.2, 0.3, 0.5])
    grown = drafter._add_level(nodes, [-1], q[None], 1, 2, request, policy, policy.budget())  # greedy: 2 and 1
    drawn = next(node for node in grown if node != looked_up)
    estimate = policy.accept_probability(("model", confidence_bin(0.5 if temperature else float(q[1]))))
    assert nodes.values[drawn] == pytest.approx((0.4 if temperature else 1.0) * estimate)


def test_a_drawn_node_of_low_confidence_starts_near_half_accepted_not_at_its_confidence():
    """Sampling, a drawn node is accepted with sum(min(p, q)), about half the time on the demo pair even
    where the draft is unsure (benchmarks/chain_priors.py --model): where a node costs a fifth of a step
    (transformers on a CPU), a sampled policy drafts the draft model from the start and a level at
    confidence 0.15 pays; greedy, such a node (right 15% of the time) does not."""
    from specdec.policy import SAMPLED_MODEL_FLOOR

    profile = costs.Profile(target={1: 1.0, 2: 1.1, 64: 8.0}, draft={1: 0.1, 64: 0.6})
    sampled, greedy = CostAwarePolicy(profile, sampled=True), CostAwarePolicy(profile)
    unsure = ("model", confidence_bin(0.15))
    assert SAMPLED_MODEL_FLOOR <= sampled.accept_probability(unsure) < 0.5 and greedy.accept_probability(unsure) < 0.2
    sampled.depth(1)
    greedy.depth(1)
    assert sampled.may_pay("model") and sampled.budget().take_level(sampled.accept_probability(unsure), 1)
    assert not greedy.budget().take_level(greedy.accept_probability(unsure), 1)


@pytest.mark.parametrize("temperature", [0.7, 0.0], ids=["sampled", "greedy"])
def test_a_model_that_does_not_pay_reads_what_it_has_not_seen_at_its_own_cost_when_sampling(temperature):
    """A draft model that does not pay of its own accord may join a tree that a chain started, after
    reading the committed text it has not seen. Greedy, that reading is spread over the iterations
    left (such a model is often right, and drafts in them); sampling, its drawn nodes are accepted
    about half the time and it falls behind again, so this iteration pays all of it: here it does
    not join."""
    from specdec.drafters.base import DraftTree

    reading_dear = costs.Profile(target={1: 1.0, 64: 1.0}, draft={1: 0.01, 2: 2.0, 64: 40.0})  # verifying is free
    drafter = AutoDrafter(ModelDrafter(TableLM(draft_table(), DRAFTER_PROMPT)), PromptLookupDrafter())
    policy = CostAwarePolicy(reading_dear, sampled=temperature > 0)
    policy.depth(1)
    policy.paying = frozenset({"copy"})  # the model does not pay of its own accord
    slot = drafter.open(DRAFTER_PROMPT)
    request = DraftRequest(slot, list(DRAFTER_PROMPT), 60, SamplingParams(temperature=temperature),
                           torch.Generator().manual_seed(0), policy)
    unread = len(slot.pending)
    assert unread > 1 and policy.catch_up_cost(unread) > 3 and not policy.probe_model(unread)
    joined = next(drafter._grow_model(DraftTree(), request, policy, policy.budget()), None) is not None
    assert joined == (temperature == 0)


@pytest.mark.parametrize("at_least", [0, 8, 40])
def test_a_chains_values_are_its_estimates_multiplied_node_by_node(at_least):
    """`chain_values` (two estimates asked) against the slow reference: each node's estimate asked and
    multiplied in, cut where a value falls below NEGLIGIBLE, but never before `at_least` nodes (a probe)."""
    from specdec.policy import NEGLIGIBLE
    from specdec.types import Draft, VerifyResult

    policy = CostAwarePolicy(STEEP, sampled=True)
    policy.update(Draft(torch.tensor([5, 6]), None, torch.tensor([-1, 0]), [[("lookup", 0)], [("lookup", 1)]]),
                  VerifyResult(1, [5, 8], path=[0]))  # the next-token estimate moves off its prior
    reference, value = [], 1.0
    for position in range(40):
        value *= policy.accept_probability(("lookup", position))
        reference.append(value)
    kept = next(i for i, v in enumerate(reference) if v < NEGLIGIBLE)
    assert 1 < kept < 40
    assert policy.chain_values("lookup", 40, at_least) == reference[: max(kept, at_least)]
    assert policy.chain_values("lookup", 3, at_least) == reference[:3]


def test_batch_depth_drops_drafting_when_verify_rows_are_not_free():
    flat_then_linear = costs.Profile(target={1: 1.0, 8: 1.0, 16: 2.0, 1024: 128.0}, draft={1: 0.1, 64: 6.4})
    depth = BatchDepth(flat_then_linear, max_gamma=8, models_draft=True)  # α: its prior, 0.6
    assert depth.depth(1) >= 2  # alone, verifying up to 8 tokens costs what one does
    assert depth.depth(32) == 0  # 32 rows: every draft token costs each row another 1/8 step
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


# ---------------------------------------------------------------- measuring and caching


def test_profile_is_measured_once_and_cached(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    target = specdec.load_model(model_dirs["llama"], device="cpu")
    draft = specdec.load_model(model_dirs["llama-draft"], device="cpu")
    first = measured_profile(target, draft)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["target"]
    assert sorted(first.target) == sorted(k for k in profiling.SIZES if profiling.prefix_length(target) + k <= target.max_length)
    assert all(a <= b for a, b in zip(list(first.target.values()), list(first.target.values())[1:]))  # non-decreasing
    assert first.draft and first.rounds >= profiling.MIN_ROUNDS and first.step_overhead >= 0
    calls = []
    monkeypatch.setattr(profiling, "measure", lambda *args, **kw: calls.append(1))
    again = measured_profile(target, draft)
    assert not calls and again.target == first.target  # from the cache
    other = profiling.cache_key(specdec.load_model(model_dirs["qwen2"], device="cpu"), None)
    assert other != profiling.cache_key(target, draft) != profiling.cache_key(target, None)
    # the same files run another way: another attention, a static pool with and without the fused forward
    eager_attention = specdec.load_model(model_dirs["llama"], device="cpu", attn_implementation="eager")
    pools = [StaticHFModel(target.model, target.tokenizer, target.path, backend="static", fused=fused)
             for fused in (False, True)]
    keys = {profiling.cache_key(model, None) for model in (target, eager_attention, *pools)}
    assert len(keys) == 4


def test_waiting_for_a_core_is_measured(tmp_path):
    """Two processes spinning on the one core this test is pinned to: its threads wait for it about
    two thirds of the time; alone, next to none of it (or, on a machine whose other work shares that
    core, what that work takes: the spinners add theirs on top)."""
    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    if profiling._schedstat() == (0, 0):
        pytest.skip("this kernel keeps no per-thread scheduler statistics (/proc/self/task/*/schedstat)")
    core = min(os.sched_getaffinity(0))
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        alone = profiling.CoreWaits()
        with alone:
            spin(0.3)
        spinners = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                                      "while True: pass"]) for _ in range(2)]
        try:
            time.sleep(0.3)
            crowded = profiling.CoreWaits()
            with crowded:
                spin(0.6)
        finally:
            for spinner in spinners:
                spinner.kill()
    finally:
        os.sched_setaffinity(0, allowed)
    assert crowded.share > 0.4 and crowded.share > alone.share + 0.2, (alone.share, crowded.share)


def test_a_profile_measured_beside_other_work_is_not_kept_as_truth(model_dirs, tmp_path, monkeypatch, capsys):
    """Kept, it is used while the machine is busy (decoding corrects it, and the user is told) and
    measured again once it is quiet."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    target = specdec.load_model(model_dirs["llama-draft"], device="cpu")
    contended = costs.Profile(target={1: 1.0, 8: 2.0}, contention=0.4, step_overhead=0.1)
    assert not contended.trusted and costs.Profile(target={1: 1.0}, contention=0.05).trusted
    (tmp_path / f"{profiling.cache_key(target, None)}.json").write_text(json.dumps(contended.to_json()))
    calls = []
    monkeypatch.setattr(profiling, "measure", lambda *args, **kw: calls.append(1) or costs.Profile(target={1: 0.5}))
    monkeypatch.setattr(profiling, "quiet", lambda: False)
    assert measured_profile(target) == contended and not calls, "busy now: the kept one is used"
    monkeypatch.setattr(profiling, "profile", measured_profile)  # the suite's stub off
    specdec.SpeculativeDecoder(target, specdec.AutoDrafter(None, specdec.PromptLookupDrafter()))
    assert "measured while other work ran" in capsys.readouterr().err and not calls
    monkeypatch.setattr(profiling, "quiet", lambda: True)
    assert measured_profile(target).target == {1: 0.5} and calls == [1], "quiet now: measured again"
    assert measured_profile(target).target == {1: 0.5} and calls == [1], "and kept"


def test_a_damaged_cache_file_is_measured_again(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    target = specdec.load_model(model_dirs["llama-draft"], device="cpu")
    (tmp_path / f"{profiling.cache_key(target, None)}.json").write_text("{not json")
    assert measured_profile(target).target[1] > 0


def test_interpolation():
    curve = {1: 1.0, 4: 2.0, 8: 4.0}
    assert costs.interpolate(curve, 0) == 1.0 and costs.interpolate(curve, 2.5) == pytest.approx(1.5)
    assert costs.interpolate(curve, 16) == pytest.approx(8.0)
    assert CHEAP_VERIFY.draft_level(4) == pytest.approx(0.13 + 4 * 0.01)


def live_costs() -> costs.LiveCosts:
    """A profile that believes a verify of 8 costs 1.6 single ones (and 0.05 s of the engine's own
    work each step), with the real `observe` and `observe_draft` (the suite's fixture makes them
    no-ops elsewhere)."""
    live = costs.LiveCosts.of(costs.Profile(target={1: 1.0, 8: 1.6, 64: 8.0}, draft={1: 0.1, 8: 0.2},
                                            step_overhead=0.05, level_overhead=0.01))
    live.observe, live.observe_draft = live_observe.__get__(live), live_observe_draft.__get__(live)
    return live


def test_live_costs_take_the_shape_decoding_pays():
    """Steps seen at k = 1 and k = 8 reshape the curve of steps (forward and engine work): t(8) / t(1)
    becomes what the steps took, on the profile's scale (a plain step as measured); sizes between
    the seen ones are interpolated, sizes beyond follow the curve from the nearest; a stall moves it
    little."""
    live = live_costs()
    assert live.step(8) == pytest.approx(1.65)  # nothing seen yet: the curve as measured, its overhead included
    for _ in range(40):
        live.observe(1, 0.525)  # plain steps reuse their graph: half the measured step
        live.observe(8, 2.1)  # a verify of 8 pays for a rebuilt graph: 4 plain steps, not 1.6
    assert live.step(1) == pytest.approx(1.05) and live.step(8) == pytest.approx(4.2)
    assert 1.05 < live.step(4) < live.step(8) < live.step(16)
    assert live.step(64) == pytest.approx(8.05 * (2.1 / 1.65) / 0.5)
    live.observe(1, 100.0)  # a stall
    assert live.step(8) > 3.0
    assert costs.LiveCosts.of(costs.Profile(target={1: 1.0})).step(1) == 1.0


def test_a_step_that_pays_what_was_measured_leaves_the_costs_as_measured():
    """A verify phase holds the engine's own work: steps that take the profile's forward plus its
    overhead are as measured, the overhead counted once."""
    live = live_costs()
    for _ in range(40):
        live.observe(1, 1.05)
        live.observe(8, 1.65)
    assert live.factor(1) == pytest.approx(1.0) and live.factor(8) == pytest.approx(1.0)
    assert live.step(1) == pytest.approx(1.05) and live.step(8) == pytest.approx(1.65)


def test_the_plain_steps_after_a_draft_charge_their_slowness_to_the_draft():
    """llama.cpp rebuilds its graph when the batch shape changes, and a draft model's weights push
    the target's out of the CPU's caches: the plain steps after a drafting one are slower than
    steady ones, and the excess is the drafting step's cost, not a plain step's."""
    live = live_costs()
    for _ in range(40):
        live.observe(1, 1.05)
    for _ in range(40):
        live.observe(8, 2.1)
        live.observe(1, 2.55)  # 1.5 + 0.5 seconds more than a steady plain step, then steady again
        live.observe(1, 1.55)
        live.observe(1, 1.05)
    assert live.step(1) == pytest.approx(1.05) and live.factor(1) == pytest.approx(1.0)
    assert live.step(8) == pytest.approx(4.1)
    live.observe(8, 2.1)
    live.observe(8, 2.1)  # a drafting step after a drafting one: charged as it is
    assert live.step(8) < 4.1


def test_the_draft_models_forwards_follow_what_decoding_pays():
    """A draft level costs what the draft model's forwards took while decoding (their levels' own
    work included), relative to a plain step as decoding pays it; before any was seen, it moves as
    the plain step did. Reading unread text moves with it."""
    live = live_costs()
    for _ in range(40):
        live.observe(1, 0.525)  # plain steps at half the measured cost
    assert live.draft_level(1) == pytest.approx(0.11) and live.step(1) == pytest.approx(1.05)
    revision = live.revision
    forwards = [(3, 1), (1, 1)]  # a level reading two committed tokens more, then one
    expected = (0.1 + 0.1 * 2 / 7 + 0.01) + (0.1 + 0.01)
    for _ in range(40):
        live.observe_draft(forwards, 0.75 * expected)  # half as dear again as the plain steps, relatively
    assert live.revision > revision
    assert live.draft_level(1) == pytest.approx(0.11 * 1.5)
    assert live.reading(9) == pytest.approx((0.2 * 9 / 8 - 0.1) * 1.5)
    assert live.step(1) == pytest.approx(1.05)  # the target's curve is the target's
    no_draft = costs.LiveCosts.of(costs.Profile(target={1: 1.0}))
    no_draft.observe_draft = live_observe_draft.__get__(no_draft)
    no_draft.observe_draft([(1, 1)], 0.5)  # a profile without a draft curve has nothing to correct
    assert no_draft.draft_level(1) == 0.0 and not no_draft._drafts.classes


def test_a_proposal_reports_its_draft_forwards_to_the_live_costs(model_dirs):
    """The default and a draft model's trees at gamma "auto" tell the costs their draft model's forwards."""
    for tree in (None, 3):
        decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-draft"], tree=tree, device="cpu")
        live, seen = decoder.profile(), []
        live.observe_draft = lambda forwards, seconds: seen.append((forwards, seconds))
        result = decoder.generate("a b c d e f", max_new_tokens=12, temperature=0)
        assert seen and all(seconds > 0 and all(tokens >= rows >= 1 for tokens, rows in forwards)
                            for forwards, seconds in seen)
        assert sum(len(forwards) for forwards, _ in seen) <= result.stats.draft_forwards


def test_dear_verifies_seen_while_decoding_stop_the_policy_drafting():
    """The same policy drafts a long looked-up chain under the measured curve and none once the
    steps have shown a long verify to cost as much as decoding its tokens one by one."""
    live = live_costs()
    policy = CostAwarePolicy(live)

    def chain_length() -> int:
        policy.depth(1)
        return policy.budget().take_chain([0.9 ** (i + 1) for i in range(16)])

    assert chain_length() >= 4
    for k in (1, 2, 4, 8, 16):
        for _ in range(8):
            live.observe(k, 0.5 * k)
    assert chain_length() == 0


def test_sources_that_could_not_pay_are_not_searched_and_the_drafts_stay_the_same(model_dirs, monkeypatch):
    """Where only a copy could pay from an empty budget (a dear verify: lookup's and the model's
    priors do not pay), the default searches the text only when its last COPY_MATCH tokens occur
    earlier, and asks nothing of the draft model: every step's draft is what weighing every source
    would have made."""
    dear = costs.Profile(target={1: 1.0, 2: 1.6, 8: 3.0, 64: 20.0}, draft={1: 0.1, 8: 0.2}, step_overhead=0.05)
    monkeypatch.setattr(profiling, "profile", lambda target, draft=None, refresh=False: dear)
    searches = []
    search = auto_module.lookup_match
    monkeypatch.setattr(auto_module, "lookup_match", lambda *args: searches.append(1) or search(*args))

    def run(weigh_all: bool, prompt: str, temperature: float):
        with monkeypatch.context() as patch:
            if weigh_all:
                patch.setattr(CostAwarePolicy, "may_pay", lambda self, kind: True)
            decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-draft"], device="cpu")
            searches.clear()
            result = decoder.generate(prompt, max_new_tokens=40, temperature=temperature, seed=3)
            return (result.tokens, result.stats.drafters, result.stats.tree_nodes), len(searches)

    saved = 0
    for prompt in ("a b c d e f g h", "ab cd ab cd ab cd ab cd"):
        for temperature in (0, 0.8):
            (fast, searched), (full, all_searched) = run(False, prompt, temperature), run(True, prompt, temperature)
            assert fast == full
            saved += all_searched - searched
    assert saved > 0


def test_the_engine_reports_each_step_to_the_live_costs(model_dirs):
    decoder = specdec.load(model_dirs["llama"], device="cpu")
    live = decoder.profile()
    seen = []
    live.observe = lambda tokens, seconds: seen.append((tokens, seconds))
    result = decoder.generate("ab ab ab ab", max_new_tokens=12, temperature=0)
    assert len(seen) == result.stats.target_forwards and all(seconds > 0 for _, seconds in seen)
    assert [tokens - 1 for tokens, _ in seen] == result.stats.tree_nodes  # the root and the draft's nodes


def test_branches_stay_within_the_sequence_id_budget():
    """Cheap verification would branch the greedy tree widely; each extra branch costs a llama.cpp
    sequence id, so the drafter stops at max_branches."""
    counts = []
    for max_branches in (0, 1, 6):
        drafter = AutoDrafter(ModelDrafter(TableLM(draft_table(), DRAFTER_PROMPT)), PromptLookupDrafter(), max_branches=max_branches)
        request = DraftRequest(drafter.open(DRAFTER_PROMPT), list(DRAFTER_PROMPT), 4, SamplingParams(temperature=0), None,
                               CostAwarePolicy(CHEAP_VERIFY, max_depth=4))
        proposal, = drafter.propose([request])
        parents = proposal.parents.tolist()
        counts.append(sum(1 for i, parent in enumerate(parents) if parent in parents[:i]))
    assert counts[0] == 0 and counts[1] == 1 and counts[2] >= 2, counts


def test_probes_back_off_until_the_source_pays_of_its_own_accord():
    """A probe, accepted or not, that leaves the source unchosen doubles the wait; a draft of the
    source that the estimates chose starts the schedule over."""
    from specdec.types import Draft, VerifyResult

    policy = CostAwarePolicy(STEEP)
    nothing = Draft(torch.zeros(0, dtype=torch.long), sources=[])
    probed = Draft(torch.tensor([3]), sources=[[("model", 5)]])
    waits = []
    for accepted in (False, True, False):
        for _ in range(policy.probes["model"].wait):
            policy.depth(1)
            assert not policy.probe_model(1)
            policy.update(nothing, VerifyResult(0, [1]))
        policy.depth(1)
        assert policy.probe_model(1)
        policy.update(probed, VerifyResult(1, [3, 4], path=[0]) if accepted else VerifyResult(0, [4], path=[]))
        waits.append(policy.probes["model"].wait)
    assert waits == [16, 32, 64]
    policy.depth(1), policy.update(probed, VerifyResult(1, [3, 4], path=[0]))
    assert policy.probes["model"].wait == 8  # not a probe: the model drafted of its own accord


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("profile", [
    costs.Profile(target={1: 1.0, 2: 1.7, 4: 2.0, 8: 3.8, 16: 4.7, 64: 14.0}, draft={1: 0.18, 16: 0.5}, step_overhead=0.1),
    costs.Profile(target={1: 1.0, 2: 1.3, 4: 1.8, 8: 2.8, 16: 4.8, 64: 17.0}, draft={1: 0.3, 16: 1.0}),
], ids=["llama.cpp CPU", "gentler"])
def test_depth_answers_at_once_what_looking_again_would(profile, sampled):
    """`depth` answers the iterations its last finding stands for without looking again
    (`_steady_for`), and the steps that draft nothing are taken in when next asked (the probes'
    waits, the live costs' timings). A policy that looks every iteration and takes in every step as
    it comes answers the same, probes the same and lets the same sources be weighed, over many
    steps, some drafting (accepted or not), with live costs moving and the batch changing now and
    then; and the shortcut is taken most of the time."""
    import random

    from specdec.types import Draft, VerifyResult

    policies = [CostAwarePolicy(costs.LiveCosts.of(profile), sources=("model", "lookup", "copy"), sampled=sampled)
                for _ in range(2)]
    for policy in policies:  # the real correction, not the suite's no-op (conftest)
        policy.profile.observe = live_observe.__get__(policy.profile)
    policies[1]._steady_for = lambda: 0  # looks every iteration
    policies[1].profile.UNREAD = 1  # takes in every step's timing as it comes
    rng, shortcuts, changes, answered_0, paying, deferred = random.Random(7), 0, 0, 0, None, [0, 0]
    for step in range(4000):
        batch = 2 if step % 500 > 490 else 1
        shortcuts += bool(policies[0].steady_for)
        seen = []
        for policy in policies:
            depth = policy.depth(batch)
            weighed = [policy.may_pay(kind) for kind in ("model", "lookup", "copy")] if depth else []
            seen.append((depth, weighed, depth and policy.probe_model(3), depth and policy.probe_tokens("lookup")))
        assert seen[0] == seen[1], step
        changes += policies[0].paying != paying
        paying, answered_0 = policies[0].paying, answered_0 + (not seen[0][0])
        _, weighed, probed_model, probed_lookup = seen[0]
        copies = 4 if weighed and weighed[2] and rng.random() < 0.2 else 0  # the text copies now and then
        sources = [[("model", 7)]] * bool(probed_model) + [[("lookup", i)] for i in range(probed_lookup)] + \
            [[("copy", i)] for i in range(copies)]
        draft = Draft(torch.arange(len(sources)), None, torch.arange(len(sources)) - 1, sources)
        copying = step // 400 % 2 == 0  # the text copies for a while, then stops (and no source pays)
        accepted = rng.randint(0, len(sources)) if copying else 0
        seconds = profile.step(1 + len(sources)) * rng.uniform(0.8, 1.3)
        for policy in policies:
            policy.update(draft, VerifyResult(accepted, [1] * (accepted + 1), path=list(range(accepted))))
            policy.profile.observe(1 + len(sources), seconds)
        policies[1]._waits()  # and every probe's wait
        assert not policies[1].waited and not policies[1].profile._unread
        deferred[0] += policies[0].waited > 1
        deferred[1] += len(policies[0].profile._unread) > 1
    assert shortcuts > 2000 and changes > 4 and 100 < answered_0 < 3500, (shortcuts, changes, answered_0)
    assert min(deferred) > 100, deferred  # the shortcuts were taken: not a check of the eager path against itself


def test_dear_probes_of_the_draft_model_are_made_rarely():
    """A probe of the draft model waits until the credit (EXPLORE_SHARE of each iteration) pays for
    it: where verifies are nearly flat, on schedule (PROBE_MODEL_EVERY); where one more verified
    node costs a whole step, after its cost (a node, a level, and reading the text it has not
    seen) over EXPLORE_SHARE iterations."""
    from specdec.policy import EXPLORE_SHARE, PROBE_MODEL_EVERY
    from specdec.types import Draft, VerifyResult

    def first_probe(profile) -> int:
        policy = CostAwarePolicy(profile)
        for iteration in range(1000):
            policy.depth(1)
            if policy.probe_model(iteration + 1):  # the draft model has not read the text since
                return iteration
            policy.update(Draft(torch.zeros(0, dtype=torch.long), sources=[]), VerifyResult(0, [1]))
        return 1000

    dear = costs.Profile(target={1: 1.0, 2: 2.0, 128: 128.0}, draft={1: 0.05, 64: 0.5})
    assert first_probe(STEEP) == PROBE_MODEL_EVERY
    # a node (1.0) and a level (0.05), plus reading ~80 tokens (0.56)
    assert (1.0 + 0.05) / EXPLORE_SHARE < first_probe(dear) <= (1.0 + 0.05 + 0.6) / EXPLORE_SHARE


def probed_share(policy: CostAwarePolicy, iterations: int) -> tuple[float, int]:
    """Run a policy under which no estimate pays, every probe rejected, the draft model reading the
    text it has not seen when probed; returns the share of the time (as its profile prices it) that
    went to probes, and how many there were."""
    from specdec.types import Draft, VerifyResult

    profile, plain, spent, probes, unread = policy.profile, 0.0, 0.0, 0, 1
    for _ in range(iterations):
        policy.depth(1)
        model = policy.probe_model(unread) if "model" in policy.probes else False
        chain = policy.probe_tokens("lookup")
        nodes = int(model) + chain
        step = profile.step(1 + nodes)
        if model:
            step += policy.catch_up_cost(unread) + profile.draft_level(1)
        plain += profile.step(1)
        spent += step
        probes += bool(nodes)
        unread = 1 if model else unread + 1
        sources = [[("model", 5)]] * model + [[("lookup", i)] for i in range(chain)]
        draft = Draft(torch.arange(nodes), None, torch.arange(nodes) - 1, sources)
        policy.update(draft, VerifyResult(0, [1], path=[]))
    return (spent - plain) / spent, probes


@pytest.mark.parametrize("profile", [
    costs.Profile(target={1: 1.0, 128: 128.0}, draft={1: 0.3, 128: 30.0}),  # a verify of k: k steps
    costs.Profile(target={1: 1.0, 2: 2.4, 4: 2.9, 8: 4.2, 16: 6.6, 128: 36.0}, draft={1: 0.22, 16: 1.4, 128: 8.0}),
    STEEP,
], ids=["linear", "llama.cpp CPU", "steep"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_probes_of_every_source_together_take_at_most_the_explore_share(profile, sampled):
    """Where nothing pays, probing the draft model and lookup, each on its schedule, costs at most
    EXPLORE_SHARE of decoding's time (SAMPLED_EXPLORE_SHARE when sampling), however dear a verify
    (the demo pair on llama.cpp's CPU kernels: a verify of 2 at 2.4 steps); and probes are still made."""
    from specdec.policy import EXPLORE_SHARE, SAMPLED_EXPLORE_SHARE

    bound = SAMPLED_EXPLORE_SHARE if sampled else EXPLORE_SHARE
    share, probes = probed_share(CostAwarePolicy(profile, sources=("model", "lookup"), sampled=sampled), 5000)
    assert probes >= 5 and share <= bound * 1.01, (share, probes)


def test_lookup_is_probed_where_its_estimate_never_pays_and_then_drafted_long():
    """On a machine where a verify of k tokens costs k forwards (no estimate can pay), nothing is
    drafted but a probe of PROBE_CHAIN_TOKENS lookup tokens once the credit pays for it; where a
    long verify is cheap, one accepted probe makes the looked-up chains run long at once. Without
    `explore`, no probe."""
    from specdec.policy import EXPLORE_SHARE, PROBE_CHAIN_EVERY, PROBE_CHAIN_TOKENS
    from specdec.types import Draft, VerifyResult

    def iteration(policy, accept_all: bool) -> int:
        policy.depth(1)
        budget = policy.budget()
        values, value = [], 1.0
        for position in range(40):
            value *= policy.accept_probability(("lookup", position))
            values.append(value)
        count = budget.take_chain(values, at_least=policy.probe_tokens("lookup"))
        draft = Draft(torch.arange(count), None, torch.arange(count) - 1, [[("lookup", i)] for i in range(count)])
        accepted = count if accept_all else 0
        policy.update(draft, VerifyResult(accepted, list(range(accepted + 1)), path=list(range(accepted))))
        return count

    linear = costs.Profile(target={1: 1.0, 128: 128.0})
    policy = CostAwarePolicy(linear)
    counts = [iteration(policy, accept_all=False) for _ in range(2000)]
    first = PROBE_CHAIN_TOKENS / EXPLORE_SHARE  # iterations until the credit pays for 8 tokens of one step each
    assert set(counts) == {0, PROBE_CHAIN_TOKENS} and first - 1 <= counts.index(PROBE_CHAIN_TOKENS) <= first + 1
    assert all(iteration(CostAwarePolicy(linear, explore=False), accept_all=True) == 0 for _ in range(3 * PROBE_CHAIN_EVERY))
    cheap_long = costs.Profile(target={1: 1.0, 8: 1.4, 64: 3.0})
    policy = CostAwarePolicy(cheap_long)
    before = iteration(policy, accept_all=True)  # the priors' choice, accepted in full
    after = iteration(policy, accept_all=True)
    assert before >= 1 and after >= 2 * before


def test_cli_profile_shows_the_curves(model_dirs, tmp_path, capsys):
    from specdec.cli import main

    argv = ["profile", "--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"], "--device", "cpu"]
    assert main([*argv, "--plot", str(tmp_path / "costs.png")]) == 0
    out = capsys.readouterr().out
    assert "| k | target ms | × k=1 | draft ms |" in out and "| 16 | 1500.00 | 1.50 | 200.00 |" in out
    assert "engine time per iteration outside the target's forward: 50.00 ms" in out
    assert (tmp_path / "costs.png").stat().st_size > 0
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"]["1"] == 1.0
    assert main([*argv, "--plot", str(tmp_path / "missing" / "costs.png")]) == 1
    assert "could not write" in capsys.readouterr().err


def test_stats_line_says_what_the_policy_chose(model_dirs, capsys):
    from specdec.cli import main

    code = main(["generate", "abcabcabc", "--target", model_dirs["llama"], "--draft", model_dirs["llama-near"], "--device", "cpu",
                 "--temperature", "0", "--max-new-tokens", "20"])
    err = capsys.readouterr().err
    assert code == 0 and "drafter auto (draft model + prompt lookup), gamma auto" in err and "drafted by " in err


def test_a_match_within_the_prompt_is_not_a_copy_before_the_first_token():
    """The prompt's end repeats 5 earlier tokens (a turn marker, say): before the generation's first
    token that is the prompt's own frame and its continuation is drafted as "lookup"; once the
    generation has written tokens, the same match is a copy."""
    context = [5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7, 8, 9]
    drafter = AutoDrafter(None, PromptLookupDrafter())

    def kinds(generated: int) -> set[str]:
        request = DraftRequest(drafter.open(context), context, 3, SamplingParams(temperature=0), None,
                               CostAwarePolicy(CHEAP_VERIFY, max_depth=3), generated=generated)
        proposal, = drafter.propose([request])
        assert proposal.tokens.tolist() == [1, 2, 3]
        return {kind for node in proposal.sources for kind, _ in node}

    assert kinds(generated=0) == {"lookup"} and kinds(generated=1) == {"copy"}
