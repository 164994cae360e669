"""Penalties, a logit bias and min-p (`specdec.penalties`, `sampling.probs_from_logits`), lossless under
speculation: each draft row is penalised by the tokens on its own path. One step enumerated exactly
(chains and trees), the joint of sampled output by chi-square, greedy text equal to plain decoding's
on every architecture and on llama.cpp; bad values refused by name."""

from __future__ import annotations

import zlib
from collections import Counter

import pytest
import torch

import specdec
from specdec.drafters import ModelDrafter, TreeShape
from specdec.drafters.base import DraftRequest
from specdec.errors import SpecDecError
from specdec.params import SamplingParams
from specdec.penalties import Penalties
from specdec.sampling import probs_from_logits
from specdec.verify import verify_tree
from conftest import ARCHS
from reference import path_to
from test_statistical import SAMPLES, chi_square_pvalue
from test_tree_exact import TableLM
from test_verify_exact import Conditional, completions, enumerator, target_joint  # noqa: F401 (enumerator: a fixture)

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.6, logit_bias={1: 0.8})
PROMPT = (0, 1, 2)


def reference_logits(logits: torch.Tensor, prompt, output, vocab: int, presence=0.0, frequency=0.0, repetition=1.0,
                     bias=None) -> torch.Tensor:
    """The penalties written out token by token, as vLLM documents them (the test's own reference)."""
    out = logits.clone().double()
    for token in range(vocab):
        if token in prompt or token in output:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        count = list(output).count(token)
        out[token] -= frequency * count + presence * (count > 0)
        out[token] += (bias or {}).get(token, 0.0)
    return out


class Penalised:
    """The target's table with PENALTIES applied after each history (a table as `Conditional` is)."""

    def __init__(self, target: Conditional):
        self.target, self.vocab, self.rows = target, target.vocab, {}

    def __call__(self, history):
        if history not in self.rows:
            logits = reference_logits(self.target(history).log(), PROMPT, history, self.vocab,
                                      **{k.split("_")[0]: v for k, v in PENALTIES.items() if k != "logit_bias"},
                                      bias=PENALTIES["logit_bias"])
            self.rows[history] = torch.softmax(logits, dim=-1)
        return self.rows[history]


@pytest.mark.parametrize("tree", [None, TreeShape(5, 2)], ids=["chain", "tree"])
def test_one_penalised_step_keeps_the_penalised_target_exactly(enumerator, tree):
    """A draft model's chain or tree verified against the target penalised row by row on each path: the
    joint of the step and what follows is the penalised target's, every draw enumerated."""
    target, draft = Conditional(3, seed=71), Conditional(3, seed=72)
    penalised_target, depth = Penalised(target), 3
    sampling = SamplingParams(temperature=1.0, **PENALTIES)

    def iteration():
        drafter = ModelDrafter(TableLM(draft, PROMPT), tree=tree)
        proposal = drafter.propose([DraftRequest(drafter.open(PROMPT), list(PROMPT), depth,
                                                 SamplingParams(temperature=1.0), None)])[0]
        histories = [()] + [tuple(proposal.tokens[path_to(proposal.parents, node)].tolist())
                            for node in range(len(proposal))]
        logits = torch.stack([target(h).log() for h in histories])
        shaped = Penalties(sampling, PROMPT, 3).shape(logits, proposal.tokens.tolist(), proposal.parents.tolist())
        probs = probs_from_logits(shaped, sampling)
        return tuple(verify_tree(proposal.tokens, proposal.parents, proposal.probs, probs, None, None,
                                 proposal.columns).tokens)

    joint = {}
    for output, weight in enumerator.run(iteration):
        for seq, tail in completions(penalised_target, output, depth + 1):
            joint[seq] = joint.get(seq, 0.0) + weight * tail
    for seq, p in target_joint(penalised_target, depth + 1).items():
        assert abs(joint.get(seq, 0.0) - p) < 1e-9, seq


