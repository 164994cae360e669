"""Distilled drafts (`specdec.distill`) and drafts with a pruned vocabulary (`runtime.pruned`).

A pruned draft predicts only part of the target's vocabulary and gives every other token q = 0; the
residual max(0, p - q) returns that mass to the target. Tested like every drafter: exactly (the
chain step with q = 0 outside a fixed subset, enumerated), by chi-square end to end on both
backends, and by greedy equality on both backends. Pruned drafts here are cut from the tiny test
checkpoints and the demo draft (`prune`), so their acceptance is known to be neither 0 nor 1; the
distillation pipeline itself is run small, from a GGUF target and from a checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import specdec
from specdec import AutoDrafter, ModelDrafter, PromptLookupDrafter, SpeculativeDecoder, TreeShape
from specdec.config import DistillConfig
from specdec.distill import Generations, distill, draft_pieces, soft_loss
from specdec.export import save_draft
from specdec.runtime import load_draft
from specdec.runtime.base import Feed
from specdec.runtime.pruned import PrunedVocab, VocabMap
from specdec.runtime.vocab import tokenizer_fingerprint
from specdec.sampling import probs_from_logits
from specdec.params import SamplingParams
from conftest import reference_greedy
from test_llamacpp import ALPHA, SAMPLES, chi_square, pruned_joint
from test_statistical import assert_follows_target
from test_verify_exact import Conditional, enumerator, iteration_joint, target_joint  # noqa: F401 (a fixture)

TINY_DRAFT = dict(hidden_size=32, heads=2, kv_heads=1, intermediate_size=64, layers=1, batch_size=8, lr=3e-3, warmup=5,
                  eval_every=10, save_every=10, progress=False, holdout=0.1)


def prune(source: str, keep: list[int], target, out: Path, noise: float = 0.0, gguf: bool = False) -> Path:
    """A copy of checkpoint `source` that predicts only the target ids `keep` (draft id i = keep[i],
    then an unknown id with a zero embedding), as `distill` writes one; `noise` perturbs every weight."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    vocab_map = VocabMap(tuple(keep), target.vocab_size, tokenizer_fingerprint(target.tokenizer, spaces_as_written=True))
    config = model.config
    config.vocab_size = vocab_map.draft_vocab_size
    eos = config.eos_token_id
    config.eos_token_id = config.pad_token_id = keep.index(eos) if eos in keep else None
    pruned = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    rows = torch.tensor(keep)
    generator = torch.Generator().manual_seed(7)
    for name, weight in state.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            weight = torch.cat([weight[rows], torch.zeros(1, weight.shape[1])])
        state[name] = weight + noise * torch.randn(weight.shape, generator=generator)
    pruned.load_state_dict(state, strict=False)
    pruned.tie_weights()
    save_draft(pruned, vocab_map, draft_pieces(target.tokenizer, vocab_map), out, gguf=gguf)
    return out


# ------------------------------------------------------------------------------ exact


@pytest.mark.parametrize("vocab,gamma,point_mass", [(4, 1, False), (5, 2, False), (6, 2, False), (5, 2, True)])
def test_the_chain_step_with_a_pruned_q_keeps_the_target_distribution(enumerator, vocab, gamma, point_mass):
    """q over the draft's own columns (every target id but 1 mod 3, in no particular order), as a
    pruned draft's logits give it: read at each token's column, p - q = p outside them."""
    target = Conditional(vocab, seed=vocab * 7 + gamma)
    columns = [i for i in range(vocab - 1, -1, -1) if i % 3 != 1]
    draft = Conditional(len(columns), seed=500 + vocab)
    got = iteration_joint(enumerator, target, draft, gamma, point_mass, columns)
    want = target_joint(target, gamma + 1)
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) < 1e-9
    pruned_first = [seq for seq in want if seq[0] % 3 == 1]  # tokens the draft can never propose
    assert sum(got[seq] for seq in pruned_first) > 0.05, "the residual must give the pruned tokens their mass"


