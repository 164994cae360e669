"""Prefix reuse (specdec/runtime/prefix.py): a fork continues as a fresh sequence would, on both
backends; the cache keeps finished sequences within its budget; generations that start from a
kept prefix keep the target's text (greedy, against a no-cache reference, several architectures and
llama.cpp) and distribution (chi-square); the server reports cached tokens."""

from __future__ import annotations

import zlib
from collections import Counter

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specdec
from specdec.errors import SpecDecError
from specdec.runtime.prefix import PrefixCache
from specdec.stops import common_prefix
from specdec.params import SamplingParams

TOKENS = [(7 * i + 3) % 16 for i in range(48)]


@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30))
def test_common_prefix_is_the_longest_common_prefix(a, b):
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix(a, b) == naive


def fed(model, tokens: list[int]):
    sequence = model.sequence()
    sequence.forward(tokens)
    return sequence


@pytest.fixture(params=["transformers", "llama.cpp"])
def model(request, model_dirs, load64, gguf_models):
    if request.param == "transformers":
        return load64(model_dirs["llama"])
    return specdec.load_model(gguf_models["gguf-f32"], threads=1, slots=2, prefix_cells=256)


def test_a_fork_continues_as_a_fresh_sequence_would(model):
    """The fork's next logits equal a fresh sequence's; the original goes on unchanged beside it;
    a tree's pending nodes cannot be forked."""
    original = fed(model, TOKENS[:30])
    original.forward(TOKENS[30:34])
    fork = original.fork(25)
    assert fork.cache_len == 25
    fresh = fed(model, TOKENS[:25])
    tolerance = 1e-9 if model.backend == "transformers" else 1e-4
    assert torch.allclose(fork.forward(TOKENS[25:40]), fresh.forward(TOKENS[25:40]), atol=tolerance, rtol=0)
    alone = fed(model, TOKENS[:34])
    assert torch.allclose(original.forward(TOKENS[34:38]), alone.forward(TOKENS[34:38]), atol=tolerance, rtol=0)
    original.forward([1, 2], parents=[original.cache_len - 1] * 2)  # two siblings: a tree
    with pytest.raises(ValueError, match="committed text"):
        original.fork(original.cache_len)
    for sequence in (original, fork, fresh, alone):
        sequence.release()


def test_the_cache_keeps_finished_sequences_within_its_budget(load64, model_dirs):
    model = load64(model_dirs["llama"])
    cache = PrefixCache(model, budget=90, min_shared=4)
    cache.put(fed(model, TOKENS[:40]), TOKENS[:40])
    assert cache.tokens == 40
    taken = cache.take(TOKENS[:30] + [15])
    assert taken.cache_len == 30 and cache.reused_tokens == 30
    cache.put(taken, TOKENS[:30])  # a kept sequence holds it all already
    assert cache.tokens == 40
    cache.put(fed(model, TOKENS[:46]), TOKENS[:46])  # a longer turn of the same text replaces the shorter
    assert cache.tokens == 46
    other = [5] * 50
    cache.put(fed(model, other), other)  # over the budget: the least recently used goes
    assert cache.tokens == 50 and cache.take(TOKENS[:20]).cache_len == 0
    assert cache.take(other[:10]).cache_len == 9  # the prompt's last token is always left to feed
    cache.put(fed(model, TOKENS[:3]), TOKENS[:3])  # shorter than min_shared: not kept
    assert cache.tokens == 50
    cache.clear()
    assert cache.tokens == 0
    with pytest.raises(SpecDecError, match="budget"):
        PrefixCache(model, budget=-1)