def test_each_row_counts_its_own_path():
    """Rows of a tree: the root's counts are the output's; a node's add its ancestors' tokens and its own."""
    sampling = SamplingParams(frequency_penalty=1.0)
    penalties = Penalties(sampling, [0], 4)
    penalties.advance([2])
    tokens, parents = [2, 3, 2, 1], [-1, 0, 0, -1]  # 2 (3, 2), 1
    shaped = penalties.shape(torch.zeros(5, 4), tokens, parents)
    expected = [[0, 0, -1, 0], [0, 0, -2, 0], [0, 0, -2, -1], [0, 0, -3, 0], [0, -1, -1, 0]]
    assert shaped.tolist() == expected


def test_min_p_drops_what_is_less_likely_than_its_share_of_the_best():
    probs = probs_from_logits(torch.tensor([[0.0, -1.0, -3.0, -6.0]]), SamplingParams(min_p=0.1))
    assert probs[0, 2:].tolist() == [0.0, 0.0] and abs(float(probs.sum()) - 1) < 1e-6
    assert torch.equal(probs_from_logits(torch.tensor([[0.0, -1.0]]), SamplingParams(min_p=0.0)),
                       probs_from_logits(torch.tensor([[0.0, -1.0]]), SamplingParams()))


@pytest.mark.parametrize("field,value", [("min_p", 1.5), ("presence_penalty", 3), ("frequency_penalty", -2.5),
                                         ("repetition_penalty", 0), ("logit_bias", {3: 500}),
                                         ("logit_bias", {"x": 1})])
def test_bad_values_are_refused_by_name(field, value):
    with pytest.raises(SpecDecError) as refused:
        SamplingParams(**{field: value})
    assert refused.value.param == field


def test_greedy_penalised_speculation_equals_penalised_plain_on_every_architecture(model_dirs):
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    settings = dict(repetition_penalty=1.5, frequency_penalty=0.4, logit_bias={3: -2.0, 5: 1.0})
    for arch in ARCHS:
        reference = specdec.load(model_dirs[arch], plain=True, dtype="float64").generate(
            prompt, temperature=0, max_new_tokens=20, **settings)
        unpenalised = specdec.load(model_dirs[arch], plain=True, dtype="float64").generate(
            prompt, temperature=0, max_new_tokens=20)
        assert reference.tokens != unpenalised.tokens, arch  # the penalties change what is written
        for options in (dict(), dict(gamma=3), dict(gamma=2, tree=6)):
            decoder = specdec.load(model_dirs[arch], model_dirs[f"{arch}-draft"], dtype="float64", **options)
            result = decoder.generate(prompt, temperature=0, max_new_tokens=20, **settings)
            assert result.tokens == reference.tokens, (arch, options)


def test_greedy_penalised_speculation_on_llama_cpp(gguf_models):
    settings = dict(repetition_penalty=1.3, presence_penalty=0.6)
    prompt = "def fibonacci(n):"
    plain = specdec.load(gguf_models["gguf-f16"], plain=True, threads=1)
    expected = plain.generate(prompt, temperature=0, max_new_tokens=48, **settings)
    assert expected.tokens != plain.generate(prompt, temperature=0, max_new_tokens=48).tokens
    for options in (dict(), dict(gamma=3)):
        decoder = specdec.load(gguf_models["gguf-f16"], gguf_models["gguf-draft-f16"], threads=1, **options)
        assert decoder.generate(prompt, temperature=0, max_new_tokens=48, **settings).tokens == expected.tokens


def exact_penalised_joint(target: specdec.CausalLM, sampling: SamplingParams, prompt, length=3):
    """P(y1..y3) under penalised plain sampling, by enumeration with no-cache forwards and the reference."""
    vocab, bias = target.vocab_size, dict(sampling.logit_bias)
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1, :vocab]
        rows = torch.stack([reference_logits(row, prompt, prefix, vocab, sampling.presence_penalty,
                                             sampling.frequency_penalty, sampling.repetition_penalty, bias)
                            for prefix, row in zip(prefixes, logits)])
        probs = probs_from_logits(rows, sampling)
        joint = {p + (t,): joint[p] * float(probs[i, t]) for i, p in enumerate(prefixes)
                 for t in range(vocab) if probs[i, t] > 0}
    return joint