def test_the_wrapper_gives_logits_over_its_own_columns(model_dirs, tmp_path):
    """Target ids in, logits over the predicted tokens out (the unknown id dropped), their target
    ids the model's `columns`; every transform gives a proper q over them."""
    target = specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")
    keep = [0, 2, 3, 5, 7, 8, 11, 13, 14, 15]
    draft = load_draft(prune(model_dirs["llama-near"], keep, target, tmp_path), target, device="cpu", dtype="float64")
    assert isinstance(draft, PrunedVocab) and draft.vocab_size == 16 and draft.vocab_map.unknown == 10
    assert draft.columns.tolist() == keep
    logits = draft.sequence().forward([2, 4, 7, 9, 15])
    inner = draft.inner.sequence().forward([1, 10, 4, 10, 9])  # draft ids; 4 and 9 are not predicted: the unknown id
    assert logits.shape == (5, 10) and torch.equal(logits, inner[:, :10])
    batched, = draft.forward_batch([Feed(draft.sequence(), [2, 4, 7, 9, 15])])
    assert torch.equal(batched, logits)
    for sampling in (SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.0, top_p=0.8), SamplingParams(1e-30)):
        q = probs_from_logits(logits, sampling)
        assert torch.isfinite(q).all() and torch.allclose(q.sum(-1), torch.ones(5, dtype=q.dtype))


# ------------------------------------------------------------------------------ transformers


@pytest.fixture(scope="module")
def hf_pair(model_dirs, tmp_path_factory):
    """The tiny llama target (float64) and a noisy copy predicting 10 of its 16 tokens."""
    target = specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")
    keep = [0, 1, 2, 4, 6, 7, 9, 11, 12, 14]
    directory = prune(model_dirs["llama-near"], keep, target, tmp_path_factory.mktemp("pruned-hf"))
    return target, load_draft(directory, target, device="cpu", dtype="float64"), keep


@pytest.mark.statistical
def test_sampled_speculation_with_a_pruned_draft_follows_the_target_transformers(hf_pair):
    """At T 0.7 top-5 (its chain and tree on llama.cpp take T 1; 35 s a case on 2 cores)."""
    target, draft, keep = hf_pair
    setting = dict(temperature=0.7, top_k=5)
    decoder = SpeculativeDecoder(target, ModelDrafter(draft), gamma=2)
    assert_follows_target(decoder, setting, seed_key=f"pruned/{setting}")
    emitted = Counter(t for seed in range(200) for t in decoder.generate([1, 2, 3], max_new_tokens=3, seed=seed, **setting).tokens)
    assert sum(n for t, n in emitted.items() if t not in keep) > 0, "the target must still emit the tokens the draft cannot"


def test_greedy_speculation_with_a_pruned_draft_equals_plain_greedy_transformers(hf_pair):
    target, draft, _ = hf_pair
    drafters = {"chain": (ModelDrafter(draft), 3), "tree": (ModelDrafter(draft, tree=TreeShape(nodes=6, width=2)), 3),
                "default": (AutoDrafter(ModelDrafter(draft), PromptLookupDrafter()), "auto")}
    accepted = 0
    for prompt in ([1, 2, 3], [5, 9, 5, 9, 5], [14, 0, 3, 3, 7, 1]):
        reference = reference_greedy(target, prompt, 20)
        for name, (drafter, gamma) in drafters.items():
            result = SpeculativeDecoder(target, drafter, gamma).generate(prompt, max_new_tokens=20, temperature=0)
            assert result.tokens == reference, name
            accepted += result.stats.accepted
    assert accepted > 0


def test_a_pruned_draft_is_refused_beside_another_tokenizer(hf_pair, gguf_models):
    _, draft, _ = hf_pair
    other = specdec.load_model(gguf_models["gguf-f32"], threads=1)
    with pytest.raises(specdec.SpecDecError, match="distilled for another tokenizer"):
        PrunedVocab(draft.inner, draft.vocab_map, other.tokenizer)


# ------------------------------------------------------------------------------ llama.cpp


@pytest.fixture(scope="module")
def gguf_pair(gguf_models, tmp_path_factory):
    """The demo draft in float32 on llama.cpp as the target, and a noisy copy of it predicting its
    first 4096 token ids less the 2nd and 4th most likely first tokens after the test prompt, as GGUF."""
    target = specdec.load_model(gguf_models["gguf-f32"], threads=1)
    first = torch.softmax(target.sequence().forward(target.tokenizer.encode("def f(x):"), last=1)[0], -1).argsort(descending=True)
    keep = sorted(set(range(4096)) - {int(first[1]), int(first[3])})
    directory = prune(gguf_models["hf-draft"], keep, target, tmp_path_factory.mktemp("pruned-gguf"), noise=0.004, gguf=True)
    return target, directory, keep


def test_the_exported_gguf_computes_the_checkpoints_logits(gguf_pair):
    target, directory, _ = gguf_pair
    hf, gguf = load_draft(directory, target, device="cpu"), load_draft(directory / "draft.gguf", target, threads=1)
    tokens = target.tokenizer.encode("import os\n\ndef list_files(path):\n    return")
    a, b = hf.sequence().forward(tokens), gguf.sequence().forward(tokens)
    assert a.shape == b.shape == (len(tokens), 4094) and torch.isfinite(a).all() and torch.isfinite(b).all()
    assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())  # Q8_0 rounding
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.9


