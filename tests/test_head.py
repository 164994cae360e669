"""Draft heads (`specdec.runtime.head`): a small network drafting from the target's own states.

A head changes nothing the target computes, so every test that holds for a draft model holds for
it: one iteration enumerated exactly with the head's own q rows, chi-square end to end on both
backends, greedy equality on the architecture matrix and on llama.cpp. An untrained head is enough
for those: each is made here with random weights (seeded) over a kept subset of the target's
vocabulary (`head_for`), saved with `save_head` and loaded through `load_draft`, and its
acceptance is checked to be neither 0 nor 1. Then what is particular to a head: it reads the
target's verified states (the engine's `observe`), its tree rows equal each path alone, its slots
keep the right guesses, and `specdec train --distill-from T --small-head` trains one, small and fast.

The enumeration of q over a subset's columns (`Draft.columns`, q = 0 elsewhere) is covered
generically (test_verify_exact's and test_tree_exact's "q over fewer columns", test_distill's pruned
chain step); here the real drafter grows its draft from the head's actual rows on the real tiny
target. The head runs in bfloat16 where the CPU has it: rows compared across batches allow its
rounding (`head_atol`), and each such comparison also checks that a wrong state or token is caught.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

import specdec
import specdec.drafters.model as model_module
from specdec import AutoDrafter, ModelDrafter, PromptLookupDrafter, SpeculativeDecoder, TreeShape
from specdec import tree
from specdec.config import DistillConfig
from specdec.distill_head import distill_head, head_inputs
from specdec.drafters.base import DraftRequest
from specdec.engine import DecodeState, Engine
from specdec.policy import FixedGamma
from specdec.runtime import load_draft
from specdec.runtime.head import HeadModel, HeadNet, HeadShape, save_head
from specdec.runtime.prefix import PrefixCache
from specdec.runtime.pruned import PrunedVocab, VocabMap
from specdec.runtime.vocab import tokenizer_fingerprint
from specdec.sampling import RandomStreams, probs_from_logits
from specdec.types import Draft
from specdec.params import SamplingParams
from architectures import ARCHITECTURES
from conftest import reference_greedy
from reference import path_to
from test_architectures import TREES_REFUSED, load_or_skip
from test_distill import TINY_DRAFT
from test_llamacpp import ALPHA, SAMPLES, chi_square, pruned_joint
from test_states import final_norm_output
from test_statistical import assert_follows_target
from test_tree_exact import proposal_deviation
from test_verify_exact import enumerator  # noqa: F401 (a fixture)
from tiny import VOCAB, save_tiny_model

HF_KEEP = [0, 1, 2, 4, 6, 7, 9, 11, 12, 14]  # 10 of the tiny vocabulary's 16 tokens
SCALE = 0.3  # the head's output norm: q moderately peaked, so it agrees with the target sometimes
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=5)]
TINY_HEAD = dict(corpus_tokens=30_000, prompts=40, short_prompts=8, prompt_tokens=24, new_tokens=16, generate_batch=8, draft_vocab=600,
                 threads=1, batch_size=8, lr=3e-3, warmup=5, eval_every=10, save_every=10, progress=False, holdout=0.1)


def head_for(target: specdec.CausalLM, keep: list[int], directory: Path, seed: int = 0, scale: float = SCALE) -> PrunedVocab:
    """An untrained head for `target` predicting the target ids `keep`, saved and loaded back as
    `specdec` loads one: random weights (seeded), the target's embedding and output rows."""
    vocab_map = VocabMap(tuple(keep), target.vocab_size, tokenizer_fingerprint(target.tokenizer, spaces_as_written=True))
    inputs, outputs = head_inputs(target, vocab_map)  # [len(keep) + 1, width], [len(keep), width]
    generator = torch.Generator().manual_seed(seed)
    net = HeadNet(HeadShape(width=target.hidden_size, blocks=1, inner=64, vocab=len(keep)), inputs, outputs)
    with torch.no_grad():
        for parameter in net.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[1] ** 0.5)
        net.out_norm.weight.fill_(scale)
    save_head(net, vocab_map, directory)
    draft = load_draft(directory, target)
    assert isinstance(draft, PrunedVocab) and isinstance(draft.inner, HeadModel)
    return draft


def head_of(slot) -> object:
    """The `HeadSequence` behind a `ModelDrafter` slot (its cache is a `PrunedSequence`)."""
    return slot.cache.inner