def test_llama_cpp_keeps_prefixes_in_free_cells_and_sheds_them_when_a_decode_needs_them(gguf_models):
    """No cells are added for kept prefixes the slots can hold (llama.cpp makes every cell resident
    at load); a decode that finds the cells full sheds kept prefixes first, and computes what a
    fresh model does."""
    none_asked = specdec.load_model(gguf_models["gguf-f32"], threads=1)
    assert PrefixCache(none_asked, budget=4096).budget == 0, "loaded for no prefix cache: no cell for one"
    model = specdec.load_model(gguf_models["gguf-f32"], threads=1, prefix_tokens=none_asked.max_length)
    assert model.cells == model.max_length and PrefixCache(model, budget=4096).budget == model.cells
    cache = PrefixCache(model, budget=4096, min_shared=4)
    kept = [(5 * i + 1) % 16 for i in range(model.max_length - 8)]
    cache.put(fed(model, kept), kept)
    assert cache.tokens == len(kept)
    other = [(3 * i + 2) % 16 for i in range(40)]
    running = fed(model, other[:-4])
    logits = running.forward(other[-4:])  # needs cells only the kept prefix held
    assert cache.tokens == 0, "the kept prefix gave its cells back"
    assert torch.allclose(logits, fed(none_asked, other[:-4]).forward(other[-4:]), atol=1e-4, rtol=0)
    with pytest.raises(SpecDecError, match="is full"):  # running sequences alone: nothing to shed
        fed(model, [1] * (model.max_length - 20))
    running.release()
    more = specdec.load_model(gguf_models["gguf-f32"], threads=1, slots=2, prefix_tokens=model.max_length * 3)
    assert more.cells == model.max_length * 3, "cells added only for what the two slots cannot hold"


def test_decoders_on_one_model_share_its_spared_cells(gguf_models):
    """Six decoders with a cache each once filled the spared cells and failed (`specdec bench` does
    that): decoders asking by budget share the model's one cache, whatever its users."""
    spared = specdec.load_model(gguf_models["gguf-f32"], threads=1, prefix_cells=160)
    decoders = [specdec.SpeculativeDecoder(spared, prefix_cache=4096) for _ in range(4)]
    assert all(decoder.prefixes is decoders[0].prefixes for decoder in decoders) and decoders[0].prefixes.budget == 160
    for i in range(8):
        for decoder in decoders:
            decoder.generate([(7 * i + j) % spared.vocab_size for j in range(50)], max_new_tokens=10, temperature=0)
            assert decoder.prefixes.tokens <= 160
    assert specdec.SpeculativeDecoder(spared, prefix_cache=PrefixCache(spared, 100)).prefixes is not decoders[0].prefixes


# ---------------------------------------------------------------- losslessness


def conversation(decoder, turns: list[list[int]], new: int) -> list:
    """Each turn's prompt is the previous prompt, its reply, then the turn's tokens."""
    prompt, results = [], []
    for turn in turns:
        prompt = prompt + (results[-1].tokens if results else []) + turn
        results.append(decoder.generate(prompt, max_new_tokens=new, temperature=0))
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "neox", "mistral"])
def test_a_conversation_from_kept_prefixes_keeps_the_greedy_text(arch, model_dirs, load64):
    """Three turns with the default drafter (draft model and lookup): every reply equals a no-cache
    float64 greedy reference, and each later turn starts from the previous one's cache."""
    from conftest import reference_greedy

    target = load64(model_dirs[arch])
    drafter = specdec.AutoDrafter(specdec.ModelDrafter(load64(model_dirs[f"{arch}-near"])), specdec.PromptLookupDrafter())
    decoder = specdec.SpeculativeDecoder(target, drafter, prefix_cache=PrefixCache(target, 4096, min_shared=4))
    turns = [TOKENS[:12], TOKENS[20:24], TOKENS[30:33]]
    results = conversation(decoder, turns, 12)
    context = []  # the previous turn's prompt and reply: its cache holds all but the last token
    for turn, result in zip(turns, results):
        assert result.stats.cached_tokens == max(0, len(context) - 1)
        assert result.tokens == reference_greedy(target, context + turn, 12)
        context = context + turn + result.tokens


def test_a_conversation_from_kept_prefixes_on_llama_cpp(gguf_models):
    from specdec.runtime.prefix import MIN_SHARED

    reused = specdec.load(gguf_models["gguf-f16"], draft=gguf_models["gguf-draft-f16"], threads=1)
    fresh = specdec.load(gguf_models["gguf-f16"], draft=gguf_models["gguf-draft-f16"], threads=1, prefix_cache=0)
    assert reused.prefixes is not None and fresh.prefixes is None
    ids = reused.prompt_ids
    turns = [ids("def parse(text):\n    \"\"\"Split text into words.\"\"\"\n"), ids("\n\ndef join(words):\n"), ids("\n\nclass Reader:\n")]
    with_reuse, without = conversation(reused, turns, 40), conversation(fresh, turns, 40)
    assert [r.tokens for r in with_reuse] == [r.tokens for r in without]
    assert with_reuse[0].stats.cached_tokens == 0 and all(r.stats.cached_tokens >= MIN_SHARED for r in with_reuse[1:])