def test_greedy_speculation_with_a_pruned_gguf_draft_equals_plain_greedy_llamacpp(gguf_pair, gguf_models):
    target, directory, _ = gguf_pair
    plain = SpeculativeDecoder(target)
    accepted = 0
    for gamma, tree in ((3, None), (3, 6), ("auto", None)):
        decoder = specdec.load(gguf_models["gguf-f32"], draft=str(directory / "draft.gguf"), gamma=gamma, tree=tree, threads=1)
        assert isinstance(decoder.draft_model, PrunedVocab)
        for prompt in ("def fibonacci(n):", "class Stack:\n    def __init__(self):\n"):
            result = decoder.generate(prompt, max_new_tokens=32, temperature=0)
            assert result.tokens == plain.generate(prompt, max_new_tokens=32, temperature=0).tokens, (gamma, tree, prompt)
            accepted += result.stats.accepted
    assert accepted > 0


@pytest.mark.statistical
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampled_speculation_with_a_pruned_gguf_draft_keeps_the_target_distribution(gguf_pair, kind):
    target, directory, keep = gguf_pair
    draft = load_draft(directory / "draft.gguf", target, threads=1)
    drafter = ModelDrafter(draft) if kind == "chain" else ModelDrafter(draft, tree=TreeShape(nodes=6, width=2))
    decoder, setting = SpeculativeDecoder(target, drafter, gamma=2), dict(temperature=1.0)
    prompt = target.tokenizer.encode("def f(x):")
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(SAMPLES):
        result = decoder.generate(prompt, max_new_tokens=3, seed=seed + zlib.crc32(kind.encode()), **setting)
        counts[tuple(result.tokens)] += 1
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0.1 < accepted / drafted < 0.95, "both acceptances and rejections must happen"
    assert sum(n for seq, n in counts.items() if seq[0] not in keep) > 20, "the pruned first tokens must still be emitted"
    assert chi_square(counts, pruned_joint(target, prompt, SamplingParams(**setting), SAMPLES), SAMPLES) > ALPHA


# ------------------------------------------------------------------------------ distillation


def test_soft_loss_is_cross_entropy_to_the_renormalised_top_k():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    top_ids, top_logits = torch.tensor([[2, 5, -1]] * 3), torch.tensor([[1.0, 0.0, 9.0]] * 3)
    weights = torch.softmax(torch.tensor([1.0, 0.0]), 0)  # the -1 (outside the draft) is dropped
    expected = -(weights * torch.log_softmax(logits, -1)[:, [2, 5]]).sum(-1)
    assert torch.allclose(soft_loss(logits, top_ids, top_logits), expected)
    # a position none of whose top-k the draft can predict (prose before a code model's small vocabulary)
    assert soft_loss(logits[:1], torch.tensor([[-1, -1, -1]]), top_logits[:1]).tolist() == [0.0]


@pytest.fixture(scope="module")
def distilled(gguf_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("distilled")
    config = DistillConfig(target=gguf_models["gguf-f16"], output=str(out), corpus_tokens=30_000, prompts=40, short_prompts=8, prompt_tokens=24,
                           new_tokens=16, generate_batch=8, draft_vocab=600, steps=20, threads=1, **TINY_DRAFT)
    first = distill(config)
    generated = sorted((out / "work").glob("generations-*.npz"))
    stamps = [f.stat().st_mtime_ns for f in generated]
    config.steps = 60
    report = distill(config)  # the same command with more steps: resumes
    assert [f.stat().st_mtime_ns for f in generated] == stamps, "a resumed run must not generate again"
    return out, first, report


def test_distilling_from_a_gguf_target_resumes_and_writes_a_usable_draft(distilled, gguf_models):
    out, first, report = distilled
    assert first["steps"] == 20 and report["steps"] == 60
    assert [h["step"] for h in report["history"]] == [10, 20, 30, 40, 50, 60]
    assert report["history"][:2] == first["history"]
    assert report["history"][-1]["train_loss"] < report["history"][0]["train_loss"]
    assert report["vocabulary"]["draft"] == 600 and report["vocabulary"]["target"] == 8192
    assert 0.5 < report["vocabulary"]["generated_tokens_covered"] <= 1
    assert report["continuations"] == 48 and set(report["stages"]) == {"corpus", "generate", "train"}
    generations = Generations.load(sorted((out / "work").glob("generations-*.npz")))
    assert generations.tokens.shape == (48, 40) and sorted(set(generations.prompt_lengths[:40])) == [24]
    assert all(8 <= n <= 12 for n in generations.prompt_lengths[40:]), "short prompts: 8 tokens up to half of prompt_tokens"
    generated = generations.generated()
    assert generated[40:].sum(1).min() > 16, "a short prompt's continuation fills the row (unless the target stopped)"
    greedy = generations.tokens[0][generated[0]]  # row 0 is greedy: each token is its soft labels' first
    assert (greedy == generations.top_ids[0][generated[0]][:, 0]).all()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "vocab_map.json", "draft.gguf", "distill.json"):
        assert (out / name).is_file(), name
    plain = specdec.load(gguf_models["gguf-f16"], plain=True, threads=1)
    for draft in (out / "draft.gguf", out):
        decoder = specdec.load(gguf_models["gguf-f16"], draft=str(draft), gamma=3, threads=1)
        for prompt in ("def fibonacci(n):", "import os\n"):
            assert decoder.generate(prompt, max_new_tokens=24, temperature=0).tokens == plain.generate(prompt, max_new_tokens=24, temperature=0).tokens