def by_hand(draft: PrunedVocab, state: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's guessed state [width] and logits [columns] after the target's `state` and `token`,
    computed directly: the loaded net in its own dtype (bfloat16 where the CPU has it), its guess
    scored by the head's own scoring, both float32 as the head returns them."""
    with torch.inference_mode():
        guessed = draft.inner.net.guess(state.float()[None], torch.tensor(draft.draft_tokens([token]))).float()  # [1, width]
        logits = draft.inner.score(guessed).float()  # [1, columns]
    return guessed[0], logits[0]


def head_atol(draft: PrunedVocab) -> float:
    """The absolute tolerance between the head's rows (states, logits, q) computed in different
    batches: float32's, or bfloat16's where the net was loaded in it (another batch may round a row
    otherwise). A wrong state or token moves a row by far more: each comparison checks that too."""
    return 1e-5 if draft.inner.net.fuse.weight.dtype == torch.float32 else 2e-2


def assert_guessed_from(draft: PrunedVocab, guess: torch.Tensor, state: torch.Tensor, token: int, logits: torch.Tensor | None = None) -> None:
    """The head's guessed state [width] (and the logits [columns] it returned, if given) was made from
    the target's `state` and `token`: it equals the guess by hand, which a zero state (none reported)
    or another token misses."""
    atol, (want_state, want_logits) = head_atol(draft), by_hand(draft, state, token)
    torch.testing.assert_close(guess, want_state, rtol=0, atol=atol)
    if logits is not None:
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=atol)
    columns = draft.columns.tolist()
    other = columns[(columns.index(token) + 1) % len(columns)] if token in columns else columns[0]
    for wrong in (by_hand(draft, torch.zeros_like(state), token), by_hand(draft, state, other)):
        assert not torch.allclose(wrong[1], want_logits, rtol=0, atol=atol), "a wrong state or token must be caught"
        assert not torch.allclose(wrong[0], want_state, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def hf_head(model_dirs, tmp_path_factory):
    """The tiny llama target (float64) and an untrained head predicting 10 of its 16 tokens."""
    target = specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")
    directory = tmp_path_factory.mktemp("head-hf")
    return target, head_for(target, HF_KEEP, directory), directory


def test_the_head_is_made_of_the_targets_rows(hf_head):
    target, draft, _ = hf_head
    net = draft.inner.net
    dtype = net.inputs.dtype  # loaded for inference: bfloat16 where the CPU has it
    assert torch.equal(net.inputs[:-1], target.model.get_input_embeddings().weight[HF_KEEP].to(dtype))
    assert float(net.inputs[-1].abs().max()) == 0, "the unknown id's input row is zero"
    assert torch.equal(net.outputs, target.model.get_output_embeddings().weight[HF_KEEP].to(dtype))
    logits = draft.sequence().forward([1, 2, 3, 5])  # 3 and 5 are not predicted: the unknown id as input
    assert draft.columns.tolist() == HF_KEEP, "q stays in the head's own columns, the kept target ids"
    assert logits.shape == (4, len(HF_KEEP)) and torch.isfinite(logits).all()


# ------------------------------------------------------------------------------ exact


class TargetTable:
    """The real target's next-token distribution after PROMPT + a history, under a sampling transform (memoised)."""

    def __init__(self, target: specdec.CausalLM, prompt: list[int], sampling: SamplingParams):
        self.target, self.prompt, self.sampling, self.vocab, self.rows = target, prompt, sampling, target.vocab_size, {}

    def __call__(self, history: tuple[int, ...]) -> torch.Tensor:
        if history not in self.rows:
            with torch.inference_mode():
                logits = self.target.model(torch.tensor([self.prompt + list(history)])).logits[0, -1:, : self.vocab]
            self.rows[history] = probs_from_logits(logits, self.sampling)[0].double()
        return self.rows[history]


EXACT_KEEP = [1, 3, 4, 8, 12]  # few: every draw of the head is a branch of the enumeration
EXACT_PROMPT = [1, 2, 3, 5, 9]
EXACT_CASES = {"chain t1 d2": (None, 2, SETTINGS[0]), "chain t0.7-topk3 d2": (None, 2, dict(temperature=0.7, top_k=3)),
               "tree sampled 3 w3 d1": (TreeShape(3, 3), 1, SETTINGS[0]), "tree sampled 3 w2 d2": (TreeShape(3, 2), 2, SETTINGS[0])}


@pytest.fixture(scope="module")
def exact_head(hf_head, tmp_path_factory):
    target, _, _ = hf_head
    draft = head_for(target, EXACT_KEEP, tmp_path_factory.mktemp("head-exact"), seed=3, scale=0.5)
    state = final_norm_output(target, EXACT_PROMPT[:-1])  # what the engine reports after the prompt's prefill
    return target, draft, state


def head_iteration_deviation(enumerator, exact_head, case: str, monkeypatch) -> float:
    """Largest deviation from the target's joint of one iteration: the real ModelDrafter grows its
    draft from the head's rows (which read the target's state after the prompt), the real
    verify_tree checks it against the real target; every draw of both is enumerated. q is taken in
    float64 from the head's float32 logits, so the enumeration's sums are exact to 1e-9."""
    monkeypatch.setattr(model_module, "probs_from_logits", lambda logits, sampling: probs_from_logits(logits.double(), sampling))
    target, draft, state = exact_head
    shape, depth, setting = EXACT_CASES[case]
    sampling = SamplingParams(**setting)

    def propose() -> Draft:
        drafter = ModelDrafter(draft, tree=shape)
        slot = drafter.open(EXACT_PROMPT)
        drafter.observe(slot, len(EXACT_PROMPT) - 2, state[None])
        drafter.prefill(slot)
        proposal = drafter.propose([DraftRequest(slot, EXACT_PROMPT, depth, sampling, None)])[0]
        assert isinstance(proposal, Draft) and len(proposal) and proposal.probs is not None
        assert proposal.columns.tolist() == EXACT_KEEP, "q stays in the head's own columns"
        return proposal

    return proposal_deviation(enumerator, propose, TargetTable(target, EXACT_PROMPT, sampling), depth)


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_an_iteration_with_the_heads_q_keeps_the_target_distribution(enumerator, exact_head, case, monkeypatch):
    worst = head_iteration_deviation(enumerator, exact_head, case, monkeypatch)
    assert worst < 1e-9, f"largest deviation from the target's joint: {worst:.3g}"


def test_the_head_enumeration_catches_a_wrong_residual(enumerator, exact_head, monkeypatch):
    """The harness can fail: a recovery drawn from p instead of norm(max(0, p - q)) is caught."""
    import specdec.verify as verify_module

    monkeypatch.setattr(verify_module, "residual", lambda target_probs, draft_probs, token, columns=None: target_probs)
    assert head_iteration_deviation(enumerator, exact_head, "chain t1 d2", monkeypatch) > 1e-3


# ------------------------------------------------------------------------------ the target's states

PREFIX = [1, 2, 3, 1, 5, 9, 2, 6, 5, 3, 5]
TREE_TOKENS, TREE_PARENTS = [4, 5, 6, 7, 8, 9, 10], [-1, 0, -1, 1, 1, 2, 3]  # two branches, a fork, depth 3


def observed_sequence(draft: PrunedVocab, target, tokens: list[int]):
    """A head sequence holding `tokens`, told the target's state after them (as the engine tells it)."""
    sequence = draft.sequence()
    sequence.forward(tokens, last=1)
    sequence.observe(len(tokens) - 1, final_norm_output(target, tokens)[None])
    return sequence


def path_row(draft: PrunedVocab, target, path: list[int]) -> torch.Tensor:
    """[columns]: the head's row after PREFIX + path, the path fed alone in a fresh sequence (every
    row asked for: the head computes only those, and the path's last entry reads the guesses before it)."""
    return observed_sequence(draft, target, PREFIX).forward(path)[-1]


def assert_rows_equal(draft: PrunedVocab, got: torch.Tensor, want: torch.Tensor) -> None:
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=head_atol(draft))  # run in other batches