def test_two_conversations_that_share_the_cells_keep_the_greedy_text_on_llama_cpp(gguf_models, monkeypatch):
    """Two conversations in turns on one slot: each turn's kept prefix takes cells the other's next
    turn needs, so turns shed kept prefixes; every reply equals a decoder's without a cache."""
    shed = []
    monkeypatch.setattr(PrefixCache, "shed", lambda self, shed_=PrefixCache.shed: shed.append(1) or shed_(self))
    reused = specdec.load(gguf_models["gguf-f16"], draft=gguf_models["gguf-draft-f16"], threads=1, context=256,
                          prefix_cache=256)  # no cell added: kept prefixes live in the slot's
    fresh = specdec.load(gguf_models["gguf-f16"], draft=gguf_models["gguf-draft-f16"], threads=1, context=256,
                         prefix_cache=0)
    assert reused.target.cells == 256
    length = reused.target.max_length * 3 // 5  # two such prompts do not fit in the slot's cells together
    prompts = [[(7 * i + k) % 50 + 3 for i in range(length)] for k in (1, 2)]
    for turn in range(3):
        for prompt in prompts:
            with_reuse, without = (decoder.generate(prompt + [9] * turn, max_new_tokens=8, temperature=0)
                                   for decoder in (reused, fresh))
            assert with_reuse.tokens == without.tokens
    assert reused.prefixes.tokens <= reused.target.cells and len(shed) >= 4, len(shed)


@pytest.mark.statistical
def test_sampled_output_from_a_kept_prefix_follows_the_target(model_dirs):
    """Chi-square on the first 3 tokens (test_statistical): every generation after the first
    starts from the prompt the previous one kept."""
    from test_statistical import ALPHA, PROMPT, SAMPLES, chi_square_pvalue, exact_joint

    target = specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")
    decoder = specdec.SpeculativeDecoder(target, specdec.AutoDrafter(None, specdec.PromptLookupDrafter()),
                                         prefix_cache=PrefixCache(target, 4096, min_shared=2))
    counts, cached = Counter(), 0
    seed = zlib.crc32(b"prefix")
    for i in range(SAMPLES):
        result = decoder.generate(PROMPT, max_new_tokens=3, temperature=1.0, seed=seed + i)
        counts[tuple(result.tokens)] += 1
        cached += result.stats.cached_tokens
    assert cached == (SAMPLES - 1) * (len(PROMPT) - 1)
    assert chi_square_pvalue(counts, exact_joint(target, SamplingParams(temperature=1.0)), SAMPLES) > ALPHA


# ---------------------------------------------------------------- the server


def cached_metric(live) -> float:
    for line in httpx.get(live.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("specdec_cached_prompt_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no specdec_cached_prompt_tokens_total in /metrics")


def test_the_server_reports_cached_prompt_tokens(model_dirs):
    from test_server import MODEL, LiveServer
    from specdec.server import create_app

    decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], device="cpu")
    decoder.prefixes.min_shared = 4
    plain = specdec.load(model_dirs["llama"], device="cpu", plain=True, prefix_cache=0)
    live = LiveServer(create_app(decoder, MODEL))
    try:
        prompt = "ab cd ef gh"
        first = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=60).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0} and cached_metric(live) == 0
        follow = prompt + first["choices"][0]["text"] + " ij"
        second = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": follow, "max_tokens": 12, "temperature": 0}, timeout=60).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(decoder.prompt_ids(prompt)) and cached_metric(live) == cached
        assert second["choices"][0]["text"] == plain.generate(follow, max_new_tokens=12, temperature=0).text
    finally:
        live.stop()


def test_serve_prefix_cache_flag_is_checked(model_dirs, capsys):
    from specdec.cli import main

    assert main(["serve", "--target", model_dirs["llama"], "--device", "cpu", "--prefix-cache-tokens", "-1"]) == 1
    assert "--prefix-cache-tokens must be >= 0" in capsys.readouterr().err


def test_load_without_a_prefix_cache_on_llama_cpp():
    decoder = specdec.load(None, threads=1, prefix_cache=None)
    assert decoder.prefixes is None and decoder.target.cells == decoder.target.max_length, "no cell added"
