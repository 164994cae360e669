"""Many generations in one batch (continuous batching): each row's output is exactly what it would
be alone, whoever else is in the batch, whenever rows join or leave, on both runtimes; and a
sampled row in a busy batch with a changing draft depth still follows the target's distribution."""

from __future__ import annotations

import zlib
from collections import Counter

import pytest

import specdec
from conftest import ARCHS
from specdec.engine import Engine
from specdec.costs import Profile, interpolate
from specdec.profiling import measure_curve
from specdec.policy import BatchDepth, expected_tokens
from specdec.params import SamplingParams
from test_statistical import LENGTH, PROMPT, SETTINGS, chi_square_pvalue, exact_joint

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7, 1, 6], [5, 5, 5, 5], [9, 2, 6, 5, 3]]


def run_batch(decoder: specdec.SpeculativeDecoder, requests: list[dict], joins: list[int], cancels: dict[int, int] = {},
              cap=lambda step, batch: None) -> list:
    """Continuous batching by hand: request i joins before step joins[i]; request j in `cancels`
    leaves (cancelled) before step cancels[j]; finished rows leave at once. cap(step, batch size)
    bounds the draft depth of each step. Returns each request's GenerationResult (None: cancelled)."""
    engine = Engine(decoder.target, decoder.drafter)
    generations = [decoder.request(**request) for request in requests]
    results, running, step = [None] * len(requests), [], 0
    while step <= max(joins) or running:
        for i, generation in enumerate(generations):
            if joins[i] == step:
                generation.open(engine)
                running.append(i)
            if cancels.get(i) == step and i in running:
                engine.close(generation.state)
                running.remove(i)
        live = [i for i in running if not generations[i].done]
        if live:
            for i, result in zip(live, engine.step([generations[i].state for i in live], cap(step, len(live)))):
                generations[i].add(result)
        for i in [i for i in running if generations[i].done]:
            engine.close(generations[i].state)
            results[i] = generations[i].result()
            running.remove(i)
        step += 1
    return results


def alone(decoder, request: dict):
    return decoder.generate(**request)


def drafters(draft) -> dict:
    return {
        "chain": lambda: specdec.ModelDrafter(draft),
        "tree": lambda: specdec.ModelDrafter(draft, tree=specdec.TreeShape(nodes=6, width=2)),
        "staged": lambda: specdec.ModelDrafter(draft, inner=specdec.PromptLookupDrafter(), inner_gamma=2),
        "lookup": lambda: specdec.PromptLookupDrafter(),
        "plain": lambda: None,
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["chain", "tree", "staged", "lookup", "plain"])
def test_rows_of_a_batch_decode_as_if_alone(load64, model_dirs, arch, kind):
    """float64: five requests of different lengths, greedy and sampled mixed, joining at different
    steps; every row's tokens equal its generation alone with the same seed (sampled included:
    each row draws from its own streams, so the batch changes nothing)."""
    target, draft = load64(model_dirs[arch]), load64(model_dirs[f"{arch}-near"])
    decoder = specdec.SpeculativeDecoder(target, drafters(draft)[kind](), gamma=3)
    requests = [dict(prompt=prompt, max_new_tokens=12 + 3 * i, temperature=0.0 if i % 2 else 1.0, top_k=5 * (i % 3), seed=i)
                for i, prompt in enumerate(PROMPTS)]
    batched = run_batch(decoder, requests, joins=[0, 0, 2, 3, 7])
    for request, result in zip(requests, batched):
        assert result.tokens == alone(decoder, request).tokens
    assert sum(r.stats.accepted for r in batched) > 0 or kind == "plain"


def test_rows_leave_and_join_mid_batch(load64, model_dirs):
    """A row cancelled mid-batch frees its slots; the others, and rows joining after it, are unchanged."""
    target, draft = load64(model_dirs["llama"]), load64(model_dirs["llama-near"])
    decoder = specdec.SpeculativeDecoder(target, specdec.ModelDrafter(draft, tree=specdec.TreeShape(nodes=6, width=2)), gamma=3)
    opened = []
    open_sequence = target.sequence
    target.sequence = lambda: opened.append(open_sequence()) or opened[-1]
    requests = [dict(prompt=prompt, max_new_tokens=20, temperature=1.0, seed=10 + i) for i, prompt in enumerate(PROMPTS)]
    try:
        batched = run_batch(decoder, requests, joins=[0, 0, 1, 4, 4], cancels={1: 3, 3: 6})
    finally:
        del target.sequence
    assert batched[1] is None and batched[3] is None
    for i in (0, 2, 4):
        assert batched[i].tokens == alone(decoder, requests[i]).tokens
    assert all(sequence._cache is None for sequence in opened), "every slot goes back, cancelled ones included"