def test_a_tree_forwards_rows_equal_each_path_alone(hf_head):
    target, draft, _ = hf_head
    sequence = observed_sequence(draft, target, PREFIX)
    root = len(PREFIX) - 1
    rows = sequence.forward(TREE_TOKENS, tree.entries(TREE_PARENTS, root))  # [7, columns]
    first_state = sequence.inner.guesses[root + 1]  # the root's children read the target's state
    assert_guessed_from(draft, first_state, final_norm_output(target, PREFIX), TREE_TOKENS[0], logits=rows[0])
    paths = [[TREE_TOKENS[j] for j in path_to(torch.tensor(TREE_PARENTS), node)] for node in range(len(TREE_TOKENS))]
    for node, path in enumerate(paths):
        assert_rows_equal(draft, rows[node], path_row(draft, target, path))
    assert not torch.allclose(rows[5], rows[6], rtol=0, atol=head_atol(draft)), "rows of different paths differ: the test can fail"


def test_keep_and_truncate_keep_the_guesses_of_the_path(hf_head):
    target, draft, _ = hf_head
    sequence = observed_sequence(draft, target, PREFIX)
    start = len(PREFIX)
    sequence.forward(TREE_TOKENS, tree.entries(TREE_PARENTS, start - 1))
    head = sequence.inner
    path = path_to(torch.tensor(TREE_PARENTS), 6)  # nodes 0, 1, 3, 6: tokens 4, 5, 7, 10
    guessed = [head.guesses[start + node] for node in path]
    sequence.keep(start, [start + node for node in path])
    assert sequence.cache_len == start + len(path)
    for k, state in enumerate(guessed):
        assert head.guesses[start + k] is state
    tokens = [TREE_TOKENS[node] for node in path]
    assert_rows_equal(draft, sequence.forward([3], last=1)[0], path_row(draft, target, tokens + [3]))
    sequence.truncate(start + 1)
    assert len(head.guesses) == start + 1 and head.guesses[start] is guessed[0]
    assert_rows_equal(draft, sequence.forward([8, 2])[-1], path_row(draft, target, tokens[:1] + [8, 2]))


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_the_engine_reports_the_targets_state_and_the_head_reads_it(hf_head, kind):
    """A batch of two, sampled: after prefill and after every step, the state observed is the
    target's final-norm state of the committed text but its last token (computed afresh, no cache),
    and the root entry each proposal fed was guessed from it: net(that state, the last token)."""
    target, draft, _ = hf_head
    drafter = ModelDrafter(draft, tree=TreeShape(6, 2) if kind == "tree" else None)
    engine = Engine(target, drafter)
    states = [DecodeState(prompt, SamplingParams(1.0), 24, FixedGamma(3), RandomStreams(i)) for i, prompt in enumerate([PREFIX, [7, 3, 2]])]
    for state in states:
        engine.open(state)
    checked, drafted, accepted = 0, 0, 0
    running = list(states)
    while running:
        roots = {}
        for state in running:
            head = head_of(state.draft_slot)
            committed = state.context[:-1]
            fresh = final_norm_output(target, committed)
            torch.testing.assert_close(head._observed[len(committed) - 1], fresh.float(), rtol=0, atol=1e-6)
            roots[id(state)] = (state.draft_slot.cached + len(state.draft_slot.pending) - 1, fresh, state.context[-1])
        results = engine.step(running)
        for state, result in zip(running, results):
            assert result.error is None
            if result.drafted:
                entry, fresh, token = roots[id(state)]
                assert_guessed_from(draft, head_of(state.draft_slot).guesses[entry], fresh, token)
                checked += 1
            drafted, accepted = drafted + result.drafted, accepted + result.accepted
        running = [state for state in running if state.finish_reason is None]
    for state in states:
        engine.close(state)
    assert checked >= 10 and 0 < accepted < drafted


