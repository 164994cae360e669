"""The fused forward (`specdec.runtime.fused`), the static pool's GPU default for the Llama family and Gemma 1-3:
on the CPU in float64, every step equals transformers' forward on the same pool (logits, cached keys, the
states heads read), every drafter's greedy text is plain decoding's, and every other architecture of
the matrix is refused by name (it keeps transformers' forward)."""

from __future__ import annotations

import numpy
import pytest
import torch

import specdec
from architectures import ARCHITECTURES
from specdec.runtime.fused import (FAMILIES, LLAMA, SCOPES, FusedForward, _Kernels, fused_refusal, gemma_rms_norm,
                                  grouped_attention, rms_norm)
from specdec.runtime.static import StaticHFModel
from tiny import save_tiny_model

PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
COVERED = [arch for arch in ARCHITECTURES if ARCHITECTURES[arch](16, 1, 64).model_type in FAMILIES]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fused")
    dirs = {arch: str(save_tiny_model(root / arch, arch, seed=seed)) for seed, arch in enumerate(ARCHITECTURES)}
    dirs |= {f"{arch}-near": str(save_tiny_model(root / f"{arch}-near", arch, seed=COVERED.index(arch), noise=0.005))
             for arch in COVERED}
    return dirs


def pool(directory: str, fused: bool | None, attn_implementation: str | None = None,
         backend: str = "graphs") -> StaticHFModel:
    """The model's static pool in float64, with its default attention (sdpa; Gemma 2's eager): its forwards
    padded to the compiled shapes, as a GPU runs them (the CPU's graphs capture nothing), or as they come
    (backend "static")."""
    eager = specdec.load_model(directory, device="cpu", dtype="float64", attn_implementation=attn_implementation)
    return StaticHFModel(eager.model, eager.tokenizer, directory, backend=backend, fused=fused)