@pytest.mark.statistical
@pytest.mark.parametrize("drafter", ["draft-model"])
def test_penalised_sampling_follows_the_penalised_target(model_dirs, drafter):
    """The first 3 tokens with every penalty, a bias and min-p, sampled at T 1: their joint is penalised
    plain sampling's (chi-square). The draft model's drawn chains, verified by rejection sampling (the
    default's keyed draws are the same shaped rows, checked under a constraint in test_constraints)."""
    target = specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")
    draft = ModelDrafter(specdec.load_model(model_dirs["qwen2-draft"], device="cpu", dtype="float64"))
    auto = specdec.AutoDrafter(draft, specdec.PromptLookupDrafter())
    decoder = (specdec.SpeculativeDecoder(target, draft, gamma=2) if drafter == "draft-model"
               else specdec.SpeculativeDecoder(target, auto, gamma="auto"))
    sampling = SamplingParams(temperature=1.0, min_p=0.02, presence_penalty=0.8, frequency_penalty=0.5,
                              repetition_penalty=1.4, logit_bias={4: 1.5, 7: -1.0})
    prompt, seed = [1, 2, 3, 1, 2, 3, 1, 2], zlib.crc32(drafter.encode())
    counts, drafted, accepted = Counter(), 0, 0
    for i in range(SAMPLES):
        from dataclasses import replace

        result = decoder.generate(prompt, replace(sampling, seed=seed + i), max_new_tokens=3)
        counts[tuple(result.tokens)] += 1
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0 < accepted < drafted
    pvalue = chi_square_pvalue(counts, exact_penalised_joint(target, sampling, prompt), SAMPLES)
    assert pvalue > 1e-4, f"p-value {pvalue:.3g}"


def test_stop_token_ids_end_and_ignore_eos_goes_past_the_end_token(model_dirs):
    decoder = specdec.load(model_dirs["llama-eos"], model_dirs["llama-draft"], dtype="float64")
    ended = decoder.generate([1, 2, 3], temperature=0, max_new_tokens=30)
    assert ended.finish_reason == "stop" and len(ended.tokens) < 30  # the model's end token (after 12 tokens)
    past = decoder.generate([1, 2, 3], temperature=0, max_new_tokens=30, ignore_eos=True)
    assert past.finish_reason == "length" and len(past.tokens) == 30 and past.tokens[:len(ended.tokens)] == ended.tokens
    stop_at = past.tokens[4]
    cut = decoder.generate([1, 2, 3], temperature=0, max_new_tokens=30, ignore_eos=True, stop_token_ids=(stop_at,))
    assert cut.finish_reason == "stop" and stop_at not in cut.tokens[:past.tokens.index(stop_at)]
    with pytest.raises(SpecDecError) as refused:
        decoder.generate([1, 2, 3], stop_token_ids=(10**6,))
    assert refused.value.param == "stop_token_ids"


def test_the_server_honours_every_sampling_field(model_dirs):
    import httpx

    from specdec.server import create_app
    from test_server import MODEL, LiveServer, make_decoder

    fields = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, min_p=0.05,
                  logit_bias={"3": -5.0, "6": 2.0})
    live = LiveServer(create_app(make_decoder(model_dirs), MODEL, max_queue=8, depth=None))
    try:
        reply = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "hi ej", "max_tokens": 16,
                                                               "temperature": 0, **fields}, timeout=30).json()
        offline = make_decoder(model_dirs).generate("hi ej", max_new_tokens=16, temperature=0,
                                                    **{**fields, "logit_bias": {3: -5.0, 6: 2.0}})
        plain = make_decoder(model_dirs).generate("hi ej", max_new_tokens=16, temperature=0)
        assert reply["choices"][0]["text"] == offline.text != plain.text
    finally:
        live.stop()