def test_a_slot_after_a_generation_drafts_as_a_fresh_slot_on_its_text(hf_head):
    """Cache invariance: after steps of accepting and rejecting, drafting from the slot gives the
    draft a new slot opened on the committed text, told the same state, gives. Without the state the
    fresh slot's draft differs: the test can fail."""
    target, draft, _ = hf_head
    drafter = ModelDrafter(draft, tree=TreeShape(6, 2))
    engine = Engine(target, drafter)
    state = DecodeState(list(PREFIX), SamplingParams(1.0), 40, FixedGamma(3), RandomStreams(4))
    engine.open(state)
    for _ in range(8):
        engine.step([state])
    assert state.finish_reason is None and 0 < state.stats.accepted < state.stats.drafted
    context, observed = state.context, head_of(state.draft_slot)._observed[len(state.context) - 2]
    sampling = SamplingParams(1.0)

    def draft_from(slot) -> Draft:
        return drafter.propose([DraftRequest(slot, context, 3, sampling, torch.Generator().manual_seed(11))])[0]

    fresh, blind = drafter.open(context), drafter.open(context)
    drafter.observe(fresh, len(context) - 2, observed[None])
    for slot in (fresh, blind):
        drafter.prefill(slot)
    old, new, unseen = draft_from(state.draft_slot), draft_from(fresh), draft_from(blind)
    assert torch.equal(old.tokens, new.tokens) and torch.equal(old.parents, new.parents)
    torch.testing.assert_close(old.probs, new.probs, rtol=0, atol=head_atol(draft))
    assert not torch.allclose(unseen.probs[0], new.probs[0], rtol=0, atol=head_atol(draft)), "the state read changes the draft"
    engine.close(state)


# ------------------------------------------------------------------------------ transformers


@pytest.mark.statistical
@pytest.mark.parametrize("kind,setting", [("chain", SETTINGS[0]), ("tree", SETTINGS[1])], ids=["chain-t1", "tree-t0.7-topk5"])
def test_sampled_speculation_with_a_head_follows_the_target_transformers(hf_head, kind, setting):
    target, draft, _ = hf_head
    drafter = ModelDrafter(draft, tree=TreeShape(6, 2) if kind == "tree" else None)
    assert_follows_target(SpeculativeDecoder(target, drafter, gamma=2), setting, seed_key=f"head/{kind}/{setting}")


