"""After every iteration both KV caches equal a fresh prefill of the committed text (pitfall 5)."""

from __future__ import annotations

import pytest
import torch

import specdec
from conftest import ARCHS
from conftest import CHEAP_VERIFY
from specdec.engine import DecodeState, Engine
from specdec.policy import CostAwareDepth, FixedGamma
from specdec.sampling import RandomStreams
from specdec.params import SamplingParams


def assert_cache_is_fresh_prefill(sequence, tokens: list[int], reference: specdec.CausalLM):
    """An HF sequence's keys and values equal those of a fresh prefill of `tokens`."""
    assert sequence.cache_len == len(tokens)
    fresh = reference.sequence()
    if tokens:
        fresh.forward(tokens)
    for (keys, values), (fresh_keys, fresh_values) in zip(sequence.cache_tensors(), fresh.cache_tensors()):
        torch.testing.assert_close(keys, fresh_keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(values, fresh_values, rtol=0, atol=1e-10)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7]]


def decode_checking_caches(model_dirs, arch: str, temperature: float, make_drafter):
    """Decode 48 tokens for three prompts at once (one batch) with a drafter over `arch`'s near copy
    (partial acceptance even when greedy); after every step, each row's target cache must equal a
    fresh prefill of its committed text but the last token, and its draft slot must hold committed
    text only (a tree cut onto the accepted path) with the rest pending.
    Returns the stats of every row and how many tokens each step left pending in a draft slot."""
    load = lambda key: specdec.load_model(model_dirs[key], device="cpu", dtype="float64")
    target, draft = load(arch), load(f"{arch}-near")
    fresh_target, fresh_draft = load(arch), load(f"{arch}-near")
    engine = Engine(target, make_drafter(draft))
    states = []
    for i, prompt in enumerate(PROMPTS):
        policy = CostAwareDepth(CHEAP_VERIFY, 3, models_draft=True) if temperature else FixedGamma(3)
        states.append(DecodeState(prompt, SamplingParams(temperature=temperature), 48, policy, RandomStreams(i)))
        engine.open(states[-1])
    pending_counts = []
    running = list(states)
    while running:
        engine.step(running)
        running = [state for state in running if state.finish_reason is None]
        for state in running:
            assert_cache_is_fresh_prefill(state.sequence, state.context[:-1], fresh_target)
            slot = state.draft_slot
            assert state.context[: slot.cached] + slot.pending == state.context and slot.pending
            pending_counts.append(len(slot.pending))
            assert_cache_is_fresh_prefill(slot.cache, state.context[: slot.cached], fresh_draft)
    for state in states:
        engine.close(state)
    assert sum(state.stats.iterations for state in states) >= 25
    return [state.stats for state in states], pending_counts


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_caches_track_committed_text(arch, temperature, model_dirs):
    stats, pending_counts = decode_checking_caches(model_dirs, arch, temperature, specdec.ModelDrafter)
    assert max(pending_counts) <= 2, "at most the last accepted draft token and the bonus are pending"
    assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats), "the run should include acceptances and rejections"


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
