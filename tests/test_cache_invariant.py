"""After every iteration both KV caches equal a fresh prefill of the committed text (pitfall 5)."""

from __future__ import annotations

import pytest
import torch

import specdec
from conftest import ARCHS
from specdec.engine import AdaptiveGamma, FixedGamma, decode
from specdec.sampling import RandomStreams
from specdec.types import GenerationStats, SamplingParams


def assert_cache_is_fresh_prefill(sequence, tokens: list[int], reference: specdec.CausalLM):
    """An HF sequence's keys and values equal those of a fresh prefill of `tokens`."""
    assert sequence.cache_len == len(tokens)
    fresh = reference.sequence()
    if tokens:
        fresh.forward(tokens)
    for (keys, values), (fresh_keys, fresh_values) in zip(sequence.cache_tensors(), fresh.cache_tensors()):
        torch.testing.assert_close(keys, fresh_keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(values, fresh_values, rtol=0, atol=1e-10)


def decode_checking_caches(model_dirs, arch: str, temperature: float, make_drafter):
    """Decode 48 tokens of `arch` with a drafter over its near copy (partial acceptance even when
    greedy); after every iteration both caches must equal a fresh prefill of the committed text.
    Returns the stats and how many tokens each draft sync left pending."""
    load = lambda key: specdec.load_model(model_dirs[key], device="cpu", dtype="float64")
    target, draft = load(arch), load(f"{arch}-near")
    fresh_target, fresh_draft = load(arch), load(f"{arch}-near")
    drafter = make_drafter(draft)
    target_sequences = record_sequences(target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    stats = GenerationStats()
    policy = AdaptiveGamma(start=3) if temperature else FixedGamma(3)
    steps = decode(target, drafter, prompt, SamplingParams(temperature=temperature), 48, policy, RandomStreams(0), stats)
    context, pending_counts = list(prompt), []
    for step in steps:
        context += step.tokens
        if step.finish_reason:
            break
        assert_cache_is_fresh_prefill(target_sequences[-1], context[:-1], fresh_target)
        # the draft cache still holds the last proposal; its sync (the start of every propose)
        # cuts it back to the committed text (for a tree: onto the accepted path), never
        # recomputing an accepted token
        pending = drafter.sync(context)
        assert drafter._cached + pending == context and pending
        pending_counts.append(len(pending))
        assert_cache_is_fresh_prefill(drafter.cache, drafter._cached, fresh_draft)
    assert stats.iterations >= 10
    return stats, pending_counts


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_caches_track_committed_text(arch, temperature, model_dirs):
    stats, pending_counts = decode_checking_caches(model_dirs, arch, temperature, specdec.ModelDrafter)
    assert max(pending_counts) <= 2, "at most the last accepted draft token and the bonus are pending"
    assert 0 < stats.accepted < stats.drafted, "the run should include acceptances and rejections"


def record_sequences(model) -> list:
    """The sequences the engine opens on `model`, in order (the engine owns them, tests look)."""
    opened, open_sequence = [], model.sequence
    model.sequence = lambda: opened.append(open_sequence()) or opened[-1]
    return opened


def test_keep_selects_cache_entries(model_dirs):
    model = specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")
    sequence, reference = model.sequence(), model.sequence()
    sequence.forward([1, 2, 3, 4, 5], [-1, 0, 1, 2, 2])  # entries 3 and 4 are siblings below entry 2
    sequence.keep(3, [4])  # drop entry 3; entry 4 moves to slot 3
    reference.forward([1, 2, 3, 4, 5], [-1, 0, 1, 2, 2])
    for (keys, _), (ref_keys, _) in zip(sequence.cache_tensors(), reference.cache_tensors()):
        torch.testing.assert_close(keys, ref_keys[..., [0, 1, 2, 4], :], rtol=0, atol=0)
    assert sequence.cache_len == 4