def test_greedy_speculation_with_a_head_equals_plain_greedy_transformers(hf_head, model_dirs):
    target, draft, directory = hf_head
    drafters = {"chain": (ModelDrafter(draft), 3), "tree": (ModelDrafter(draft, tree=TreeShape(nodes=6, width=2)), 3),
                "default": (AutoDrafter(ModelDrafter(draft), PromptLookupDrafter()), "auto")}
    accepted = Counter()
    for prompt in ([1, 2, 3], [5, 9, 5, 9, 5], [14, 0, 3, 3, 7, 1]):
        reference = reference_greedy(target, prompt, 20)
        for name, (drafter, gamma) in drafters.items():
            result = SpeculativeDecoder(target, drafter, gamma).generate(prompt, max_new_tokens=20, temperature=0)
            assert result.tokens == reference, name
            accepted[name] += result.stats.accepted
    assert accepted["chain"] + accepted["tree"] > 0 and accepted["default"] > 0, accepted
    # through specdec.load, as the CLI loads one
    decoder = specdec.load(model_dirs["llama"], draft=str(directory), gamma="auto", dtype="float64")
    assert isinstance(decoder.draft_model.inner, HeadModel)
    assert decoder.generate([1, 2, 3], max_new_tokens=20, temperature=0).tokens == reference_greedy(target, [1, 2, 3], 20)


def test_a_decoder_with_a_head_warms_the_graphs_its_requests_replay(hf_head, model_dirs, monkeypatch):
    """The pool's graphs are keyed by the states kind the head makes the target keep: the builder turns it on
    before it warms them (here the CPU's graphs, uncaptured, warmed as a GPU's are), so a request captures none."""
    from specdec.runtime.static import StaticHFModel

    monkeypatch.setattr(StaticHFModel, "compiles", property(lambda self: True))
    _, _, directory = hf_head
    decoder = specdec.load(model_dirs["llama"], draft=str(directory), gamma=3, dtype="float64", compile="graphs")
    warmed = set(decoder.target.runner().shapes)
    assert warmed and {states for _, _, states in warmed} == {decoder.target.states_kind} != {None}
    decoder.generate([1, 2, 3, 5, 9], max_new_tokens=12, temperature=0)
    assert set(decoder.target.runner().shapes) == warmed


# ------------------------------------------------------------------------------ the architecture matrix

MATRIX_PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]  # repeats: prompt lookup has drafts to offer


@pytest.fixture(scope="module")
def arch_head_dirs(tmp_path_factory):
    """A saved 2-layer target per architecture and an untrained head for it, made when first asked
    for. The head predicts the tokens of the target's greedy output and two more: few, so that it
    agrees with the target now and then."""
    root, made = tmp_path_factory.mktemp("head-architectures"), {}

    def make(arch: str) -> tuple[str, Path]:
        if arch not in made:
            target_dir = str(save_tiny_model(root / arch, arch, seed=list(ARCHITECTURES).index(arch)))
            target = specdec.load_model(target_dir, device="cpu", dtype="float64")
            greedy = set(reference_greedy(target, MATRIX_PROMPT, 24))
            head_for(target, sorted(greedy | set([t for t in range(16) if t not in greedy][:2])), root / f"{arch}-head")
            made[arch] = target_dir, root / f"{arch}-head"
        return made[arch]

    return make


@pytest.mark.architectures
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_head_drafter_equals_plain_greedy_on_the_architecture_matrix(arch, implementation, arch_head_dirs):
    target_dir, head_dir = arch_head_dirs(arch)
    target = load_or_skip(target_dir, arch, implementation)
    draft = load_draft(head_dir, target)
    new = min(100, target.max_length - len(MATRIX_PROMPT))  # into the context's end (Bloom's is 2048)
    plain = SpeculativeDecoder(target).generate(MATRIX_PROMPT, max_new_tokens=new, temperature=0).tokens
    assert plain == reference_greedy(target, MATRIX_PROMPT, len(plain))
    drafters = {"chain": (ModelDrafter(draft), 3), "tree": (ModelDrafter(draft, tree=TreeShape(nodes=8, width=2)), 3),
                "default": (AutoDrafter(ModelDrafter(draft), PromptLookupDrafter()), "auto")}
    accepted = Counter()
    for name, (drafter, gamma) in drafters.items():
        if name == "tree" and arch in TREES_REFUSED:
            with pytest.raises(specdec.SpecDecError, match=rf"does not support token trees \({TREES_REFUSED[arch]}"):
                SpeculativeDecoder(target, drafter, gamma)
            continue
        result = SpeculativeDecoder(target, drafter, gamma).generate(MATRIX_PROMPT, max_new_tokens=new, temperature=0)
        assert result.tokens == plain, f"{name} differs from plain greedy"
        accepted[name] += result.stats.accepted
    assert accepted["default"] > 0, "the default never had a draft token accepted: the test would prove little"