def test_the_families_it_covers_are_in_the_matrix():
    assert set(COVERED) == {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"}


STEPS = [
    lambda s: s.forward(PROMPT),
    lambda s: s.forward([5, 6, 7, 8, 9], parents=[9, 9, 10, 12, 10]),  # a tree: 5 new entries, the 16 bucket
    lambda s: (s.keep(10, [10, 12, 13]), s.forward([4], parents=[12]))[1],
    lambda s: (s.truncate(8), s.forward([3, 3, 3]))[1],
    lambda s: s.fork(9).forward([7, 1, 2, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]),  # 18 new entries: the 64 bucket
]


@pytest.mark.parametrize("attention", ["products", "sdpa", "unpadded"])
@pytest.mark.parametrize("arch", COVERED)
def test_each_step_equals_transformers_forward_on_the_pool(arch, attention, saved):
    """Prefill, a tree, compaction of its path, truncation, a fork and a chain: the same logits and
    the same cached keys and values (Mistral's sliding window, Qwen 2's biases, Qwen 3's head norms,
    Gemma's norms and gelu, Gemma 2 and 3's sandwich norms, Gemma 2's capped scores in eager attention,
    local and global layers with their own rotations; grouped key heads in every one). sdpa: every forward
    as a prefill chunk past the largest bucket computes it; unpadded: on a pool that compiles nothing, whose
    forwards run as they come."""
    backend = "static" if attention == "unpadded" else "graphs"
    fused, reference = pool(saved[arch], fused=True, backend=backend), pool(saved[arch], fused=False, backend=backend)
    assert fused.fused is not None and reference.fused is None
    if attention == "sdpa":
        fused.fused.kernels["bucketed"] = fused.fused.kernels["other"]
    if attention == "unpadded":  # a step's few queries take the step's kernels there too (a chunk's many, SDPA's)
        fused.fused.kernels["other"].attend = None  # so called by nothing: every step here is of 64 entries or fewer
    layer_calls = []  # transformers' decoder layers run only on the reference
    for model in (fused, reference):
        model.model.model.layers[0].register_forward_hook(lambda *_, model=model: layer_calls.append(model))
    ours, theirs = fused.sequence(), reference.sequence()
    for step in STEPS:
        torch.testing.assert_close(step(ours), step(theirs), rtol=1e-10, atol=1e-10)
    assert layer_calls and all(model is reference for model in layer_calls)
    for (k1, v1), (k2, v2) in zip(ours.cache_tensors(), theirs.cache_tensors()):
        torch.testing.assert_close(k1, k2, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("arch", COVERED)
def test_each_compile_scope_traces_what_runs_uncompiled(arch, scope, saved):
    """A GPU compiles the layer's elementwise work piece by piece or a whole layer at a time: traced whole
    (fullgraph, by torch.compile's aot_eager: no graph break, the pool written in place through the trace),
    every step's logits and cached keys and values are bitwise the uncompiled forward's. The second fused
    forward over one model views the weights the first concatenated: nothing is copied twice."""
    uncompiled = pool(saved[arch], fused=True)
    compiled = pool(saved[arch], fused=True)
    first = compiled.fused.layers[0].qkv[0]
    compiled.fused = FusedForward(compiled.model, compiled=True, scope=scope, backend="aot_eager")
    assert compiled.fused.layers[0].qkv[0].data_ptr() == first.data_ptr()
    ours, theirs = compiled.sequence(), uncompiled.sequence()
    for step in STEPS:
        assert torch.equal(step(ours), step(theirs))
    for (k1, v1), (k2, v2) in zip(ours.cache_tensors(), theirs.cache_tensors()):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_weights_are_viewed_whole_only_within_one_storage():
    """Blocks of one storage, in order, are viewed as one weight; blocks of separate storages that lie end
    to end in memory (two loaded tensors can) are copied together, not read past the first's end."""
    from specdec.runtime.fused import _joined

    base = torch.arange(12.0).view(6, 2)
    joined = _joined([base[:2], base[2:5]])
    assert joined.data_ptr() == base.data_ptr() and torch.equal(joined, base[:5])
    memory = numpy.arange(12.0).reshape(6, 2)
    apart = [torch.from_numpy(memory[:2]), torch.from_numpy(memory[2:])]  # end to end, a storage each
    assert apart[1].data_ptr() == apart[0].data_ptr() + 32
    assert apart[1].untyped_storage().data_ptr() != apart[0].untyped_storage().data_ptr()
    joined = _joined(apart)
    assert torch.equal(joined, torch.arange(12.0).view(6, 2).double()) and joined.data_ptr() != apart[0].data_ptr()
    assert torch.equal(_joined([base[2:4], base[:2]]), torch.cat([base[2:4], base[:2]]))  # out of order: copied


def test_an_unknown_compile_scope_is_refused(saved):
    with pytest.raises(ValueError, match="unknown compile scope 'model'; choose one of pieces, layers"):
        FusedForward(pool(saved["llama"], fused=False).model, compiled=True, scope="model")


@pytest.mark.parametrize("layers", [None, (1,)])
def test_the_states_heads_read_are_transformers(saved, layers):
    """The final norm's rows (a head's input) and decoder layers' inputs (an EAGLE-3 head's)."""
    outputs = []
    for fused in (True, False):
        model = pool(saved["qwen3"], fused=fused)
        model.keep_states(True, layers=layers)
        sequence = model.sequence()
        logits = [sequence.forward(PROMPT), sequence.forward([5, 6, 7], parents=[9, 10, 10])]
        outputs.append((logits, sequence.states))
    (ours, our_states), (theirs, their_states) = outputs
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(our_states, their_states, rtol=1e-10, atol=1e-10)


def test_states_of_a_prefill_past_the_largest_bucket(tmp_path):
    """A prefill chunk of more new entries than a compiled shape holds runs as it comes, states kept too (a
    head reads them from the prompt's chunks): the fused forward takes the states' kind there as well."""
    directory = str(save_tiny_model(tmp_path / "qwen3", "qwen3", seed=0, context=160))
    outputs = []
    for fused in (True, False):
        model = pool(directory, fused=fused)
        model.keep_states(True, layers=(1,))
        sequence = model.sequence()
        outputs.append((sequence.forward([i % 7 for i in range(100)]), sequence.states))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["graphs", "static"])
@pytest.mark.parametrize("arch", COVERED)
def test_every_drafter_writes_plain_decodings_greedy_text(arch, backend, saved):
    eager = specdec.load_model(saved[arch], device="cpu", dtype="float64")
    plain = specdec.SpeculativeDecoder(eager).generate(PROMPT, max_new_tokens=40, temperature=0).tokens
    fused = pool(saved[arch], fused=True, backend=backend)
    near = specdec.load_model(saved[f"{arch}-near"], device="cpu", dtype="float64")
    drafters = {"plain": None, "chain": specdec.ModelDrafter(near), "prompt lookup": specdec.PromptLookupDrafter(),
                "tree": specdec.ModelDrafter(near, tree=specdec.TreeShape(nodes=8, width=2)),
                "auto": specdec.AutoDrafter(specdec.ModelDrafter(near), specdec.PromptLookupDrafter())}
    for name, drafter in drafters.items():
        result = specdec.SpeculativeDecoder(fused, drafter, gamma=3).generate(PROMPT, max_new_tokens=40, temperature=0)
        assert result.tokens == plain, f"{name} on the fused forward differs from plain greedy"


@pytest.mark.parametrize("arch", [arch for arch in ARCHITECTURES if arch not in COVERED])
def test_other_architectures_keep_transformers_forward_and_say_why(arch, saved):
    model = specdec.load_model(saved[arch], device="cpu", dtype="float64").model
    reason = fused_refusal(model)
    assert reason is not None
    try:
        unfused = StaticHFModel(model, specdec.load_model(saved[arch], device="cpu").tokenizer, arch, backend="static")
    except specdec.SpecDecError as error:  # no static pool at all (ALiBi, recurrent state ...): nothing to fuse
        assert "no static cache" in str(error)
        return
    assert unfused.fused is None
    with pytest.raises(specdec.SpecDecError, match="no fused forward"):
        StaticHFModel(model, unfused.tokenizer, arch, backend="static", fused=True)


def test_eager_attention_is_not_fused(saved):
    """transformers' eager attention takes its softmax in float32: asked for, it is what runs."""
    assert "its attention is eager" in fused_refusal(pool(saved["llama"], fused=False, attn_implementation="eager").model)


def test_the_cpu_pool_is_unfused_unless_asked(saved, monkeypatch):
    model = pool(saved["llama"], fused=None)
    assert model.fused is None and "GPU" in model.describe()
    monkeypatch.setenv("SPECDEC_FUSED", "on")
    assert pool(saved["llama"], fused=None).fused is not None
    assert pool(saved["gpt2"], fused=None).fused is None  # where it covers the model only
    monkeypatch.setenv("SPECDEC_FUSED", "off")  # the escape hatch
    assert "SPECDEC_FUSED=off" in pool(saved["llama"], fused=None).describe()
    monkeypatch.setenv("SPECDEC_FUSED", "yes")
    with pytest.raises(specdec.SpecDecError, match="SPECDEC_FUSED='yes': choose auto, on or off"):
        pool(saved["llama"], fused=None)


@pytest.mark.parametrize("products", [True, False])
def test_grouped_attention_equals_attention_over_repeated_key_heads(products):
    """Each key head's group of query heads as its queries: transformers' repeat_kv pairing, for a tree's
    masks, computed as a step computes it (two products around a softmax) and as a prefill does (SDPA)."""
    generator = torch.Generator().manual_seed(0)
    queries, keys, values = (torch.randn(shape, dtype=torch.float64, generator=generator)
                             for shape in ((2, 8, 3, 16), (2, 2, 32, 16), (2, 2, 32, 16)))
    mask = torch.where(torch.rand(2, 1, 3, 32, generator=generator) < 0.7, 0.0, float("-inf")).double()
    mask[..., 0] = 0.0  # every query sees something
    repeated = [t.repeat_interleave(4, dim=1) for t in (keys, values)]
    expected = torch.nn.functional.scaled_dot_product_attention(queries, *repeated, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(grouped_attention(queries, keys, values, mask, 0.25, _Kernels(LLAMA, False, products)), expected,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch, norm", [("qwen2", rms_norm), ("gemma", gemma_rms_norm), ("gemma2", gemma_rms_norm),
                                        ("gemma3", gemma_rms_norm)])
def test_its_norms_are_the_models(saved, arch, norm):
    model = specdec.load_model(saved[arch], device="cpu", dtype="float64").model
    module = model.model.layers[0].input_layernorm
    with torch.no_grad():
        module.weight.normal_()
    hidden = torch.randn(2, 3, module.weight.shape[0], dtype=torch.float64)
    eps = getattr(module, "variance_epsilon", None) or module.eps
    assert torch.equal(norm(hidden, module.weight, eps), module(hidden))