def test_distilling_from_a_checkpoint_target(model_dirs, tmp_path):
    corpus = tmp_path / "text"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"t{i}.txt").write_text("abc def ghi jkl m " * 40)
    out = tmp_path / "d"
    report = distill(DistillConfig(target=model_dirs["llama-eos"], output=str(out), files=[str(corpus)], corpus_tokens=5000, prompts=24,
                                   short_prompts=8, prompt_tokens=8, new_tokens=8, draft_vocab=10, steps=20, **TINY_DRAFT))
    assert report["vocabulary"] == {"draft": 10, "target": 16, "generated_tokens_covered": report["vocabulary"]["generated_tokens_covered"]}
    assert json.loads((out / "vocab_map.json").read_text())["target_vocab_size"] == 16
    decoder = specdec.load(model_dirs["llama-eos"], draft=str(out), gamma=3, dtype="float64")
    assert isinstance(decoder.draft_model, PrunedVocab)
    plain = specdec.load(model_dirs["llama-eos"], plain=True, dtype="float64")
    for prompt in ([1, 2, 3], [4, 5, 6, 7]):
        assert decoder.generate(prompt, max_new_tokens=12, temperature=0).tokens == plain.generate(prompt, max_new_tokens=12, temperature=0).tokens


def test_the_cli_distils_and_reports_bad_input(gguf_models, tmp_path):
    command = [sys.executable, "-m", "specdec", "train", "--distill-from", gguf_models["gguf-f16"], "-o", str(tmp_path / "d"),
               "--corpus-tokens", "20000", "--prompts", "16", "--short-prompts", "4", "--prompt-tokens", "16", "--new-tokens", "8", "--draft-vocab", "300",
               "--hidden-size", "32", "--heads", "2", "--kv-heads", "1", "--intermediate-size", "64", "--layers", "1", "--steps", "5",
               "--eval-every", "5", "--holdout", "0.2", "--threads", "1", "--no-gguf"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "predicting 300 of 8192 tokens" in done.stderr and not (tmp_path / "d" / "draft.gguf").exists()
    for bad, message in ((["--draft-vocab", "0"], "draft-vocab must be >= 1"), (["--heads", "3"], "must split into 3 heads")):
        done = subprocess.run(command + bad, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    missing = subprocess.run([sys.executable, "-m", "specdec", "train", "--distill-from", str(tmp_path / "none.gguf"), "-o", str(tmp_path / "e")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr, missing.stderr


def test_the_default_corpus_holds_pythons_documentation_then_the_standard_library():
    """Without files, distillation reads prose first (the reference topics `help()` shows), then code."""
    from specdec.distill import build_corpus, python_docs

    class Bytes:  # a tokenizer of UTF-8 bytes, 0 the end of a text
        eos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return list(text.encode()[:4000])

    docs = python_docs()
    if not docs:
        pytest.skip("this Python was built without pydoc_data's topics")
    stream = build_corpus(DistillConfig(target="", output="", corpus_tokens=6000, prompt_tokens=16, progress=False),
                          Bytes())
    prose = docs.encode()[:4000]
    assert bytes(stream[:4000].astype("uint8")) == prose and stream[4000] == 0
    assert b"import" in bytes(stream[4001:].astype("uint8")) or b"def " in bytes(stream[4001:].astype("uint8"))