# ------------------------------------------------------------------------------ llama.cpp

GGUF_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def gguf_head(gguf_models, tmp_path_factory):
    """The demo draft in float32 on llama.cpp as the target, and an untrained head predicting the 16
    tokens it samples most after the chi-square prompt and every token of its greedy test outputs."""
    target = specdec.load_model(gguf_models["gguf-f32"], threads=1)
    plain, prompt = SpeculativeDecoder(target), target.tokenizer.encode("def f(x):")
    sampled = Counter(t for seed in range(100) for t in plain.generate(prompt, max_new_tokens=3, temperature=1.0, seed=50_000 + seed).tokens)
    greedy = {t for text in GGUF_PROMPTS for t in plain.generate(text, max_new_tokens=32, temperature=0).tokens}
    keep = sorted({int(t) for t, _ in sampled.most_common(16)} | greedy)
    directory = tmp_path_factory.mktemp("head-gguf")
    return target, head_for(target, keep, directory), directory, keep


def test_greedy_speculation_with_a_head_equals_plain_greedy_llamacpp(gguf_head, gguf_models):
    target, _, directory, _ = gguf_head
    plain = SpeculativeDecoder(target)
    accepted = Counter()
    for gamma, tree_nodes in ((3, None), (3, 6), ("auto", None)):
        decoder = specdec.load(gguf_models["gguf-f32"], draft=str(directory), gamma=gamma, tree=tree_nodes, threads=1)
        assert isinstance(decoder.draft_model.inner, HeadModel)
        for prompt in GGUF_PROMPTS:
            result = decoder.generate(prompt, max_new_tokens=32, temperature=0)
            assert result.tokens == plain.generate(prompt, max_new_tokens=32, temperature=0).tokens, (gamma, tree_nodes, prompt)
            accepted[gamma, tree_nodes] += result.stats.accepted
    assert all(accepted.values()), accepted


@pytest.mark.statistical
@pytest.mark.parametrize("kind,setting", [("chain", SETTINGS[1]), ("tree", SETTINGS[0])], ids=["chain-t0.7-topk5", "tree-t1"])
def test_sampled_speculation_with_a_head_keeps_the_target_distribution_llamacpp(gguf_head, kind, setting):
    """Each kind at the setting transformers' test does not take it at (20 s a case on 2 cores)."""
    target, draft, _, keep = gguf_head
    drafter = ModelDrafter(draft) if kind == "chain" else ModelDrafter(draft, tree=TreeShape(nodes=6, width=2))
    decoder = SpeculativeDecoder(target, drafter, gamma=2)
    prompt = target.tokenizer.encode("def f(x):")
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(SAMPLES):
        result = decoder.generate(prompt, max_new_tokens=3, seed=seed + zlib.crc32(f"{kind}/{setting}".encode()), **setting)
        counts[tuple(result.tokens)] += 1
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0.02 < accepted / drafted < 0.95 and accepted > 50, "both acceptances and rejections must happen"
    joint = pruned_joint(target, prompt, SamplingParams(**setting), SAMPLES)
    if sum(p for seq, p in joint.items() if seq[0] not in keep) > 0.03:  # at T 0.7 top-5 the first token is always kept
        assert sum(n for seq, n in counts.items() if seq[0] not in keep) > 20, "tokens the head cannot propose must still be emitted"
    assert chi_square(counts, joint, SAMPLES) > ALPHA


# ------------------------------------------------------------------------------ refusals


def test_a_head_is_refused_beside_another_hidden_size_or_tokenizer(hf_head, gguf_models, model_dirs, tmp_path):
    target, _, directory = hf_head
    wider = specdec.load_model(gguf_models["gguf-f32"], threads=1)
    with pytest.raises(specdec.SpecDecError, match=r"reads states 32 wide; the target's are \d+"):
        load_draft(directory, wider)
    with pytest.raises(specdec.SpecDecError, match=r"reads states 32 wide"):
        specdec.load(gguf_models["gguf-f32"], draft=str(directory), gamma=3, threads=1)
    # a 32-wide target whose tokenizer gives the same strings other ids
    other = save_tiny_model(tmp_path / "other", "llama", seed=0)
    swapped = {text: (i + 1) % len(VOCAB) for text, i in VOCAB.items()}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=swapped, merges=[], unk_token=None))).save_pretrained(other)
    with pytest.raises(specdec.SpecDecError, match="distilled for another tokenizer"):
        load_draft(directory, specdec.load_model(str(other), device="cpu", dtype="float64"))


