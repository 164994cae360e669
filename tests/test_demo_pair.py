"""The committed demo pair: loads with no model arguments, fits the size rules, decodes losslessly."""

from __future__ import annotations

import json

import pytest
import torch

import specdec
from specdec.api import DEMO_DIR


@pytest.fixture(scope="module")
def demo():
    return specdec.load(device="cpu")  # no target: the demo pair, drafting with its draft model


def test_demo_pair_files_and_sizes():
    total = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert total <= 60e6, f"demo pair is {total / 1e6:.1f} MB"
    for name in ("target", "draft"):
        report = json.loads((DEMO_DIR / name / "training.json").read_text())
        assert report["heldout_loss"] is not None and report["steps"] > 0
    assert (DEMO_DIR / "ngram.safetensors").is_file()


def test_demo_pair_shapes(demo):
    target_params = sum(p.numel() for p in demo.target.model.parameters())
    draft_params = sum(p.numel() for p in demo.drafter.model.model.parameters())
    assert 20e6 <= target_params <= 40e6
    assert draft_params <= target_params / 8
    assert demo.target.dtype == demo.drafter.model.dtype == torch.float32  # fp16 on disk, fp32 on CPU


def test_demo_generate_matches_plain_greedy(demo):
    prompt = "def fibonacci(n):"
    speculative = demo.generate(prompt, max_new_tokens=24, temperature=0)
    plain = specdec.SpeculativeDecoder(demo.target).generate(prompt, max_new_tokens=24, temperature=0)
    assert speculative.tokens == plain.tokens and speculative.text == plain.text
    assert speculative.stats.acceptance_rate > 0.2, "the distilled draft should agree with its target often"


def test_demo_ngram_matches_the_demo_tokenizer(demo):
    decoder = specdec.load(ngram=str(DEMO_DIR / "ngram.safetensors"), device="cpu")
    assert decoder.generate("import os\n", max_new_tokens=8, temperature=0).stats.drafted > 0
