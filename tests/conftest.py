"""Shared fixtures: tiny saved checkpoints of four architectures, loaded through the real loader."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import specdec
from specdec import costs, profiling
from specdec.demo import DEMO_DIR, demo_gguf
from specdec.runtime import static
from gguf_data import made_test_models
from tiny import save_tiny_model

# measured cost profiles of the tests' models (CLI subprocesses measure for real) stay out of ~/.cache
os.environ["SPECDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="specdec-profiles-")

# a machine where drafting pays (a verify of a few tokens costs about one of a single token), so
# that the cost-aware policy drafts and every decoding path is exercised; tests of the measuring
# itself use `measured_profile`
CHEAP_VERIFY = costs.Profile(target={1: 1.0, 4: 1.05, 8: 1.15, 16: 1.5, 64: 4.0}, draft={1: 0.12, 4: 0.13, 16: 0.2, 64: 0.5},
                             step_overhead=0.05, level_overhead=0.01)
measured_profile = profiling.profile
# the real ones, for the tests of them (the fixture below makes them no-ops)
live_observe, live_observe_draft = costs.LiveCosts.observe, costs.LiveCosts.observe_draft


@pytest.fixture(autouse=True, scope="session")
def small_read_buckets():
    """The static pool's read buckets from 16 cells, not 512: the tests' rows hold 64 cells, so every test of
    the pool crosses read buckets (16, 32, 64) as decoding a long context crosses 512, 1024, ... And a sliding
    layer's read leaves room for 8 cells past its window, not 128: the tests' windows of 8 cells read 16 where
    the others read 64 (`static.window_read`), and a forward of more new cells reads the 64. For the whole
    session, before any fixture builds a pool (a module's shared one too)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static, "SMALLEST_READ", 16)
        patch.setattr(static, "WINDOW_SLACK", 8)
        yield


@pytest.fixture(autouse=True)
def cheap_verify_profile(monkeypatch):
    """Every decoder decides with CHEAP_VERIFY, as given: what its steps take on the test machine
    (a tiny model, a loaded CI runner) does not reshape it, so what the policy drafts does not
    depend on timing. `test_policy` checks the live correction (`costs.LiveCosts`) itself."""
    monkeypatch.setattr(profiling, "profile", lambda target, draft=None, refresh=False: CHEAP_VERIFY)
    monkeypatch.setattr(costs.LiveCosts, "observe", lambda self, tokens, seconds: None)
    monkeypatch.setattr(costs.LiveCosts, "observe_draft", lambda self, forwards, seconds: None)

ARCHS = ["llama", "qwen2", "gpt2", "neox", "mistral"]
# weight noise that makes "<arch>-near" agree with its target's argmax often, but not always
NEAR_NOISE = {"llama": 0.006, "qwen2": 0.02, "gpt2": 0.05, "neox": 0.006, "mistral": 0.006}

torch.set_num_threads(1)  # tiny models: threads only add overhead and contention on a 2-core machine


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Target-sized and draft-sized checkpoints per architecture, all sharing one tokenizer."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for seed, arch in enumerate(ARCHS):
        dirs[arch] = str(save_tiny_model(root / arch, arch, seed=seed))
        dirs[f"{arch}-draft"] = str(save_tiny_model(root / f"{arch}-draft", arch, seed=100 + seed, layers=1))
        dirs[f"{arch}-near"] = str(save_tiny_model(root / f"{arch}-near", arch, seed=seed, noise=NEAR_NOISE[arch]))
    dirs["llama-eos"] = str(save_tiny_model(root / "llama-eos", "llama", seed=24, logit_scale=3.0, with_eos=True))  # greedy EOS after 12 tokens
    dirs["llama-padded"] = str(save_tiny_model(root / "llama-padded", "llama", seed=8, vocab_rows=24, layers=1))
    return dirs


@pytest.fixture(scope="session")
def gguf_models() -> dict[str, str]:
    """GGUF files for llama.cpp: the demo pair (f16), its draft model in float32 and in Q8_0, a
    perturbed copy of it in f16, and a random 256-wide model whose output matrix is Q6_K, made in
    specdec's cache the first time they are needed (specdec.demo.demo_gguf, tests/gguf_data.py)."""
    made = made_test_models()
    return {"gguf-f16": str(demo_gguf("target")), "gguf-draft-f16": str(demo_gguf("draft")), "hf-draft": str(DEMO_DIR / "draft"),
            "gguf-f32": made["draft-f32"], "gguf-near": made["near-f16"], "gguf-q8_0": made["draft-q8_0"], "gguf-wide-q6_k": made["wide-q6_k"]}


@pytest.fixture(scope="session")
def load64():
    """Load a checkpoint in float64 on the CPU (exact comparisons), cached per directory."""
    cache = {}

    def load(directory: str) -> specdec.CausalLM:
        if directory not in cache:
            cache[directory] = specdec.load_model(directory, device="cpu", dtype="float64")
        return cache[directory]

    return load


def reference_greedy(model: specdec.CausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """No cache at all: the whole sequence through the model for every token, argmax each time."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model.model(torch.tensor([tokens])).logits[0, -1, : model.vocab_size]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]
