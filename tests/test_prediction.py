"""Predicted outputs: the cursor follows the output through the predicted text, the default drafter
proposes what follows, and the output is the target's whatever the prediction says: exact
enumeration, chi-square, greedy equality on both backends, the server's field and usage, the CLI."""

from __future__ import annotations

import json
import zlib

import httpx
import pytest

import specdec
from specdec.drafters.prediction import realign
from specdec.errors import SpecDecError
from specdec.params import SamplingParams
from test_verify_exact import enumerator  # noqa: F401 (a fixture)

# ---------------------------------------------------------------- the cursor


def test_the_cursor_follows_the_output_and_is_found_again_forward():
    predicted = "alpha = 1\nbeta = 2\nbeta = 2\ngamma = 3\n"
    assert realign(predicted, 0, "alpha = 1\n", 0) == 10  # followed
    # an inserted line, then a copied one: the next copy of "beta = 2", not the one already passed
    inserted = "alpha = 1\nbeta = 2\nomega = 9\nbeta = 2\n"
    assert realign(predicted, 19, inserted, 19) == predicted.index("gamma")
    # a changed value: lost, then found again once the output copies enough of what follows
    changed = "alpha = 1\nbeta = 5\n"
    assert realign(predicted, 10, changed, 10) is None
    assert realign(predicted, 10, changed + "beta = 2\ngam", len(changed)) == predicted.index("ma = 3")
    # a deleted line: the output goes on past it
    assert realign(predicted, 10, "alpha = 1\ngamma = 3", 10) == len(predicted) - 1
    assert realign(predicted, 10, "alpha = 1\nsomething else entirely", 10) is None


class TablePrediction:
    """A prediction whose proposal is fixed: what the drafter would get from a `Prediction`."""

    kind = "prediction"

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def proposal(self, context, max_tokens: int) -> list[int]:
        return self.tokens[:max_tokens]

    def end(self, context) -> None:
        pass


@pytest.mark.parametrize("predicted", [[0, 1, 2], [2, 2, 2], [1]], ids=["likely", "unlikely", "short"])
def test_an_iteration_with_a_prediction_keeps_the_target_distribution(enumerator, predicted):
    """Every draw of the drafter and the verifier enumerated, the prediction's chain beside lookup
    and the draft model (probes due, so both chains are drafted): the target's joint to 1e-9."""
    from test_policy import DRAFTER_PROMPT, Conditional, TableLM, draft_table, proposal_deviation, trained_policy
    from specdec.drafters import AutoDrafter, ModelDrafter, PromptLookupDrafter
    from specdec.drafters.base import DraftRequest

    draft = draft_table()

    def propose():
        drafter = AutoDrafter(ModelDrafter(TableLM(draft, DRAFTER_PROMPT)), PromptLookupDrafter())
        slot = drafter.open(DRAFTER_PROMPT)
        request = DraftRequest(slot, list(DRAFTER_PROMPT), 3, SamplingParams(temperature=1.0), None, trained_policy(3, probing=True),
                               (TablePrediction(predicted),))
        return drafter.propose([request])[0]

    assert proposal_deviation(enumerator, propose, Conditional(3, seed=41), 3) < 1e-9


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def target64(model_dirs):
    return specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")


@pytest.mark.statistical
def test_sampled_output_with_a_prediction_follows_the_target(target64, model_dirs):
    """Chi-square on the first 3 tokens, as for every drafter (test_statistical), with a prediction
    that is the target's likeliest text: accepted often, rejected often."""
    from test_statistical import ALPHA, PROMPT, SAMPLES, chi_square_pvalue, exact_joint
    from collections import Counter

    draft = specdec.ModelDrafter(specdec.load_model(model_dirs["qwen2-draft"], device="cpu", dtype="float64"))
    decoder = specdec.SpeculativeDecoder(target64, specdec.AutoDrafter(draft, specdec.PromptLookupDrafter()))
    greedy = decoder.generate(PROMPT, max_new_tokens=8, temperature=0).tokens
    prediction = target64.tokenizer.decode(greedy)
    counts, stats = Counter(), {"tried": 0, "accepted": 0}
    seed = zlib.crc32(b"prediction")
    for i in range(SAMPLES):
        result = decoder.generate(PROMPT, max_new_tokens=3, temperature=1.0, seed=seed + i, prediction=prediction)
        counts[tuple(result.tokens)] += 1
        tried, accepted = result.stats.source_trials.get("prediction", (0, 0))
        stats["tried"] += tried
        stats["accepted"] += accepted
    assert 0 < stats["accepted"] < stats["tried"], stats
    assert chi_square_pvalue(counts, exact_joint(target64, SamplingParams(temperature=1.0)), SAMPLES) > ALPHA