# ------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def trained(gguf_models, tmp_path_factory):
    """A head trained from the demo target (GGUF, f16), then resumed with more steps."""
    out = tmp_path_factory.mktemp("trained-head")
    config = DistillConfig(target=gguf_models["gguf-f16"], output=str(out), head=True, steps=20, **TINY_HEAD)
    shape = lambda width: HeadShape(width=width, blocks=1, inner=64, vocab=600)
    first = distill_head(config, shape(specdec.load_model(gguf_models["gguf-f16"], threads=1).hidden_size))
    generated = sorted((out / "work").glob("generations-*.npz"))
    stamps = [f.stat().st_mtime_ns for f in generated]
    config.steps = 40
    summary = distill_head(config, shape(first["shape"]["width"]))  # the same command with more steps: resumes
    assert [f.stat().st_mtime_ns for f in generated] == stamps, "a resumed run must not generate again"
    return out, first, summary


def test_training_a_head_from_a_gguf_target_resumes_and_writes_a_usable_head(trained, gguf_models):
    out, first, summary = trained
    assert first["steps"] == 20 and summary["steps"] == 40
    assert [h["step"] for h in summary["history"]] == [10, 20, 30, 40] and summary["history"][:2] == first["history"]
    assert len(summary["heldout_agreement_by_depth"]) == 3 and all(0 <= a <= 1 for a in summary["heldout_agreement_by_depth"])
    assert summary["history"][-1]["train_loss"] < summary["history"][0]["train_loss"]
    assert set(summary["stages"]) >= {"corpus", "generate", "train head"}
    saved = json.loads((out / "head.json").read_text())
    assert (out / "head.safetensors").is_file() and saved["training"]["heldout_agreement_by_depth"] == summary["heldout_agreement_by_depth"]
    assert saved["shape"] == {"width": summary["shape"]["width"], "blocks": 1, "inner": 64, "vocab": 600}
    plain = specdec.load(gguf_models["gguf-f16"], plain=True, threads=1)
    for gamma in (3, "auto"):
        decoder = specdec.load(gguf_models["gguf-f16"], draft=str(out), gamma=gamma, threads=1)
        assert isinstance(decoder.draft_model.inner, HeadModel)
        for prompt in ("def fibonacci(n):", "import os\n"):
            assert decoder.generate(prompt, max_new_tokens=24, temperature=0).tokens == plain.generate(prompt, max_new_tokens=24, temperature=0).tokens


def test_generations_without_states_are_refused(trained, gguf_models, tmp_path):
    out, _, _ = trained
    shutil.copytree(out / "work", tmp_path / "work", ignore=shutil.ignore_patterns("*checkpoint*"))
    for file in (tmp_path / "work").glob("generations-*.npz"):
        with np.load(file) as saved:
            arrays = {key: saved[key] for key in saved.files if key != "states"}
        np.savez(file, **arrays)
    config = DistillConfig(target=gguf_models["gguf-f16"], output=str(tmp_path), head=True, steps=20, **TINY_HEAD)
    with pytest.raises(specdec.SpecDecError, match="before specdec recorded the target's hidden states"):
        distill_head(config)


def test_training_a_head_from_a_checkpoint_target(model_dirs, tmp_path):
    corpus, out = tmp_path / "text.txt", tmp_path / "h"
    corpus.write_text("abc def ghi jkl m " * 240)
    summary = distill_head(DistillConfig(target=model_dirs["llama-eos"], output=str(out), files=[str(corpus)], corpus_tokens=5000, prompts=24,
                                         short_prompts=8, prompt_tokens=8, new_tokens=8, draft_vocab=10, steps=20, head=True, **TINY_DRAFT))
    # the default shape: inner as wide as the target's states
    assert summary["shape"] == {"width": 32, "blocks": 2, "inner": 32, "vocab": 10} and len(summary["heldout_agreement_by_depth"]) == 3
    decoder = specdec.load(model_dirs["llama-eos"], draft=str(out), gamma=3, dtype="float64")
    assert isinstance(decoder.draft_model.inner, HeadModel)
    plain = specdec.load(model_dirs["llama-eos"], plain=True, dtype="float64")
    for prompt in ([1, 2, 3], [4, 5, 6, 7]):
        assert decoder.generate(prompt, max_new_tokens=12, temperature=0).tokens == plain.generate(prompt, max_new_tokens=12, temperature=0).tokens