@pytest.mark.parametrize("kind", ["chain", "tree", "lookup"])
def test_llama_cpp_rows_decode_as_if_alone(gguf_models, kind):
    """On llama.cpp (f32 demo draft as the target, its perturbed f16 copy drafting): greedy rows in
    one batch equal their generations alone."""
    target = specdec.load_model(gguf_models["gguf-f32"], slots=4)
    draft = specdec.load_model(gguf_models["gguf-near"], slots=4)
    decoder = specdec.SpeculativeDecoder(target, drafters(draft)[kind](), gamma=3)
    prompts = ["def fibonacci(n):", "import os\n\ndef walk(path):", "class Stack:\n    def push(self, item):", "x = [i * i for i in"]
    requests = [dict(prompt=prompt, max_new_tokens=24, temperature=0.0) for prompt in prompts]
    batched = run_batch(decoder, requests, joins=[0, 0, 1, 5])
    for request, result in zip(requests, batched):
        assert result.tokens == alone(decoder, request).tokens
    assert sum(r.stats.accepted for r in batched) > 0


SAMPLES = 2400
ROWS = 4  # samples per batch, beside as many rows of other requests


@pytest.mark.statistical
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_a_sampled_row_in_a_busy_batch_follows_the_target(load64, model_dirs, kind):
    """Rows of the request under test (each its own seed) share every batch with rows of other
    requests (other prompts, greedy or another temperature); rows join at staggered steps and the
    draft depth cap changes from step to step and with the batch size, as the server's does. The
    joint of the first 3 tokens of the request under test must be the target's."""
    target = load64(model_dirs["llama"])
    draft = specdec.load_model(model_dirs["qwen2-draft"], device="cpu", dtype="float64")
    decoder = specdec.SpeculativeDecoder(target, drafters(draft)[kind](), gamma=3)
    sampling = SETTINGS["t1"]
    base = zlib.crc32(f"batch/{kind}".encode())
    counts, drafted, accepted = Counter(), 0, 0
    for batch in range(SAMPLES // ROWS):
        seeds = [base + batch * ROWS + i for i in range(ROWS)]
        requests = [dict(prompt=PROMPT, max_new_tokens=LENGTH, seed=seed, **sampling) for seed in seeds]
        requests += [dict(prompt=PROMPTS[(batch + i) % len(PROMPTS)], max_new_tokens=6, temperature=0.5 * (i % 2), seed=i) for i in range(ROWS)]
        results = run_batch(decoder, requests, joins=[i % 3 for i in range(2 * ROWS)], cap=lambda step, size: (step + size) % 4)
        for result in results[:ROWS]:
            counts[tuple(result.tokens)] += 1
            drafted += result.stats.drafted
            accepted += result.stats.accepted
    assert 0 < accepted < drafted
    pvalue = chi_square_pvalue(counts, exact_joint(target, SamplingParams(**sampling)), SAMPLES)
    assert pvalue > 1e-4, f"p-value {pvalue:.3g}: a row in a busy batch does not follow the target"


# ---------------------------------------------------------------- the depth for a batch


def test_expected_tokens_and_interpolation():
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    costs = {1: 1.0, 4: 2.0, 16: 8.0}
    assert interpolate(costs, 2) == pytest.approx(1 + 1 / 3) and interpolate(costs, 32) == pytest.approx(16)


def test_batch_depth_drafts_only_where_it_pays():
    """Verification nearly free for few rows, linear beyond 8 tokens: deep drafts alone, none in a
    big batch; and low observed acceptance stops drafting even alone."""
    costs = {1: 1.0, 2: 1.06, 4: 1.1, 8: 1.15, 16: 2.2, 32: 4.4, 64: 8.8, 128: 17.6}
    depth = BatchDepth(Profile(costs), max_gamma=6, models_draft=False, prior=0.8)
    assert depth.depth(1) >= 3
    assert depth.depth(32) == 0
    for _ in range(200):
        depth.observe(4, 0)
    assert depth.alpha < 0.05 and depth.depth(1) == 0
    for _ in range(200):
        depth.observe(4, 4)
    assert depth.alpha > 0.94 and depth.depth(1) == 6


def test_batch_depth_counts_the_draft_model(load64, model_dirs):
    """A draft model as costly as the target never pays at this acceptance; measured costs are positive."""
    costs = {1: 1.0, 8: 1.0, 64: 8.0}
    assert BatchDepth(Profile(costs, dict(costs)), max_gamma=4, models_draft=True, prior=0.5).depth(1) == 0
    measured, rounds, _ = measure_curve(load64(model_dirs["llama"]), sizes=(1, 4), max_rounds=3)
    assert set(measured) == {1, 4} and all(t > 0 for t in measured.values()) and rounds == 3