PREDICTIONS = {
    "the output itself": lambda text: text,
    "edited": lambda text: text[: len(text) // 3] + "zz" + text[len(text) // 3 : 2 * len(text) // 3] + text[5 * len(text) // 6 :],
    "unrelated": lambda text: "mmm nnn " * 10,
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "neox", "mistral"])
def test_greedy_output_with_any_prediction_is_the_reference(arch, model_dirs, load64):
    """Against a no-cache float64 greedy reference: a right, an edited and an unrelated prediction."""
    from conftest import reference_greedy

    target = load64(model_dirs[arch])
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    want = reference_greedy(target, prompt, 40)
    decoder = specdec.SpeculativeDecoder(target, specdec.AutoDrafter(specdec.ModelDrafter(load64(model_dirs[f"{arch}-near"])),
                                                                     specdec.PromptLookupDrafter()))
    text = target.tokenizer.decode(want)
    for name, make in PREDICTIONS.items():
        result = decoder.generate(prompt, max_new_tokens=40, temperature=0, prediction=make(text))
        assert result.tokens == want, name
        if name == "the output itself":
            assert result.stats.source_trials["prediction"][1] >= 20 and result.prediction_usage() == (len(want), 0)


def test_greedy_output_with_a_prediction_on_llama_cpp(gguf_models):
    target = specdec.load(gguf_models["gguf-f16"], draft=gguf_models["gguf-draft-f16"], threads=1)
    prompt = "def add(a, b):\n"
    want = specdec.SpeculativeDecoder(target.target).generate(prompt, max_new_tokens=60, temperature=0)
    for name, make in PREDICTIONS.items():
        result = target.generate(prompt, max_new_tokens=60, temperature=0, prediction=make(want.text))
        assert result.tokens == want.tokens, name
    exact = target.generate(prompt, max_new_tokens=60, temperature=0, prediction=want.text)
    assert exact.stats.target_forwards <= 10, "a right prediction is verified in long chains"


def test_a_prediction_needs_the_default_drafter(model_dirs):
    fixed = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], gamma=2, device="cpu")
    with pytest.raises(SpecDecError, match="default"):
        fixed.generate("ab", max_new_tokens=2, prediction="abc")
    with pytest.raises(SpecDecError, match="text"):
        specdec.load(model_dirs["llama"], device="cpu").generate("ab", max_new_tokens=2, prediction=[1, 2])


# ---------------------------------------------------------------- server and CLI


def test_the_server_takes_a_prediction_and_reports_its_tokens(model_dirs):
    from test_server import MODEL, LiveServer, sse_events
    from specdec.server import create_app

    decoder = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], device="cpu")
    offline = specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], device="cpu")
    want = offline.generate("ab cd", max_new_tokens=20, temperature=0)
    live = LiveServer(create_app(decoder, MODEL))
    body = {"model": MODEL, "prompt": "ab cd", "max_tokens": 20, "temperature": 0,
            "prediction": {"type": "content", "content": [{"type": "text", "text": want.text}]}}
    predicted_tokens = len(decoder.tokenizer.encode(want.text, add_special_tokens=False))  # this tokenizer spells <|endoftext|> out
    try:
        reply = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == want.text
        details = reply["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == predicted_tokens
        assert details["accepted_prediction_tokens"] >= 15  # of 20 completion tokens, some spelling <|endoftext|>
        with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
            events = sse_events(response)
        assert events[-2]["usage"]["completion_tokens_details"] == details
        wrong = httpx.post(live.url + "/v1/completions", json={**body, "prediction": {"type": "image", "content": "x"}}, timeout=30)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"].startswith("prediction")
        chat = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 5, "prediction": {"type": "content", "content": "ab"}})
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]  # this tiny model has none
    finally:
        live.stop()
    fixed = LiveServer(create_app(specdec.load(model_dirs["llama"], draft=model_dirs["llama-near"], gamma=2, device="cpu"), MODEL))
    try:
        refused = httpx.post(fixed.url + "/v1/completions", json=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prediction"
        assert "default (auto) drafter" in refused.json()["error"]["message"]
        empty = httpx.post(fixed.url + "/v1/completions", json={**body, "prediction": {"type": "content", "content": ""}}, timeout=30)
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "prediction"  # an empty one too
    finally:
        fixed.stop()


def test_cli_prediction_file(model_dirs, tmp_path, capsys):
    from specdec.cli import main

    want = specdec.load(model_dirs["llama"], device="cpu").generate("ab cd", max_new_tokens=12, temperature=0)
    predicted = tmp_path / "expected.txt"
    predicted.write_text(want.text)
    assert main(["generate", "ab cd", "--target", model_dirs["llama"], "--device", "cpu", "--max-new-tokens", "12",
                 "--temperature", "0", "--prediction", str(predicted), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spelled = len(specdec.load(model_dirs["llama"], device="cpu", plain=True).tokenizer.encode(want.text, add_special_tokens=False))
    assert out["text"] == want.text and sum(out["prediction_tokens"].values()) == spelled and out["prediction_tokens"]["accepted"] >= 8
    assert main(["generate", "ab", "--target", model_dirs["llama"], "--prediction", str(tmp_path / "missing.txt")]) == 1
    assert "cannot read the prediction file" in capsys.readouterr().err
