"""The Python API: streaming deltas, stop strings, results."""

from __future__ import annotations

import pytest

import specdec


@pytest.fixture(scope="module")
def decoder(model_dirs):
    return specdec.load(model_dirs["llama"], draft=model_dirs["llama-draft"], gamma=3, device="cpu")


def test_stream_deltas_add_up_to_the_result(decoder):
    stream = decoder.stream("abcab", max_new_tokens=30, temperature=0.8, seed=3)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text
    assert len(stream.result.tokens) == stream.result.stats.generated_tokens == 30
    assert stream.result.text == decoder.tokenizer.decode(stream.result.tokens)
    assert decoder.generate("abcab", max_new_tokens=30, temperature=0.8, seed=3).tokens == stream.result.tokens


def test_stop_string_ends_the_text_before_it(decoder):
    full = decoder.generate("abcab", max_new_tokens=40, temperature=0).text
    stop = full[12:14]
    cut = full.index(stop)
    stream = decoder.stream("abcab", max_new_tokens=40, temperature=0, stop=[stop, "zz-never"])
    deltas = list(stream)
    result = stream.result
    assert (result.text, result.finish_reason) == (full[:cut], "stop")
    assert "".join(deltas) == full[:cut]
    assert decoder.tokenizer.decode(result.tokens)[: len(result.text)] == result.text
    assert len(decoder.tokenizer.decode(result.tokens)) >= cut


def test_max_new_tokens_zero_generates_nothing(decoder):
    result = decoder.generate("abc", max_new_tokens=0)
    assert (result.text, result.tokens, result.finish_reason) == ("", [], "length")


def test_generation_stops_at_the_context_limit(decoder):
    prompt = "abcdefghij" * 6  # 60 of the tiny models' 64 positions
    result = decoder.generate(prompt, max_new_tokens=50, temperature=0)
    assert len(result.tokens) == 4 and result.finish_reason == "length"


def test_stats_are_consistent(decoder):
    stats = decoder.generate("abcab", max_new_tokens=25, temperature=1.0, seed=1).stats
    assert stats.generated_tokens == 25
    assert stats.iterations == stats.target_forwards
    assert stats.generated_tokens == stats.accepted + stats.iterations
    assert sum(stats.accepted_lengths) == stats.accepted
    assert stats.drafted == sum(stats.drafted_by_position) == sum(stats.gammas)  # a draft model always drafts γ
    made_before_last = sum(a + 1 for a in stats.accepted_lengths[:-1])
    assert stats.gammas[-1] == min(3, 25 - made_before_last - 1), "γ never asks for more than the room left"
    assert stats.draft_forwards >= stats.drafted
    d = stats.to_dict()
    assert d["acceptance_rate"] == stats.accepted / stats.drafted
    assert d["tokens_per_target_forward"] == 25 / stats.target_forwards


def test_a_stop_string_inside_a_token_leaves_that_token_out():
    """Finding: `tokens` covered more text than `text` when a stop string began inside a token.
    The rule: `text` is exactly the text before the stop; `tokens` decode to a prefix of it."""
    from specdec.demo import demo_dir

    decoder = specdec.SpeculativeDecoder(specdec.load_model(demo_dir() / "target", device="cpu"))
    full = decoder.generate("def fibonacci(n):", max_new_tokens=40, temperature=0)
    pieces = [decoder.tokenizer.decode(full.tokens[: i + 1]) for i in range(len(full.tokens))]
    # a multi-character token i whose second character starts a stop string not seen earlier
    i = next(i for i in range(1, len(pieces) - 1)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and full.text.find(full.text[len(pieces[i - 1]) + 1 : len(pieces[i]) + 3]) == len(pieces[i - 1]) + 1)
    cut = len(pieces[i - 1]) + 1
    stop = full.text[cut : len(pieces[i]) + 3]
    result = decoder.generate("def fibonacci(n):", max_new_tokens=40, temperature=0, stop=[stop])
    assert (result.text, result.finish_reason) == (full.text[:cut], "stop")
    assert result.tokens == full.tokens[:i], "the token holding the stop's start is not part of the result"
    assert result.text.startswith(decoder.tokenizer.decode(result.tokens)) and stop not in decoder.tokenizer.decode(result.tokens)
    assert result.stats.generated_tokens == len(result.tokens)
