"""Batch-invariant llama.cpp forwards (`batch_invariant=True`): a token's logits are bitwise the
same in a batch of any size, checked at load and refused where the build's kernels still differ;
trees and prefix reuse are off (both would put KV cells out of position order); greedy
speculation then equals plain greedy decoding."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

import specdec
from specdec import ModelDrafter, PromptLookupDrafter, SpeculativeDecoder
from test_llamacpp import PROMPTS, REPEATING


def llamafile_kernels() -> bool:
    import llama_cpp

    return bool(ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so")).ggml_cpu_has_llamafile())


@pytest.fixture(scope="module")
def invariant(gguf_models):
    return specdec.load_model(gguf_models["gguf-q8_0"], threads=1, batch_invariant=True)


def test_a_tokens_logits_are_the_same_bits_in_any_batch(invariant):
    tokens = [(5 * i + 11) % invariant.vocab_size for i in range(20)]
    one, batched = invariant.sequence(), invariant.sequence()
    alone = torch.cat([one.forward([token]) for token in tokens])
    together = torch.cat([batched.forward(tokens[:3]), batched.forward(tokens[3:12]), batched.forward(tokens[12:])])
    assert torch.equal(alone, together)


def test_trees_and_prefix_reuse_are_off(invariant):
    assert invariant.tree_refusal() is not None and "position order" in invariant.tree_refusal()
    assert SpeculativeDecoder(invariant).prefixes is None


def test_greedy_speculation_equals_plain_greedy(invariant, gguf_models):
    near = specdec.load_model(gguf_models["gguf-near"], threads=1)
    plain = SpeculativeDecoder(invariant)
    for prompt in PROMPTS + [REPEATING]:
        reference = plain.generate(prompt, max_new_tokens=40, temperature=0)
        for drafter, gamma in ((ModelDrafter(near), 6), (PromptLookupDrafter(), 9), (ModelDrafter(near, inner=PromptLookupDrafter()), 4)):
            assert SpeculativeDecoder(invariant, drafter, gamma).generate(prompt, max_new_tokens=40, temperature=0).tokens == reference.tokens


@pytest.mark.skipif(not llamafile_kernels(), reason="this llama.cpp build has no llamafile kernels: F16 forwards are batch-invariant")
def test_a_build_whose_kernels_still_move_is_refused_with_the_fix(gguf_models):
    with pytest.raises(specdec.SpecDecError, match="still move with the batch shape.*-DGGML_LLAMAFILE=OFF"):
        specdec.load_model(gguf_models["gguf-f16"], threads=1, batch_invariant=True)


def test_it_is_for_gguf_models_only(model_dirs):
    with pytest.raises(specdec.SpecDecError, match="batch_invariant apply to GGUF files"):
        specdec.load_model(model_dirs["llama"], batch_invariant=True)
