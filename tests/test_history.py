"""History across requests (suffix decoding): the store keeps, bounds and isolates earlier
requests' texts; a view proposes what followed the context there (followed without a search while
the output copies it, as a fresh search would); the output is the target's whatever the history
holds: exact enumeration, chi-square, greedy equality on both backends; the server isolates
tenants unless told to share."""

from __future__ import annotations

import zlib
from collections import Counter

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec
from specdec.drafters.history import HISTORY_NGRAMS, History
from specdec.drafters.prompt_lookup import SEPARATOR
from specdec.errors import SpecDecError
from specdec.params import SamplingParams
from test_verify_exact import enumerator  # noqa: F401 (a fixture)

# ---------------------------------------------------------------- the store


def slow_continuations(documents: list[list[int]], context: list[int], max_tokens: int) -> list[list[int]]:
    """The reference: every non-empty continuation (up to max_tokens, within one document) of the
    context's last n tokens, n the shortest of HISTORY_NGRAMS (a longer match is one of these too)."""
    n = HISTORY_NGRAMS[-1]
    if n > len(context):
        return []
    found = [doc[i + n : i + n + max_tokens] for doc in documents for i in range(len(doc) - n + 1) if doc[i : i + n] == context[-n:]]
    return [f for f in found if f]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=30), max_size=5), st.lists(st.integers(0, 3), max_size=20),
       st.lists(st.integers(0, 3), max_size=20), st.integers(1, 8))
def test_a_view_proposes_a_continuation_found_in_the_history(documents, context, generated, max_tokens):
    """Every proposal, fresh or followed while the context grows, is what followed the context's
    end in one earlier document, never across its end; none only when nothing did."""
    history = History()
    for doc in documents:
        history.record(None, doc)
    view = history.view()
    for step in range(len(generated) + 1):
        context_now = context + generated[:step]
        proposal = view.proposal(context_now, max_tokens)
        candidates = slow_continuations(documents, context_now, max_tokens)
        assert bool(proposal) == bool(candidates)
        if proposal:
            assert any(c[: len(proposal)] == proposal for c in candidates), (proposal, candidates)
            assert SEPARATOR not in proposal


def test_copying_output_is_followed_without_a_search(monkeypatch):
    import specdec.drafters.history as history_module

    earlier = list(range(10, 60))
    history = History()
    history.record(None, earlier)
    view = history.view()
    context = [1, 2] + earlier[:5]
    assert view.proposal(context, 8) == earlier[5:13]
    searched = []
    monkeypatch.setattr(history_module, "continuation_in", lambda *a, **k: searched.append(1) or (-1, []))
    for accepted in (3, 8, 1):  # the output copies on: followed from where it was
        context += earlier[len(context) - 2 : len(context) - 2 + accepted]
        assert view.proposal(context, 8) == earlier[len(context) - 2 : len(context) + 6]
    assert not searched
    assert view.proposal(context + [99], 8) == [] and searched  # the output left the copy: searched again


def test_the_budget_evicts_the_oldest_documents_and_tenants():
    history = History(tokens=25, tenants=2)
    for start in (100, 200, 300):
        history.record("a", list(range(start, start + 10)))
    assert history.size("a") == 20  # the first document went
    assert history.view("a").proposal([200, 201, 202], 3) == [203, 204, 205]
    assert history.view("a").proposal([100, 101, 102], 3) == []
    history.record("b", [1, 2, 3, 4])
    history.view("a")  # a was used more recently than b
    history.record("c", [5, 6, 7, 8])
    assert history.size("b") == 0 and history.size("a") == 20 and history.size("c") == 4
    history.record("a", list(range(1000, 1100)))  # longer than the budget: its end is kept
    assert history.size("a") == 25 and history.view("a").proposal([1075, 1076, 1077], 2) == [1078, 1079]


def test_tenants_draft_from_their_own_history_unless_it_is_shared():
    for shared in (False, True):
        history = History(shared=shared)
        history.record("alice", [1, 2, 3, 4, 5, 6])
        assert history.view("alice").proposal([9, 1, 2, 3], 3) == [4, 5, 6]
        assert history.view("bob").proposal([9, 1, 2, 3], 3) == ([4, 5, 6] if shared else [])


def test_a_generation_joins_its_tenants_history_when_it_ends(model_dirs):
    decoder = specdec.load(model_dirs["llama"], device="cpu")
    assert isinstance(decoder.history, History)
    first = decoder.generate("ab cd", max_new_tokens=12, temperature=0, tenant="t")
    assert decoder.history.size("t") == len(first.tokens) + len(decoder.prompt_ids("ab cd"))
    assert decoder.history.size(None) == 0
    with pytest.raises(SpecDecError, match="default"):
        specdec.SpeculativeDecoder(decoder.target, specdec.PromptLookupDrafter(), gamma=2, history=History())
    assert specdec.SpeculativeDecoder(decoder.target, specdec.PromptLookupDrafter(), gamma=2).history is None


# ---------------------------------------------------------------- losslessness


def history_with(tokens: list[int]) -> History:
    history = History()
    history.record(None, tokens)
    return history


