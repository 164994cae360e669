"""The llama.cpp backend: lossless on every drafter, equal to transformers on the same weights, and
clear errors for bad files.

Models (the `gguf_models` fixture makes them on first use; tests/gguf_data.py): the demo pair's f16
GGUF files, the demo draft model converted in float32 (draft-f32.gguf) beside its transformers
checkpoint, and a perturbed copy of it (near-f16.gguf) that drafts for it.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

import specdec
import specdec.decoder
from specdec import AutoDrafter, ModelDrafter, NgramDrafter, PromptLookupDrafter, SpeculativeDecoder, TreeShape
from specdec.demo import demo_ngram
from specdec.katz import KatzTrigram
from specdec.sampling import probs_from_logits
from specdec.engine import DecodeState, Engine
from specdec.policy import FixedGamma
from specdec.sampling import RandomStreams
from specdec.types import GenerationStats
from specdec.params import SamplingParams
from test_cache_invariant import record_sequences

PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):\n"]
TOLERANCE = 5e-3  # logits of the same text fed in other batches or cell orders (see the cache test)
REPEATING = "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor"  # prompt lookup has drafts


@pytest.fixture(scope="module")
def gguf(gguf_models):
    load = lambda key: specdec.load_model(gguf_models[key], threads=1)
    return {"target": load("gguf-f16"), "draft": load("gguf-draft-f16"), "f32": load("gguf-f32"), "near": load("gguf-near")}


def drafters(target, draft) -> dict[str, tuple]:
    """Every drafter kind, each with its γ (a tree's depth)."""
    ngram = KatzTrigram.load(demo_ngram())
    return {
        "chain": (ModelDrafter(draft), 4),
        "tree": (ModelDrafter(draft, tree=TreeShape(nodes=8, width=2)), 4),
        "staged chain (lookup)": (ModelDrafter(draft, inner=PromptLookupDrafter(), inner_gamma=4), 3),
        "staged tree (n-gram)": (ModelDrafter(draft, tree=TreeShape(nodes=6, width=2), inner=NgramDrafter(ngram)), 3),
        "prompt lookup": (PromptLookupDrafter(), 8),
        "n-gram": (NgramDrafter(ngram), 4),
        "adaptive chain": (ModelDrafter(draft), "auto"),
    }


def test_greedy_speculative_equals_plain_greedy_for_every_drafter(gguf):
    target = gguf["target"]
    plain = SpeculativeDecoder(target)
    for prompt in PROMPTS + [REPEATING]:
        reference = plain.generate(prompt, max_new_tokens=48, temperature=0)
        for name, (drafter, gamma) in drafters(target, gguf["draft"]).items():
            result = SpeculativeDecoder(target, drafter, gamma).generate(prompt, max_new_tokens=48, temperature=0)
            assert result.tokens == reference.tokens, f"{name} on {prompt!r}"
            assert result.text == reference.text
            assert result.stats.accepted > 0 or name == "n-gram", f"{name} never had a draft token accepted"


def test_plain_greedy_equals_transformers_on_the_same_weights(gguf, gguf_models):
    """float32 on both sides: the demo draft checkpoint and its float32 GGUF. Same tokens, and the
    logits along the way agree to float32 rounding."""
    hf = specdec.load_model(gguf_models["hf-draft"], device="cpu", dtype="float32")
    ours = gguf["f32"]
    assert ours.tokenizer.get_vocab() == hf.tokenizer.get_vocab()
    for prompt in PROMPTS:
        ids = hf.tokenizer.encode(prompt)
        assert ours.tokenizer.encode(prompt) == ids
        tokens = SpeculativeDecoder(ours).generate(ids, max_new_tokens=64, temperature=0).tokens
        assert tokens == SpeculativeDecoder(hf).generate(ids, max_new_tokens=64, temperature=0).tokens
        theirs, mine = hf.sequence().forward(ids + tokens), ours.sequence().forward(ids + tokens)
        assert float((theirs - mine).abs().max()) < 2e-3


def test_the_cache_matches_a_fresh_prefill_after_many_iterations(gguf):
    """After every iteration of sampled tree drafting (rejections included), the target's next-token
    logits from its sequence equal a fresh prefill's of the committed text, up to llama.cpp's own
    float32 rounding: plain one-token decoding already differs from a prefill by up to 1.7e-3 on this
    model (kernels and summation order depend on the batch shape and the cells' order)."""
    target = gguf["f32"]
    opened = record_sequences(target)
    drafter = ModelDrafter(gguf["target"], tree=TreeShape(nodes=6, width=2))
    context = target.tokenizer.encode(PROMPTS[0])
    stats, worst_wrong = GenerationStats(), 0.0
    state = DecodeState(list(context), SamplingParams(temperature=1.0), 60, FixedGamma(3), RandomStreams(3), stats)
    for step in Engine(target, drafter).run(state):
        context = context + step.tokens
        if step.finish_reason:
            break
        sequence = opened[0]  # the engine's (the fresh prefills below open more)
        assert sequence.cache_len == len(context) - 1
        cached = sequence.forward(context[-1:])[-1]
        sequence.truncate(len(context) - 1)  # back to the engine's invariant
        fresh = prefill(target, context)
        assert float((cached - fresh).abs().max()) < TOLERANCE
        # what a wrong cache entry would look like: far outside the tolerance
        skipped = prefill(target, context[:-2] + context[-1:])
        worst_wrong = max(worst_wrong, float((cached - skipped).abs().max()))
    assert stats.iterations >= 10 and 0 < stats.accepted < stats.drafted
    assert worst_wrong > 20 * TOLERANCE


def prefill(model, tokens: list[int]) -> torch.Tensor:
    """Next-token logits after `tokens`, fed at once in a new sequence (released afterwards)."""
    sequence = model.sequence()
    try:
        return sequence.forward(tokens, last=1)[-1]
    finally:
        sequence.release()


# ------------------------------------------------------------------------------ distributions


ALPHA = 1e-4
SAMPLES = 1500
LENGTH = 3
REST = ("rest",)


def pruned_joint(model, prompt: list[int], sampling: SamplingParams, samples: int) -> dict[tuple, float]:
    """P(y1 y2 y3) under `model` with the sampling transform, exactly, for every sequence whose
    prefixes are each likely enough to be seen (p >= 1 / (4 samples)); the rest's mass in REST."""
    joint, rest = {(): 1.0}, 0.0
    for _ in range(LENGTH):
        grown = {}
        for prefix, p in joint.items():
            probs = probs_from_logits(prefill(model, prompt + list(prefix))[None], sampling)[0].double()
            for token in torch.nonzero(probs * p * samples * 4 >= 1).flatten().tolist():
                grown[prefix + (token,)] = p * float(probs[token])
            rest += p - sum(grown.get(prefix + (t,), 0.0) for t in torch.nonzero(probs * p * samples * 4 >= 1).flatten().tolist())
        joint = grown
    joint[REST] = max(rest, 0.0)
    return joint


def chi_square(counts: Counter, joint: dict[tuple, float], samples: int) -> float:
    """p-value of the counts against the joint; cells expected < 5 are pooled with REST."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, prob in joint.items():
        seen = counts.get(seq, 0)
        if prob * samples >= 5 and seq != REST:
            observed.append(seen)
            expected.append(prob * samples)
        else:
            pooled_obs += seen
            pooled_exp += prob * samples
    pooled_obs += sum(n for seq, n in counts.items() if seq not in joint)
    observed.append(pooled_obs)
    expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


# each kind at one of two settings (T 1; T 1 top-p 0.8), each setting met by two kinds or more (20 s a case)
SAMPLED_KINDS = [("chain", "t1"), ("tree", "topp0.8"), ("staged", "topp0.8"), ("auto", "t1"), ("auto/keyed", "topp0.8")]


@pytest.mark.statistical
@pytest.mark.parametrize("kind, setting", [(kind, {"t1": dict(temperature=1.0), "topp0.8": dict(temperature=1.0, top_p=0.8)}[name])
                                           for kind, name in SAMPLED_KINDS], ids=[f"{k}-{n}" for k, n in SAMPLED_KINDS])
def test_sampled_speculation_keeps_the_target_distribution(gguf, kind, setting):
    """Chain, tree and staged drafting, and the default drafter (its drawn drafts, as unseeded
    requests run, and its seeded draws by position) on llama.cpp, 2 tokens deep plus the bonus: the
    joint of the first 3 tokens against the target's, computed exactly (chi-square, alpha 1e-4, fixed
    seeds). The target is the demo draft in float32, the drafter a perturbed copy: they disagree often."""
    target, draft = gguf["f32"], gguf["near"]
    drafter = {"chain": ModelDrafter(draft), "tree": ModelDrafter(draft, tree=TreeShape(nodes=6, width=2)),
               "staged": ModelDrafter(draft, inner=PromptLookupDrafter(), inner_gamma=2)}.get(kind)
    decoder = SpeculativeDecoder(target, drafter, gamma=2) if drafter else SpeculativeDecoder(
        target, AutoDrafter(ModelDrafter(draft), PromptLookupDrafter()), gamma=2, history=None, prefix_cache=None)
    prompt = target.tokenizer.encode(REPEATING if kind == "staged" else "def f(x):")  # lookup needs repeats
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(SAMPLES):
        generation = decoder.request(prompt, max_new_tokens=LENGTH, seed=seed, **setting)
        result = decoder.run(generation if kind == "auto/keyed" else generation.drawn(seed))
        counts[tuple(result.tokens)] += 1
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0.1 < accepted / drafted < 0.95, "both acceptances and rejections must happen"
    assert chi_square(counts, pruned_joint(target, prompt, SamplingParams(**setting), SAMPLES), SAMPLES) > ALPHA


# ------------------------------------------------------------------------------ files and errors


def test_bad_files_are_clear_errors_never_a_crash(tmp_path, gguf_models):
    """Each runs in a child process, so an abort inside llama.cpp would show as a crash, not pass."""
    good = open(gguf_models["gguf-draft-f16"], "rb").read()
    cases = {
        "text.gguf": (b"not a model at all\n", "is not a GGUF file"),
        "empty.gguf": (b"", "is not a GGUF file"),
        "truncated.gguf": (good[: len(good) // 2], "llama.cpp could not load"),
        "header-only.gguf": (good[:64], "llama.cpp could not load"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        code, err = run_cli("generate", "hi", "--target", str(tmp_path / name))
        assert code == 1 and message in err and "Traceback" not in err, (name, err)
    code, err = run_cli("generate", "hi", "--target", str(tmp_path / "missing.gguf"))
    assert code == 1 and "model not found" in err
    code, err = run_cli("generate", "hi", "--target", gguf_models["gguf-f16"], "--dtype", "float16")
    assert code == 1 and "a GGUF file fixes its types" in err


def run_cli(*argv) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "specdec", *argv], capture_output=True, text=True, timeout=120)
    return done.returncode, done.stderr


def test_a_quantized_file_loads_and_decodes_losslessly(gguf, gguf_models):
    """Q8_0 weights: trees pass the tree check, and greedy tree drafting equals plain decoding."""
    quantized = specdec.load_model(gguf_models["gguf-q8_0"], threads=1)
    assert quantized.dtype == "Q8_0" and quantized.weight_bytes < gguf["draft"].weight_bytes
    assert quantized.tree_refusal() is None
    reference = SpeculativeDecoder(quantized).generate(PROMPTS[1], max_new_tokens=40, temperature=0)
    drafted = SpeculativeDecoder(quantized, ModelDrafter(gguf["near"], tree=TreeShape(nodes=6, width=2)), 3)
    result = drafted.generate(PROMPTS[1], max_new_tokens=40, temperature=0)
    assert result.tokens == reference.tokens and result.stats.accepted > 0


def test_a_checkpoint_directory_on_the_llamacpp_backend_is_refused(model_dirs):
    with pytest.raises(specdec.SpecDecError, match="is a directory, not a GGUF file"):
        specdec.load(model_dirs["llama"], backend="llamacpp")


def test_tokenizer_round_trips_and_matches_transformers(gguf, gguf_models):
    hf = specdec.load_model(gguf_models["hf-draft"], device="cpu").tokenizer
    ours = gguf["draft"].tokenizer
    text = open(specdec.decoder.__file__, encoding="utf-8").read()
    ids = ours.encode(text)
    assert ids == hf.encode(text) and ours.decode(ids) == text
    assert ours.decode(ids[:5] + [0] + ids[5:10], skip_special_tokens=True) == hf.decode(ids[:5] + [0] + ids[5:10], skip_special_tokens=True)
    assert len(ours) == gguf["draft"].vocab_size == len(hf)
    assert gguf["draft"].stop_token_ids == {hf.eos_token_id}


def test_cli_generates_on_the_demo_pair_by_default():
    code = subprocess.run([sys.executable, "-m", "specdec", "generate", "def fibonacci(n):", "--max-new-tokens", "24",
                           "--temperature", "0", "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert code.returncode == 0, code.stderr
    assert "[specdec]" in code.stderr and "acceptance" in code.stderr
    assert code.stdout.strip()


def test_mismatched_vocabularies_are_refused(gguf, model_dirs):
    tiny = specdec.load_model(model_dirs["llama"], device="cpu")
    with pytest.raises(specdec.SpecDecError, match="tokenizer does not match|tokenizer has tokens the target lacks"):
        SpeculativeDecoder(gguf["target"], ModelDrafter(tiny))


def test_the_server_serves_gguf_models(gguf):
    """Completions (whole and streamed) equal offline generation; chat renders the template through
    the GGUF tokenizer."""
    import httpx

    from specdec.server import create_app
    from test_server import CHAT_TEMPLATE, LiveServer, sse_events

    decoder = SpeculativeDecoder(gguf["target"], ModelDrafter(gguf["draft"]), gamma=3)
    want = SpeculativeDecoder(gguf["target"]).generate(PROMPTS[0], max_new_tokens=24, temperature=0)
    live = LiveServer(create_app(decoder, "demo", depth=None))
    try:
        body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
        reply = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == want.text and reply["speculative"]["accepted"] > 0
        with httpx.stream("POST", live.url + "/v1/completions", json=body | {"stream": True}, timeout=60) as response:
            events = sse_events(response)
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text
        chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
        assert httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 400  # no template in the file
        gguf["target"].tokenizer.chat_template = CHAT_TEMPLATE
        reply = httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=60).json()
        assert reply["choices"][0]["message"]["role"] == "assistant" and 0 < reply["usage"]["completion_tokens"] <= 8
    finally:
        gguf["target"].tokenizer.chat_template = None
        live.stop()


def test_the_server_batches_gguf_requests(gguf_models):
    """Eight concurrent streams on llama.cpp (slots for all, depth from the measured costs) each
    equal their generation alone; the steps were shared."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    from specdec.server import create_app
    from test_server import LiveServer, metric, sse_events

    target, draft = (specdec.load_model(gguf_models[key], slots=8) for key in ("gguf-f32", "gguf-near"))
    decoder = SpeculativeDecoder(target, ModelDrafter(draft), gamma=3)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(8)]
    live = LiveServer(create_app(decoder, "demo", max_batch=8))

    def streamed(prompt: str) -> str:
        body = {"model": "demo", "prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as response:
            return "".join(e["choices"][0]["text"] for e in sse_events(response)[:-1])

    try:
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(streamed, prompts))
        for prompt, text in zip(prompts, texts):
            assert text == SpeculativeDecoder(target).generate(prompt, max_new_tokens=20, temperature=0).text
        assert metric(live, "specdec_batch_rows_sum") / metric(live, "specdec_batch_rows_count") > 1.5
    finally:
        live.stop()


