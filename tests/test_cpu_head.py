"""specdec's output layer for GGUF models on llama.cpp's CPU backend (specdec/runtime/cpu_head.py):
the kernel computes llama.cpp's Q8_0 arithmetic, the same bits for a row in any batch and on both
of its paths; a model using it agrees with llama.cpp's own logits; decoding with it is lossless
(greedy equality for every drafter kind, and the sampled joint by chi-square)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

import specdec
from specdec import ModelDrafter, PromptLookupDrafter, SpeculativeDecoder, TreeShape
from specdec.runtime import cpu_head
from specdec.runtime.llamacpp import head_rows_for
from specdec.params import SamplingParams
from test_llamacpp import ALPHA, PROMPTS, REPEATING, SAMPLES, chi_square, pruned_joint

kernels = pytest.importorskip("specdec.runtime._cpu_head", reason="specdec's compiled output layer is not built")
needs_head = pytest.mark.skipif(cpu_head.unavailable() is not None, reason=str(cpu_head.unavailable()))


Q8_0, Q6_K = 0, 1  # the kernel's kinds


def q8_0_matrix(rng, vocab: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A random Q8_0 matrix as a GGUF file stores it (34-byte blocks), and its weights."""
    quants = rng.integers(-127, 128, (vocab, width // 32, 32)).astype(np.int8)
    scales = (rng.random((vocab, width // 32)) * 0.02).astype(np.float16)
    raw = np.concatenate([scales[..., None].view(np.uint8).reshape(vocab, width // 32, 2), quants.view(np.uint8)], axis=2)
    return raw.reshape(-1), (quants * scales[..., None].astype(np.float64)).reshape(vocab, width)


def q6_k_matrix(rng, vocab: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A random Q6_K matrix (210-byte blocks of 256: 6-bit quants, int8 scales per 16, an fp16
    scale), and its weights as gguf-py's own dequantization reads them."""
    from gguf import GGMLQuantizationType, quants

    raw = rng.integers(0, 256, (vocab * width // 256, 210), dtype=np.uint8)
    raw[:, 208:210] = (rng.random((len(raw), 1)) * 0.001).astype(np.float16).view(np.uint8)
    return raw.reshape(-1), quants.dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float64).reshape(vocab, width)


MATRICES = {Q8_0: (q8_0_matrix, 32), Q6_K: (q6_k_matrix, 256)}


def quantized_rows(hidden: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """Hidden rows as llama.cpp quantizes them for the matrix's dot products, per block: Q8_0
    (scale amax/127 kept in fp16, quants rounded half to even) or Q8_K (with m the element of
    largest magnitude, q = min(127, rint(x * -127/m)), scale 1/(-127/m)). Returns quants and scales."""
    rows, width = hidden.shape
    size = 32 if kind == Q8_0 else 256
    blocks = hidden.reshape(rows, width // size, size)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[..., None], axis=2)
    amax = np.abs(largest)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == Q8_0:
            inverse = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
            scale = (amax[..., 0] / np.float32(127)).astype(np.float16).astype(np.float64)
        else:
            inverse = np.where(amax > 0, np.float32(-127) / largest, 0).astype(np.float32)
            scale = np.where(amax[..., 0] > 0, np.float32(1) / inverse[..., 0], 0).astype(np.float32).astype(np.float64)
    quants = np.minimum(np.rint(blocks * inverse), 127)
    return quants, scale


def reference_logits(hidden: np.ndarray, weights: np.ndarray, kind: int) -> np.ndarray:
    """llama.cpp's arithmetic in float64: each block's quantized hidden values against the weights, times the row's block scale."""
    quants, scale = quantized_rows(hidden, kind)
    rows, blocks, size = quants.shape
    return np.einsum("jbt,vbt,jb->jv", quants, weights.reshape(len(weights), blocks, size), scale)


def packed(kind: int, raw: np.ndarray, vocab: int, width: int) -> tuple:
    rows = -(-vocab // 16) * 16
    weights, scales = np.empty(rows * width, np.uint8), np.empty(rows * width // MATRICES[kind][1], np.uint16)
    subscales = np.empty(rows * width // 16 if kind == Q6_K else 0, np.int8)
    kernels.pack(kind, raw, vocab, width, weights, scales, subscales)
    return kind, weights, scales, subscales


def logits(matrix: tuple, vocab: int, hidden: np.ndarray, portable: bool) -> np.ndarray:
    out = np.empty((hidden.shape[0], vocab), np.float32)
    kernels.logits(*matrix, vocab, hidden.shape[1], np.ascontiguousarray(hidden, np.float32), hidden.shape[0], out, 1, portable)
    return out


@pytest.mark.parametrize("kind", [Q8_0, Q6_K], ids=["Q8_0", "Q6_K"])
@pytest.mark.parametrize("vocab", [16, 37, 300])
def test_the_kernel_computes_llama_cpps_arithmetic(kind, vocab):
    rng = np.random.default_rng(vocab)
    make, block = MATRICES[kind]
    width = 3 * block
    raw, weights = make(rng, vocab, width)
    matrix = packed(kind, raw, vocab, width)
    hidden = rng.standard_normal((11, width)).astype(np.float32) * 4
    hidden[3, :block] = 0  # an all-zero block: scale 0, quants 0
    hidden[4, 5] = -40  # the largest magnitude negative (Q8_K's scale takes its sign)
    expected = reference_logits(hidden, weights, kind)
    for portable in (True, False) if kernels.vnni() else (True,):
        got = logits(matrix, vocab, hidden, portable)
        assert np.allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max()), portable


@pytest.mark.parametrize("kind", [Q8_0, Q6_K], ids=["Q8_0", "Q6_K"])
def test_a_row_has_the_same_bits_in_any_batch_and_on_both_paths(kind):
    rng = np.random.default_rng(0)
    make, block = MATRICES[kind]
    vocab, width = 133, 2 * block
    matrix = packed(kind, make(rng, vocab, width)[0], vocab, width)
    hidden = rng.standard_normal((13, width)).astype(np.float32)
    alone = np.concatenate([logits(matrix, vocab, hidden[j:j + 1], True) for j in range(13)])
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13):  # every remainder of the kernel's 8-row passes
        for portable in (True, False) if kernels.vnni() else (True,):
            assert np.array_equal(logits(matrix, vocab, hidden[:rows], portable), alone[:rows]), (rows, portable)


def test_bad_shapes_are_errors_not_crashes():
    empty = np.zeros(0, np.int8)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.pack(Q8_0, np.zeros(10, np.uint8), 1, 33, np.zeros(64, np.uint8), np.zeros(4, np.uint16), empty)
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.pack(Q6_K, np.zeros(210, np.uint8), 1, 128, np.zeros(4096, np.uint8), np.zeros(16, np.uint16), empty)
    with pytest.raises(ValueError, match="holds"):
        kernels.pack(Q8_0, np.zeros(10, np.uint8), 4, 32, np.zeros(512, np.uint8), np.zeros(16, np.uint16), empty)
    with pytest.raises(ValueError, match="kind"):
        kernels.pack(2, np.zeros(10, np.uint8), 4, 32, np.zeros(512, np.uint8), np.zeros(16, np.uint16), empty)


@pytest.fixture(scope="module", params=["gguf-q8_0", "gguf-wide-q6_k"], ids=["Q8_0 output", "Q6_K output"])
def pair(request, gguf_models):
    """A target with specdec's output layer (the Q8_0 demo draft; a random 256-wide model whose
    output matrix is Q6_K), the same file with llama.cpp's, with the two split (llama.cpp's for a
    one-row forward, specdec's for more), and a perturbed demo draft to draft."""
    if cpu_head.unavailable() is not None:
        pytest.skip(cpu_head.unavailable())
    load = lambda key, layer="auto": specdec.load_model(gguf_models[key], threads=1, output_layer=layer)
    return {"ours": load(request.param, "specdec"), "theirs": load(request.param, "llama.cpp"),
            "split": load(request.param, "split"), "near": load("gguf-near"), "trained": request.param == "gguf-q8_0"}


def test_its_logits_are_llama_cpps_up_to_float_rounding(pair):
    ours, theirs = pair["ours"], pair["theirs"]
    assert ours.output_layer == "specdec" and theirs.output_layer == "llama.cpp" and "output layer by specdec" in ours.describe()
    tokens = ours.tokenizer.encode(PROMPTS[2])
    for model in (ours, theirs):
        sequence = model.sequence()
        model.logits = sequence.forward(tokens)
        sequence.release()
    assert ours.logits.shape == theirs.logits.shape
    assert float((ours.logits - theirs.logits).abs().max()) < 1e-4 * float(theirs.logits.abs().max())


def test_split_takes_llama_cpps_for_one_row_and_specdecs_for_more(pair):
    ours, theirs, split = pair["ours"], pair["theirs"], pair["split"]
    assert split.output_layer == "split" and "verifies' output layer by specdec" in split.describe()
    assert [split.output_layer_for(rows) for rows in (1, 2, 9)] == ["llama.cpp", "specdec", "specdec"]
    tokens = ours.tokenizer.encode(PROMPTS[2])
    logits = {}
    for name, model in (("ours", ours), ("theirs", theirs), ("split", split)):
        sequence = model.sequence()
        logits[name, "prefill"] = sequence.forward(tokens[:-3], last=1)  # one row of logits
        logits[name, "verify"] = sequence.forward(tokens[-3:])  # three rows
        sequence.release()
    assert torch.equal(logits["split", "prefill"], logits["theirs", "prefill"])
    assert torch.equal(logits["split", "verify"], logits["ours", "verify"])
    assert not torch.equal(logits["ours", "prefill"], logits["theirs", "prefill"])  # the two do differ


def test_auto_splits_the_output_layer_only_where_llama_cpps_is_faster_at_one_row_alone():
    def seconds(specdec_1, specdec_8):
        return {("llama.cpp", 1): 1.0, ("llama.cpp", 8): 4.0, ("specdec", 1): specdec_1, ("specdec", 8): specdec_8}

    assert head_rows_for(seconds(0.9, 2.0), batch_invariant=False) == (1, None)
    rows, why = head_rows_for(seconds(1.2, 2.0), batch_invariant=False)
    assert rows == 2 and "1200.00 vs 1000.00 ms at 1 rows" in why
    assert head_rows_for(seconds(1.2, 2.0), batch_invariant=True)[0] is None  # one output layer for every shape
    assert head_rows_for(seconds(0.9, 5.0), batch_invariant=False)[0] is None
    assert head_rows_for(seconds(1.2, 5.0), batch_invariant=False)[0] is None


@needs_head
def test_a_split_output_layer_cannot_be_batch_invariant(gguf_models):
    with pytest.raises(specdec.SpecDecError, match="cannot be batch-invariant"):
        specdec.load_model(gguf_models["gguf-q8_0"], threads=1, output_layer="split", batch_invariant=True)


def test_auto_keeps_llama_cpps_where_the_kernel_cannot_run_and_specdec_refuses(gguf_models):
    # the first reason found is given: on a CPU without AVX-512 VNNI that one, before the matrix type is read
    reason = cpu_head.unavailable() or "neither Q8_0 nor Q6_K"
    model = specdec.load_model(gguf_models["gguf-f16"], threads=1)
    assert model.output_layer == "llama.cpp" and reason in model.output_layer_note
    for layer in ("specdec", "split"):
        with pytest.raises(specdec.SpecDecError, match="specdec.s output layer cannot run .* " + re.escape(reason)):
            specdec.load_model(gguf_models["gguf-f16"], threads=1, output_layer=layer)
    with pytest.raises(specdec.SpecDecError, match="unknown output layer"):
        specdec.load_model(gguf_models["gguf-f16"], threads=1, output_layer="gpu")
    done = subprocess.run([sys.executable, "-m", "specdec", "generate", "hi", "--target", gguf_models["gguf-f16"], "--output-layer", "specdec"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and reason in done.stderr and "Traceback" not in done.stderr


@needs_head
@pytest.mark.parametrize("layer", ["ours", "split"])
def test_greedy_speculation_with_it_equals_plain_greedy_for_every_drafter(pair, layer):
    target, near = pair[layer], pair["near"]
    drafters = {"chain": (ModelDrafter(near), 4), "tree": (ModelDrafter(near, tree=TreeShape(nodes=8, width=2)), 4),
                "staged": (ModelDrafter(near, inner=PromptLookupDrafter(), inner_gamma=4), 3), "prompt lookup": (PromptLookupDrafter(), 8)}
    for prompt in PROMPTS + [REPEATING]:
        reference = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40, temperature=0)
        for name, (drafter, gamma) in drafters.items():
            result = SpeculativeDecoder(target, drafter, gamma).generate(prompt, max_new_tokens=40, temperature=0)
            assert result.tokens == reference.tokens, f"{name} on {prompt!r}"
            # the random Q6_K model shares no text with the trained drafter: only the trained target must accept
            assert result.stats.accepted > 0 or not pair["trained"], f"{name} never had a draft token accepted"


@needs_head
@pytest.mark.statistical
@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("layer", ["ours", "split"])
def test_sampled_speculation_with_it_keeps_the_target_distribution(pair, kind, layer):
    if not pair["trained"]:  # the output layer is the same code for both types; the kernel tests cover Q6_K's arithmetic
        pytest.skip("a random model's near-uniform joint over 8k tokens leaves the chi-square no cells")
    target, near = pair[layer], pair["near"]
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
        assert ("output layer (specdec)" in result[k]) == (model.output_layer_for(k) == "specdec")
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


@needs_head
def test_a_graph_without_the_final_norm_keeps_llama_cpps_output_layer(gguf_models, monkeypatch):
    """An architecture whose graph names no "result_norm": the capture sees no rows, and the check
    at load keeps llama.cpp's output layer (or refuses specdec's when asked for), never a crash."""
    monkeypatch.setattr(cpu_head, "NORM_TENSOR", b"no_such_tensor")
    model = specdec.load_model(gguf_models["gguf-q8_0"], threads=1)
    assert model.output_layer == "llama.cpp" and "final-norm rows" in model.output_layer_note
    with pytest.raises(specdec.SpecDecError, match="final-norm rows"):
        specdec.load_model(gguf_models["gguf-q8_0"], threads=1, output_layer="specdec")