def run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec", *argv], capture_output=True, text=True, timeout=timeout)


def test_the_cli_trains_a_head_that_generate_takes(gguf_models, tmp_path):
    out = str(tmp_path / "h")
    done = run("train", "--distill-from", gguf_models["gguf-f16"], "-o", out, "--small-head", "--corpus-tokens", "20000", "--prompts", "16",
               "--short-prompts", "4", "--prompt-tokens", "16", "--new-tokens", "8", "--draft-vocab", "300", "--steps", "5",
               "--batch-size", "16", "--eval-every", "5", "--holdout", "0.2", "--threads", "1")
    assert done.returncode == 0, done.stderr
    assert "a draft head of" in done.stderr and "held-out agreement" in done.stderr
    assert Path(out, "head.safetensors").is_file() and not Path(out, "draft.gguf").exists()
    done = run("generate", "def fibonacci(n):", "--target", gguf_models["gguf-f16"], "--draft", out, "--max-new-tokens", "16",
               "--temperature", "0", "--threads", "1")
    assert done.returncode == 0 and done.stdout.strip(), done.stderr


def test_the_cli_refuses_a_head_without_a_target(tmp_path):
    (tmp_path / "text.txt").write_text("abc def ghi jkl m " * 200)  # files to train on: the refusal is the missing target's
    for flag in ("--head", "--small-head"):
        done = run("train", flag, "-o", str(tmp_path / "h"), str(tmp_path), "--steps", "1", timeout=120)
        assert done.returncode == 1 and "--distill-from" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "h").exists(), "nothing is trained"


def test_a_prompt_taken_whole_from_the_prefix_cache_still_tells_the_head_the_targets_state(hf_head):
    target, draft, _ = hf_head
    engine = Engine(target, ModelDrafter(draft), prefixes=PrefixCache(target, 4096, min_shared=4))
    for attempt in range(2):  # the second opens on the first's kept cache, which holds the whole prompt but its last token
        state = DecodeState(list(PREFIX), SamplingParams(0.0), 4, FixedGamma(2), RandomStreams(0))
        engine.open(state)
        observed = head_of(state.draft_slot)._observed.get(len(PREFIX) - 2)
        assert observed is not None, f"generation {attempt}: no state reported after the prompt"
        torch.testing.assert_close(observed, final_norm_output(target, PREFIX[:-1]).float(), rtol=0, atol=1e-6)
        while state.finish_reason is None:
            engine.step([state])
        engine.close(state)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_heads_norm_in_half_precision_squares_in_float32(dtype):
    """The heads' norm (a small head's and an EAGLE-3 head's) beside a float16 or bfloat16 target: within that
    dtype's rounding of the norm computed in float64, for states past 256, whose squares overflow float16
    (squared in float16 the norm returned zeros there)."""
    from specdec.runtime.head import RMSNorm

    norm = RMSNorm(64).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    states = torch.randn(8, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 400
    want = norm(states)
    got = norm.to(dtype)(states.to(dtype))
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2 * torch.finfo(dtype).eps, atol=0)


def test_the_head_computes_on_its_targets_device(hf_head, monkeypatch):
    """Beside a target on a GPU the head computes there, the target's states moved to it as reported and its
    logits brought back to the host. Checked on the "meta" device, which holds no data and mixes with no
    other device: a state or a zero state left on the CPU fails the forward (a CPU index of a device tensor is legal).
    A prefill, a tree, a kept path and a step after it, as a generation runs them."""
    from specdec.runtime import base

    target, draft, _ = hf_head
    inner = draft.inner
    net = HeadNet(inner.net.shape, inner.net.inputs, inner.net.outputs)
    head_model = HeadModel(net, draft.vocab_map, target, device=torch.device("meta"))
    assert (head_model.device, head_model.on_gpu) == ("meta", False)
    returned = []

    def to_host(logits):
        returned.append(logits.device.type)
        return torch.zeros(logits.shape)
    monkeypatch.setattr(base, "to_host", to_host)
    head = head_model.sequence()
    start = len(PREFIX)
    head.forward(PREFIX, last=1)
    head.observe(start - 1, torch.zeros(1, target.hidden_size, dtype=torch.float64))  # from the host
    head.forward(TREE_TOKENS, tree.entries(TREE_PARENTS, start - 1))
    head.keep(start, [start, start + 1])
    head.observe(start - 1, torch.zeros(3, target.hidden_size, device="meta"))  # a verify's, on the device
    assert head.forward([3], last=1).shape == (1, head_model.vocab_size)
    assert returned == ["meta"] * 3
