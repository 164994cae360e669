"""Token trees and staged drafting end to end on tiny saved models: greedy equality with the
no-cache reference, the target's joint distribution (chi-square), and fresh-prefill caches."""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.runtime.hf import HFSequence
from conftest import ARCHS, reference_greedy
from specdec import engine
from specdec.katz import KatzTrigram
from test_cache_invariant import decode_checking_caches
from test_statistical import PROMPT as STAT_PROMPT, SETTINGS, assert_follows_target

PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
NEW = 40


def tree_drafters(arch, load64, model_dirs, ngram):
    near, draft = load64(model_dirs[f"{arch}-near"]), load64(model_dirs[f"{arch}-draft"])
    return {
        "tree": specdec.ModelDrafter(draft, tree=specdec.TreeShape(nodes=8)),
        "near tree": specdec.ModelDrafter(near, tree=specdec.TreeShape(nodes=10, width=2)),
        "near wide tree": specdec.ModelDrafter(near, tree=specdec.TreeShape(nodes=16, width=4)),
        "staged lookup": specdec.ModelDrafter(near, inner=specdec.PromptLookupDrafter(), inner_gamma=3),
        "staged ngram tree": specdec.ModelDrafter(near, tree=specdec.TreeShape(nodes=7), inner=specdec.NgramDrafter(ngram), inner_gamma=2),
    }


@pytest.fixture(scope="module")
def ngram(load64, model_dirs):
    target = load64(model_dirs["llama"])
    text = PROMPT + reference_greedy(target, PROMPT, NEW)
    return KatzTrigram.build([text, text[::-1]], vocab_size=target.vocab_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_trees_match_reference(arch, load64, model_dirs, ngram):
    target = load64(model_dirs[arch])
    want = reference_greedy(target, PROMPT, NEW)
    for name, drafter in tree_drafters(arch, load64, model_dirs, ngram).items():
        for depth in (1, 3, 5, "auto"):
            result = specdec.SpeculativeDecoder(target, drafter, gamma=depth).generate(PROMPT, max_new_tokens=NEW, temperature=0)
            assert result.tokens == want, f"{name}, depth={depth}"
            if drafter.tree is not None and depth in (3, 5):
                assert max(result.stats.tree_nodes) > depth, f"{name}: a tree, not a chain, was verified"
                # one batched draft forward per level: draft forwards follow the depth, not the node count
                assert result.stats.draft_forwards <= result.stats.iterations * depth


def test_greedy_trees_need_fewer_target_forwards_than_chains(load64, model_dirs):
    """Siblings catch what the chain misses. Per prompt a best-first tree can lose (its budget may cut
    the chain's deepest node), so the claim is over all five architectures' near copies."""
    forwards = {"chain": 0, "tree": 0}
    for arch in ARCHS:
        target, near = load64(model_dirs[arch]), load64(model_dirs[f"{arch}-near"])
        for kind, drafter in [("chain", specdec.ModelDrafter(near)), ("tree", specdec.ModelDrafter(near, tree=specdec.TreeShape(nodes=16, width=4)))]:
            result = specdec.SpeculativeDecoder(target, drafter, gamma=4).generate(PROMPT, max_new_tokens=NEW, temperature=0)
            forwards[kind] += result.stats.target_forwards
    assert forwards["tree"] < 0.85 * forwards["chain"], forwards


@pytest.fixture(scope="module")
def stat_target(model_dirs):
    return specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def stat_drafters(model_dirs):
    draft = specdec.load_model(model_dirs["qwen2-draft"], device="cpu", dtype="float64")
    rng = torch.Generator().manual_seed(5)
    corpus = [torch.randint(0, 16, (200,), generator=rng).tolist() for _ in range(5)]
    ngram = KatzTrigram.build([STAT_PROMPT * 3] + corpus, vocab_size=16)
    return {
        "tree": specdec.ModelDrafter(draft, tree=specdec.TreeShape(nodes=6, width=3)),
        "tree-top": specdec.ModelDrafter(draft, tree=specdec.TreeShape(nodes=6, width=3, sampled=False)),
        "staged-tree": specdec.ModelDrafter(draft, tree=specdec.TreeShape(nodes=5, width=2), inner=specdec.NgramDrafter(ngram), inner_gamma=2),
    }


# trees at top-k and top-p are also held to the joint on llama.cpp (test_llamacpp), with heads (test_head,
# test_eagle3) and in a busy batch (test_batching); here each tree kind once more, in the suite's time
@pytest.mark.parametrize(
    "drafter_name,setting", [("tree", "t1"), ("tree-top", "t1"), ("staged-tree", "t1")],
)
@pytest.mark.statistical
def test_tree_output_follows_target_joint(stat_target, stat_drafters, drafter_name, setting):
    """4000 generations of 3 tokens (trees 2 deep): the joint must be the target's (chi-square)."""
    decoder = specdec.SpeculativeDecoder(stat_target, stat_drafters[drafter_name], gamma=2)
    assert_follows_target(decoder, SETTINGS[setting], seed_key=f"tree/{drafter_name}/{setting}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("staged", [False, True], ids=["tree", "staged-tree"])
def test_caches_track_committed_text_through_trees(arch, temperature, staged, model_dirs, monkeypatch):
    paths = []
    verify = engine._verify
    monkeypatch.setattr(engine, "_verify", lambda *a: paths.append(verify(*a).path) or verify(*a))
    inner = specdec.PromptLookupDrafter() if staged else None
    make_drafter = lambda draft: specdec.ModelDrafter(draft, tree=specdec.TreeShape(nodes=8, width=3), inner=inner, inner_gamma=2)
    stats, _ = decode_checking_caches(model_dirs, arch, temperature, make_drafter)
    if temperature or not staged:  # a greedy spine of the near copy may never miss
        assert any(path != list(range(len(path))) for path in paths), "some accepted path must leave the first branch"
    assert sum(s.accepted for s in stats) > 0  # and every iteration drops the nodes off the accepted path


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trees_fit_the_cache_at_the_context_end(load64, model_dirs, monkeypatch, temperature):
    """Finding: near the end of the context a tree's nodes took more cache slots than the context
    has (a crash on models with buffers sized to it, e.g. 64 vs 66). Drafts are cut to the slots
    left, for the target and inside the draft model; the output is still the target's."""
    target, near = load64(model_dirs["llama"]), load64(model_dirs["llama-near"])
    fed = []
    real_forward = HFSequence.forward

    def recording_forward(sequence, tokens, *args, **kwargs):
        fed.append(sequence.cache_len + len(tokens))
        return real_forward(sequence, tokens, *args, **kwargs)

    monkeypatch.setattr(HFSequence, "forward", recording_forward)
    prompt = PROMPT * 4 + PROMPT[:8]  # 48 of 64 positions
    for drafter in (specdec.ModelDrafter(near, tree=specdec.TreeShape(nodes=16, width=4)),
                    specdec.ModelDrafter(near, tree=specdec.TreeShape(nodes=12, width=3), inner=specdec.PromptLookupDrafter(), inner_gamma=4)):
        fed.clear()
        result = specdec.SpeculativeDecoder(target, drafter, gamma=5).generate(prompt, max_new_tokens=30, temperature=temperature, seed=0)
        assert len(result.tokens) == 16 and result.finish_reason == "length"
        if not temperature:
            assert result.tokens == reference_greedy(target, prompt, 16)
        assert max(fed) == target.max_length, "the cache filled to the context's end, never past it"
