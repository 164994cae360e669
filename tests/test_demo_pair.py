"""The committed demo pair: loads with no model arguments, fits the size rules, decodes losslessly."""

from __future__ import annotations

import json

import pytest

import specdec
from specdec.api import DEMO_DIR


@pytest.fixture(scope="module")
def demo():
    return specdec.load(backend="transformers", device="cpu")  # no target: the demo pair, drafting with its draft model


def test_demo_pair_files_and_sizes():
    checkpoints = sum(p.stat().st_size for name in ("target", "draft") for p in (DEMO_DIR / name).rglob("*") if p.is_file())
    assert checkpoints <= 60e6, f"the demo checkpoints are {checkpoints / 1e6:.1f} MB"
    gguf = sum((DEMO_DIR / f"{name}.gguf").stat().st_size for name in ("target", "draft"))
    assert gguf <= 60e6, f"the demo GGUF files are {gguf / 1e6:.1f} MB"
    for name in ("target", "draft"):
        report = json.loads((DEMO_DIR / name / "training.json").read_text())
        assert report["heldout_loss"] is not None and report["steps"] > 0
    assert (DEMO_DIR / "ngram.safetensors").is_file()


def test_demo_pair_shapes(demo):
    target_params, draft_params = demo.target.parameters, demo.draft_model.parameters
    assert 20e6 <= target_params <= 40e6
    assert draft_params <= target_params / 8
    assert demo.target.dtype == demo.draft_model.dtype == "float32"  # fp16 on disk, fp32 on CPU


def test_demo_generate_matches_plain_greedy(demo):
    prompt = "def fibonacci(n):"
    speculative = demo.generate(prompt, max_new_tokens=24, temperature=0)
    plain = specdec.SpeculativeDecoder(demo.target).generate(prompt, max_new_tokens=24, temperature=0)
    assert speculative.tokens == plain.tokens and speculative.text == plain.text
    assert speculative.stats.acceptance_rate > 0.2, "the distilled draft should agree with its target often"


def test_demo_ngram_matches_the_demo_tokenizer(demo):
    decoder = specdec.load(ngram=str(DEMO_DIR / "ngram.safetensors"), backend="transformers", device="cpu")
    assert decoder.generate("import os\n", max_new_tokens=8, temperature=0).stats.drafted > 0


def test_the_default_demo_runs_on_llama_cpp_and_agrees_with_transformers(demo):
    """No model arguments: the demo pair's GGUF files (f16) on llama.cpp. Its greedy text equals the
    transformers demo's (float32 compute of the same f16 weights) on these prompts."""
    gguf = specdec.load(threads=1)
    assert gguf.target.backend == gguf.draft_model.backend == "llamacpp"
    assert (gguf.target.dtype, gguf.target.vocab_size, gguf.target.max_length) == ("F16", demo.target.vocab_size, demo.target.max_length)
    for prompt in ("def fibonacci(n):", "import os\n\ndef list_files(path):"):
        ours = gguf.generate(prompt, max_new_tokens=48, temperature=0)
        assert ours.tokens == demo.generate(prompt, max_new_tokens=48, temperature=0).tokens
        assert ours.stats.acceptance_rate > 0.2


def test_a_gguf_file_runs_on_transformers_too(gguf_models, capsys):
    """`--backend transformers` with a .gguf file: transformers dequantizes it (here the demo draft in
    float32, so exactly its checkpoint's weights): the same tokens as the checkpoint, from the API and the CLI."""
    from specdec.cli import main

    from_gguf = specdec.load(gguf_models["gguf-f32"], backend="transformers", device="cpu", plain=True)
    checkpoint = specdec.load(gguf_models["hf-draft"], device="cpu", plain=True)
    assert from_gguf.target.backend == "transformers" and from_gguf.target.vocab_size == checkpoint.target.vocab_size
    want = checkpoint.generate("def fibonacci(n):", max_new_tokens=24, temperature=0)
    assert from_gguf.generate("def fibonacci(n):", max_new_tokens=24, temperature=0).tokens == want.tokens
    assert main(["generate", "def fibonacci(n):", "--target", gguf_models["gguf-f32"], "--backend", "transformers", "--device", "cpu",
                 "--plain", "--max-new-tokens", "24", "--temperature", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == want.tokens
    assert main(["generate", "x", "--target", "missing.gguf", "--backend", "transformers"]) == 1
    assert "GGUF file not found" in capsys.readouterr().err
