"""Greedy speculative output is token-identical to a no-cache reference (float64), for every drafter."""

from __future__ import annotations

import pytest

import specdec
from conftest import ARCHS, reference_greedy
from fakes import ScriptedDrafter
from specdec.katz import KatzTrigram

PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]  # repeats, so prompt lookup has something to find
NEW = 40


@pytest.fixture(scope="module")
def ngram(load64, model_dirs):
    """A trigram built from the target's own greedy text, so its drafts are often right."""
    target = load64(model_dirs["llama"])
    text = PROMPT + reference_greedy(target, PROMPT, NEW)
    return KatzTrigram.build([text, text[::-1]], vocab_size=target.vocab_size)


def drafters(arch, load64, model_dirs, ngram):
    return {
        "draft-model": specdec.ModelDrafter(load64(model_dirs[f"{arch}-draft"])),
        "near-copy": specdec.ModelDrafter(load64(model_dirs[f"{arch}-near"])),
        "draft-model-other-arch": specdec.ModelDrafter(load64(model_dirs["qwen2-draft" if arch != "qwen2" else "gpt2-draft"])),
        "prompt-lookup": specdec.PromptLookupDrafter(),
        "ngram": specdec.NgramDrafter(ngram, stochastic=True),
        "ngram-top1": specdec.NgramDrafter(ngram, stochastic=False),
        "auto": specdec.AutoDrafter(specdec.ModelDrafter(load64(model_dirs[f"{arch}-near"])), specdec.PromptLookupDrafter()),
        "auto-lookup-only": specdec.AutoDrafter(None, specdec.PromptLookupDrafter()),
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_every_drafter_matches_reference(arch, load64, model_dirs, ngram):
    target = load64(model_dirs[arch])
    want = reference_greedy(target, PROMPT, NEW)
    assert specdec.SpeculativeDecoder(target).generate(PROMPT, max_new_tokens=NEW, temperature=0).tokens == want
    for name, drafter in drafters(arch, load64, model_dirs, ngram).items():
        for gamma in (1, 3, "auto"):
            result = specdec.SpeculativeDecoder(target, drafter, gamma=gamma).generate(PROMPT, max_new_tokens=NEW, temperature=0)
            assert result.tokens == want, f"{name}, gamma={gamma}"
            assert result.stats.target_forwards <= NEW


@pytest.mark.parametrize("arch", ARCHS)
def test_scripted_rejections_at_chosen_places(arch, load64, model_dirs):
    target = load64(model_dirs[arch])
    want = reference_greedy(target, PROMPT, NEW)
    wrong_at = {len(PROMPT) + i for i in (0, 1, 5, 6, 7, 13, 20, 21, 39)}
    drafter = ScriptedDrafter(PROMPT + want, wrong_at, target.vocab_size)
    result = specdec.SpeculativeDecoder(target, drafter, gamma=4).generate(PROMPT, max_new_tokens=NEW, temperature=0)
    assert result.tokens == want
    stats = result.stats
    # every iteration stops at the first wrong draft or takes all 4; so the count of rejections is exact
    rejections = sum(1 for drafted, accepted in zip(stats.gammas, stats.accepted_lengths) if accepted < drafted)
    assert rejections == len(wrong_at) - 1  # the last wrong position is beyond every draft (the final token is never drafted)
    assert stats.accepted == NEW - stats.iterations


def test_perfect_drafter_needs_few_target_forwards(load64, model_dirs):
    target = load64(model_dirs["llama"])
    want = reference_greedy(target, PROMPT, NEW)
    drafter = ScriptedDrafter(PROMPT + want, set(), target.vocab_size)
    result = specdec.SpeculativeDecoder(target, drafter, gamma=4).generate(PROMPT, max_new_tokens=NEW, temperature=0)
    assert result.tokens == want
    assert result.stats.target_forwards == NEW // 5  # every iteration: 4 accepted + 1 bonus
    assert result.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_token_prompt_needs_no_prefill(load64, model_dirs, temperature):
    target = load64(model_dirs["llama"])
    decoder = specdec.SpeculativeDecoder(target, specdec.ModelDrafter(load64(model_dirs["llama-near"])), gamma=3)
    result = decoder.generate([5], max_new_tokens=12, temperature=temperature, seed=0)
    assert len(result.tokens) == 12
    if not temperature:
        assert result.tokens == reference_greedy(target, [5], 12)


def test_padded_draft_embeddings_are_restricted_to_the_vocabulary(load64, model_dirs):
    target = load64(model_dirs["llama"])
    draft = load64(model_dirs["llama-padded"])
    assert draft.model.get_output_embeddings().weight.shape[0] > draft.vocab_size == target.vocab_size
    result = specdec.SpeculativeDecoder(target, specdec.ModelDrafter(draft), gamma=3).generate(PROMPT, max_new_tokens=NEW, temperature=0)
    assert result.tokens == reference_greedy(target, PROMPT, NEW)


def test_eos_inside_accepted_tokens_ends_generation(load64, model_dirs):
    target = load64(model_dirs["llama-eos"])
    eos = target.tokenizer.eos_token_id
    free = reference_greedy(target, PROMPT, 60)
    assert eos in free, "the fixture model should emit EOS within 60 tokens"
    want = free[: free.index(eos)]
    drafter = ScriptedDrafter(PROMPT + free, set(), target.vocab_size)
    result = specdec.SpeculativeDecoder(target, drafter, gamma=6).generate(PROMPT, max_new_tokens=60, temperature=0)
    assert (result.tokens, result.finish_reason) == (want, "stop")