def test_serve_refuses_more_tree_branches_than_llama_cpp_has_ids(gguf_models):
    run = subprocess.run([sys.executable, "-m", "specdec", "serve", "--target", gguf_models["gguf-f32"], "--draft", gguf_models["gguf-near"],
                          "--tree", "8", "--max-batch", "16", "--port", "1"], capture_output=True, text=True, timeout=120)
    # 16 generations x 9 ids, and the prefix cache's 16 kept sequences: (128 - 16) // 9 = 12 fit
    assert run.returncode == 1 and "need up to 160 llama.cpp sequence ids" in run.stderr and "--max-batch 12" in run.stderr


def test_llama_cpp_python_peers_run_on_the_same_file(gguf):
    """`bench.peers` on a GGUF model: llama-cpp-python's generate(), plain and with its prompt
    lookup, each counting its decodes and stopping at max_new_tokens or before a stop token."""
    from specdec.bench.peers import peers

    target = gguf["target"]
    found = peers(target, gguf["draft"], max_new_tokens=8)
    assert [peer.name for peer in found] == ["llama-cpp-python generate", "llama-cpp-python prompt lookup"]
    assert not any(peer.uses_draft_model for peer in found)
    prompt = target.tokenizer.encode(REPEATING)
    for peer in found:
        run = peer.run(prompt, SamplingParams(temperature=0.0), 0)
        assert 0 < len(run.tokens) <= 8 and not set(run.tokens) & target.stop_token_ids
        assert run.target_forwards >= 1 and run.prefill_seconds is not None and run.seconds >= run.prefill_seconds