@pytest.mark.parametrize("continuation", [[2, 0, 1], [1, 1, 1], [0]], ids=["likely", "unlikely", "short"])
def test_an_iteration_with_the_history_keeps_the_target_distribution(enumerator, continuation):
    """Every draw of the drafter and the verifier enumerated, the history's chain beside lookup,
    a prediction and the draft model (probes due, so every chain is drafted): the target's joint to 1e-9."""
    from test_policy import DRAFTER_PROMPT, Conditional, TableLM, draft_table, proposal_deviation, trained_policy
    from test_prediction import TablePrediction
    from specdec.drafters import AutoDrafter, ModelDrafter, PromptLookupDrafter
    from specdec.drafters.base import DraftRequest

    draft = draft_table()
    earlier = list(DRAFTER_PROMPT[-3:]) + continuation

    def propose():
        drafter = AutoDrafter(ModelDrafter(TableLM(draft, DRAFTER_PROMPT)), PromptLookupDrafter())
        slot = drafter.open(DRAFTER_PROMPT)
        policy = trained_policy(3, probing=True)
        assert policy.probe_tokens("history")
        view = history_with(earlier).view()
        assert view.proposal(list(DRAFTER_PROMPT), 3) == continuation[:3]
        request = DraftRequest(slot, list(DRAFTER_PROMPT), 3, SamplingParams(temperature=1.0), None, policy,
                               (TablePrediction([1, 2]), view))
        return drafter.propose([request])[0]

    assert proposal_deviation(enumerator, propose, Conditional(3, seed=41), 3) < 1e-9


@pytest.mark.statistical
def test_sampled_output_with_the_history_follows_the_target(model_dirs):
    """Chi-square on the first 3 tokens, as for every drafter (test_statistical): one decoder
    samples the same prompt again and again, so its history holds earlier samples, right or wrong."""
    from test_statistical import ALPHA, PROMPT, SAMPLES, chi_square_pvalue, exact_joint

    target = specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")
    decoder = specdec.SpeculativeDecoder(target, specdec.AutoDrafter(None, specdec.PromptLookupDrafter()))
    counts, tried, accepted = Counter(), 0, 0
    seed = zlib.crc32(b"history")
    for i in range(SAMPLES):
        result = decoder.generate(PROMPT, max_new_tokens=3, temperature=1.0, seed=seed + i)
        counts[tuple(result.tokens)] += 1
        trials = result.stats.source_trials.get("history", (0, 0))
        tried, accepted = tried + trials[0], accepted + trials[1]
    assert 0 < accepted < tried, (tried, accepted)
    assert chi_square_pvalue(counts, exact_joint(target, SamplingParams(temperature=1.0)), SAMPLES) > ALPHA


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "neox", "mistral"])
def test_greedy_output_with_any_history_is_the_reference(arch, model_dirs, load64):
    """Against a no-cache float64 greedy reference: a history holding the same text, an edited copy
    of it, and unrelated text; the one holding the text drafts it."""
    from conftest import reference_greedy

    target = load64(model_dirs[arch])
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    want = reference_greedy(target, prompt, 40)
    histories = {"the text": prompt + want, "edited": prompt + want[:10] + [7, 7] + want[14:], "unrelated": [5, 6, 7, 8] * 20}
    for name, earlier in histories.items():
        decoder = specdec.SpeculativeDecoder(target, specdec.AutoDrafter(specdec.ModelDrafter(load64(model_dirs[f"{arch}-near"])),
                                                                         specdec.PromptLookupDrafter()), history=history_with(earlier))
        result = decoder.generate(prompt, max_new_tokens=40, temperature=0)
        assert result.tokens == want, name
        if name == "the text":
            assert result.stats.source_trials["history"][1] >= 20


def test_greedy_output_with_the_history_on_llama_cpp(gguf_models):
    decoder = specdec.load(gguf_models["gguf-f16"], draft=gguf_models["gguf-draft-f16"], threads=1)
    plain = specdec.SpeculativeDecoder(decoder.target)
    prompts = ["def add(a, b):\n", "class Stack:\n"]
    for prompt in prompts + prompts:  # the second time round, each prompt's own earlier output is in the history
        result = decoder.generate(prompt, max_new_tokens=60, temperature=0)
        assert result.tokens == plain.generate(prompt, max_new_tokens=60, temperature=0).tokens, prompt
    assert result.stats.source_trials["history"][1] >= 30 and result.stats.target_forwards <= 12


# ---------------------------------------------------------------- the server


def history_drafted(live) -> float:
    """The server's count of history tokens that verification reached."""
    for line in httpx.get(live.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('specdec_draft_tokens_total{source="history"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("shared", [False, True], ids=["per tenant", "shared"])
def test_the_server_drafts_from_a_tenants_own_history(model_dirs, shared):
    from test_server import MODEL, LiveServer
    from specdec.server import create_app

    decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], device="cpu")
    decoder.history = History(shared=shared)
    live = LiveServer(create_app(decoder, MODEL))
    body = {"model": MODEL, "prompt": "ab cd ef", "max_tokens": 30, "temperature": 0}
    try:
        first = httpx.post(live.url + "/v1/completions", json={**body, "user": "alice"}, timeout=60).json()
        assert history_drafted(live) == 0
        other = httpx.post(live.url + "/v1/completions", json={**body, "user": "bob"}, timeout=60).json()
        assert other["choices"][0]["text"] == first["choices"][0]["text"]
        assert (history_drafted(live) > 0) == shared
        again = httpx.post(live.url + "/v1/completions", json={**body, "user": "alice"}, timeout=60).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"] and history_drafted(live) > 0
        wrong = httpx.post(live.url + "/v1/completions", json={**body, "user": 5}, timeout=30)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "user"
    finally:
        live.stop()


def test_serve_history_flags_are_checked(model_dirs, capsys):
    from specdec.cli import main

    assert main(["serve", "--target", model_dirs["llama"], "--device", "cpu", "--history-tokens", "-1"]) == 1
    assert "--history-tokens must be >= 0" in capsys.readouterr().err
    assert main(["serve", "--target", model_dirs["llama"], "--device", "cpu", "--gamma", "2", "--prompt-lookup", "--share-history"]) == 1
    assert "fixed strategy" in capsys.readouterr().err
