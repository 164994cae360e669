"""specdec's output layer for GGUF models on llama.cpp's CPU backend (specdec/runtime/cpu_head.py):
the kernel computes llama.cpp's Q8_0 arithmetic, the same bits for a row in any batch and on both
of its paths; a model using it agrees with llama.cpp's own logits; decoding with it is lossless
(greedy equality for every drafter kind, and the sampled joint by chi-square)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import specdec
from specdec import ModelDrafter, PromptLookupDrafter, SpeculativeDecoder, TreeShape
from specdec.runtime import cpu_head
from specdec.types import SamplingParams
from test_llamacpp import ALPHA, PROMPTS, REPEATING, SAMPLES, chi_square, pruned_joint

kernels = pytest.importorskip("specdec.runtime._cpu_head", reason="specdec's compiled output layer is not built")
needs_head = pytest.mark.skipif(cpu_head.unavailable() is not None, reason=str(cpu_head.unavailable()))


def q8_0_matrix(rng, vocab: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random Q8_0 matrix as a GGUF file stores it (34-byte blocks), with its quants and scales."""
    quants = rng.integers(-127, 128, (vocab, width // 32, 32)).astype(np.int8)
    scales = (rng.random((vocab, width // 32)) * 0.02).astype(np.float16)
    raw = np.concatenate([scales[..., None].view(np.uint8).reshape(vocab, width // 32, 2), quants.view(np.uint8)], axis=2)
    return raw.reshape(-1), quants, scales


def reference_logits(hidden: np.ndarray, quants: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """llama.cpp's arithmetic in numpy: each row quantized to Q8_0 (scale amax/127 kept in fp16,
    quants rounded half to even), exact integer block dots, their scaled sum in float64."""
    rows, width = hidden.shape
    blocks = hidden.reshape(rows, width // 32, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(amax > 0, np.rint(blocks * np.float32(127) / amax), 0).astype(np.int64)
    d = (amax[..., 0] / np.float32(127)).astype(np.float16).astype(np.float64)
    dots = np.einsum("jbt,vbt->jvb", q, quants.astype(np.int64))
    return np.einsum("jvb,jb,vb->jv", dots.astype(np.float64), d, scales.astype(np.float64))


def packed(raw: np.ndarray, vocab: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    groups = -(-vocab // 16)
    weights, scales = np.empty(groups * 16 * width, np.uint8), np.empty(groups * 16 * width // 32, np.uint16)
    kernels.pack_q8_0(raw, vocab, width, weights, scales)
    return weights, scales


def logits(weights, scales, vocab: int, hidden: np.ndarray, portable: bool) -> np.ndarray:
    out = np.empty((hidden.shape[0], vocab), np.float32)
    kernels.logits(weights, scales, vocab, hidden.shape[1], np.ascontiguousarray(hidden, np.float32), hidden.shape[0], out, 1, portable)
    return out


@pytest.mark.parametrize("vocab", [16, 37, 300])
def test_the_kernel_computes_llama_cpp_q8_0_arithmetic(vocab):
    rng = np.random.default_rng(vocab)
    width = 96
    raw, quants, scales = q8_0_matrix(rng, vocab, width)
    weights, packed_scales = packed(raw, vocab, width)
    hidden = rng.standard_normal((11, width)).astype(np.float32) * 4
    hidden[3, :32] = 0  # an all-zero block: scale 0, quants 0
    expected = reference_logits(hidden, quants, scales)
    for portable in (True, False):
        if not portable and not kernels.vnni():
            continue
        got = logits(weights, packed_scales, vocab, hidden, portable)
        assert np.allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max()), portable


def test_a_row_has_the_same_bits_in_any_batch_and_on_both_paths():
    rng = np.random.default_rng(0)
    vocab, width = 133, 64
    raw, _, _ = q8_0_matrix(rng, vocab, width)
    weights, scales = packed(raw, vocab, width)
    hidden = rng.standard_normal((13, width)).astype(np.float32)
    alone = np.concatenate([logits(weights, scales, vocab, hidden[j:j + 1], True) for j in range(13)])
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13):  # every remainder of the kernel's 8-row and 4-row passes
        for portable in (True, False) if kernels.vnni() else (True,):
            assert np.array_equal(logits(weights, scales, vocab, hidden[:rows], portable), alone[:rows]), (rows, portable)


def test_bad_shapes_are_errors_not_crashes():
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.pack_q8_0(np.zeros(10, np.uint8), 1, 33, np.zeros(64, np.uint8), np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match="holds"):
        kernels.pack_q8_0(np.zeros(10, np.uint8), 4, 32, np.zeros(512, np.uint8), np.zeros(16, np.uint16))


@pytest.fixture(scope="module")
def q8_0_pair(gguf_models):
    """The Q8_0 demo draft with specdec's output layer, llama.cpp's own, and a perturbed drafter."""
    if cpu_head.unavailable() is not None:
        pytest.skip(cpu_head.unavailable())
    load = lambda key, layer="auto": specdec.load_model(gguf_models[key], threads=1, output_layer=layer)
    return {"ours": load("gguf-q8_0", "specdec"), "theirs": load("gguf-q8_0", "llama.cpp"), "near": load("gguf-near")}


def test_its_logits_are_llama_cpps_up_to_float_rounding(q8_0_pair):
    ours, theirs = q8_0_pair["ours"], q8_0_pair["theirs"]
    assert ours.output_layer == "specdec" and theirs.output_layer == "llama.cpp" and "output layer by specdec" in ours.describe()
    tokens = ours.tokenizer.encode(PROMPTS[2])
    for model in (ours, theirs):
        sequence = model.sequence()
        model.logits = sequence.forward(tokens)
        sequence.release()
    assert ours.logits.shape == theirs.logits.shape
    assert float((ours.logits - theirs.logits).abs().max()) < 1e-4 * float(theirs.logits.abs().max())


def test_auto_keeps_llama_cpps_where_the_kernel_cannot_run_and_specdec_refuses(gguf_models):
    model = specdec.load_model(gguf_models["gguf-f16"], threads=1)
    assert model.output_layer == "llama.cpp" and "not Q8_0" in model.output_layer_note
    with pytest.raises(specdec.SpecDecError, match="specdec's output layer cannot run .* not Q8_0"):
        specdec.load_model(gguf_models["gguf-f16"], threads=1, output_layer="specdec")
    with pytest.raises(specdec.SpecDecError, match="unknown output layer"):
        specdec.load_model(gguf_models["gguf-f16"], threads=1, output_layer="gpu")
    done = subprocess.run([sys.executable, "-m", "specdec", "generate", "hi", "--target", gguf_models["gguf-f16"], "--output-layer", "specdec"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "not Q8_0" in done.stderr and "Traceback" not in done.stderr


@needs_head
def test_greedy_speculation_with_it_equals_plain_greedy_for_every_drafter(q8_0_pair):
    target, near = q8_0_pair["ours"], q8_0_pair["near"]
    drafters = {"chain": (ModelDrafter(near), 4), "tree": (ModelDrafter(near, tree=TreeShape(nodes=8, width=2)), 4),
                "staged": (ModelDrafter(near, inner=PromptLookupDrafter(), inner_gamma=4), 3), "prompt lookup": (PromptLookupDrafter(), 8)}
    for prompt in PROMPTS + [REPEATING]:
        reference = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40, temperature=0)
        for name, (drafter, gamma) in drafters.items():
            result = SpeculativeDecoder(target, drafter, gamma).generate(prompt, max_new_tokens=40, temperature=0)
            assert result.tokens == reference.tokens, f"{name} on {prompt!r}"
            assert result.stats.accepted > 0, f"{name} never had a draft token accepted"


@needs_head
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampled_speculation_with_it_keeps_the_target_distribution(q8_0_pair, kind):
    target, near = q8_0_pair["ours"], q8_0_pair["near"]
    drafter = ModelDrafter(near) if kind == "chain" else ModelDrafter(near, tree=TreeShape(nodes=6, width=2))
    decoder, setting = SpeculativeDecoder(target, drafter, gamma=2), dict(temperature=1.0)
    prompt = target.tokenizer.encode("def f(x):")
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(SAMPLES):
        result = decoder.generate(prompt, max_new_tokens=3, seed=seed, **setting)
        counts[tuple(result.tokens)] += 1
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0.1 < accepted / drafted < 0.95, "both acceptances and rejections must happen"
    assert chi_square(counts, pruned_joint(target, prompt, SamplingParams(**setting), SAMPLES), SAMPLES) > ALPHA


def test_the_breakdown_times_every_kind_of_op(gguf_models):
    from specdec.runtime.op_times import CATEGORIES, breakdown, category, format_breakdown

    assert [category(op, name) for op, name in (("MUL_MAT", "result_output"), ("MUL_MAT", "ffn_up-3"), ("MUL_MAT", "Qcur-0"),
                                                 ("FLASH_ATTN_EXT", "node_7"), ("RMS_NORM", "norm-2"))] == [
        "output layer", "feed-forward matmuls", "attention matmuls", "attention", "other ops"]
    model = specdec.load_model(gguf_models["gguf-q8_0"], threads=1)
    result = breakdown(model, sizes=(1, 4), repeats=2)
    for k in (1, 4):
        assert all(result[k][kind] > 0 for kind in (*CATEGORIES, "forward"))
        assert ("output layer (specdec)" in result[k]) == (model.output_layer == "specdec")
    table = format_breakdown(result)
    assert "| output layer |" in table and "k = 4" in table


def test_profile_breakdown_on_the_cli(gguf_models, model_dirs):
    done = subprocess.run([sys.executable, "-m", "specdec", "profile", "--target", gguf_models["gguf-q8_0"], "--plain", "--threads", "1",
                           "--breakdown"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "where the target's forward goes" in done.stdout and "| feed-forward matmuls |" in done.stdout
    done = subprocess.run([sys.executable, "-m", "specdec", "profile", "--target", model_dirs["llama"], "--plain", "--breakdown"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "takes a GGUF target" in done.stderr and "Traceback" not in done.stderr
