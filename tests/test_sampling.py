"""The sampling transform, the random streams, prompt lookup and the γ policies."""

from __future__ import annotations

from itertools import accumulate

import torch

from specdec.drafters.prompt_lookup import Ngrams, lookup_continuation, lookup_match
from specdec.sampling import RandomStreams, argmax, probs_from_logits, sample
from specdec.params import SamplingParams

LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64))


def test_temperature_one_is_softmax():
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs, torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64))


def test_temperature_sharpens_and_flattens():
    cold = probs_from_logits(LOGITS, SamplingParams(temperature=0.5))
    hot = probs_from_logits(LOGITS, SamplingParams(temperature=2.0))
    assert cold.max() > 0.4 > hot.max()
    torch.testing.assert_close(cold, torch.softmax(LOGITS / 0.5, -1))


def test_top_k_keeps_the_k_largest():
    probs = probs_from_logits(LOGITS, SamplingParams(top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], dtype=torch.float64))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # sorted: 0.4, 0.3, 0.15, 0.1, 0.05; 0.4 + 0.3 = 0.7 < 0.75, so 0.15 joins
    probs = probs_from_logits(LOGITS, SamplingParams(top_p=0.75))
    torch.testing.assert_close(probs, torch.tensor([0, 0.4, 0, 0.3, 0.15], dtype=torch.float64) / 0.85)
    only_top = probs_from_logits(LOGITS, SamplingParams(top_p=0.01))
    assert only_top.tolist() == [0, 1, 0, 0, 0]


def test_top_k_and_top_p_together_apply_to_rows_independently():
    batch = torch.stack([LOGITS, LOGITS.flip(0)])
    probs = probs_from_logits(batch, SamplingParams(top_k=3, top_p=0.6))
    assert probs[0].nonzero().flatten().tolist() == [1, 3]
    assert probs[1].nonzero().flatten().tolist() == [1, 3]
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, dtype=torch.float64))


def test_streams_are_reproducible_and_independent():
    a, b = RandomStreams(7), RandomStreams(7)
    probs = torch.full((50,), 0.02)
    draws = lambda s: [sample(probs, s.draft) for _ in range(20)]
    assert draws(a) == draws(b)
    assert draws(RandomStreams(8)) != draws(RandomStreams(7))
    c = RandomStreams(7)
    assert [sample(probs, c.accept) for _ in range(20)] != [sample(probs, c.recover) for _ in range(20)]


def test_prompt_lookup_prefers_the_longest_latest_match():
    context = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [5, 2, 3] never occurred; [2, 3] last occurred at index 5, followed by 7, 8, 5
    assert lookup_continuation(context, 3) == [7, 8, 5]
    # 10 asked: the latest gives 5, the one at index 1 gives 9
    assert lookup_continuation(context, 10) == [9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup_continuation([4, 5, 6], 3) == []
    assert lookup_continuation([4], 3) == []


def test_prompt_lookup_takes_an_earlier_match_when_the_latest_is_cut_short():
    context = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 1, 2]
    assert lookup_continuation(context, 4) == [3, 4, 1, 2]  # the latest match gives all 4
    assert lookup_continuation(context, 6) == [3, 4, 5, 9, 1, 2]  # it gives 4 of 6: the earlier one gives 6
    assert lookup_continuation([7] * 8, 4) == [7] * 4  # the latest match of [7, 7, 7] is followed by one 7 only
    assert lookup_continuation([7] * 4, 3) == [7]  # the longest any match gives


# ---- extremes: temperatures and top-p values that under- or overflow act as their limits ----------

from hypothesis import given, settings
from hypothesis import strategies as st

MAGNITUDES = st.sampled_from([5e-324, 1e-310, 1e-300, 1e-45, 1e-38, 1e-20, 1e-7, 1e-3, 0.5, 1.0, 7.0, 1e5, 1e20, 1e38, 1e39, 1e300, 1e308])


@st.composite
def logit_rows(draw):
    vocab = draw(st.integers(2, 12))
    values = draw(st.lists(st.sampled_from([-30.0, -2.5, -1.0, 0.0, 0.25, 1.0, 3.0, 12.0]), min_size=vocab, max_size=vocab))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return torch.tensor(values, dtype=dtype)


@settings(max_examples=400, deadline=None)
@given(logits=logit_rows(), temperature=MAGNITUDES, top_k=st.integers(0, 14),
       top_p=st.one_of(MAGNITUDES.filter(lambda v: v <= 1), st.floats(1e-6, 1.0)))
def test_probabilities_are_finite_normalised_and_in_the_allowed_support(logits, temperature, top_k, top_p):
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(float(probs.sum()) - 1) < 1e-5
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < len(logits):  # top-k keeps the tokens at least as large as the k-th largest
        allowed &= logits >= torch.topk(logits, top_k).values[-1]
    assert not (probs[~allowed] > 0).any()
    best = logits == logits.max()
    if temperature < 1e6:  # (far above, every scaled gap rounds to 0: all tie, and which one top-p keeps is arbitrary)
        assert (probs[best] > 0).any(), "a most likely token always keeps mass"
    if temperature < 1e-30:  # the greedy limit: uniform over the tied most likely tokens (top-p may keep one)
        assert not (probs[~best] > 0).any()
        kept = probs[probs > 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / len(kept)))
    if temperature > 1e30 and top_p == 1:  # the uniform limit over the allowed set
        torch.testing.assert_close(probs[allowed], torch.full_like(probs[allowed], 1 / int(allowed.sum())))
    if top_p < 1e-30:  # the top-1 limit: one token, a most likely one
        assert int((probs > 0).sum()) == 1
        assert temperature >= 1e6 or bool(best[probs.argmax()])


def test_vanishing_temperature_and_top_p_decode_like_greedy():
    """Finding: a temperature of 1e-300 underflowed in float32, every probability became NaN and the
    sampler returned the last vocabulary id forever. Its limit is greedy decoding."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    for params in (SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-45), SamplingParams(top_p=5e-324)):
        probs = probs_from_logits(logits, params)
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]], params


def slow_lookup(context, max_tokens, max_ngram=3, min_ngram=1):
    """The reference: every earlier position compared in Python, latest first."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix, best = list(context[length - n :]), []
        for start in range(length - n - 1, -1, -1):
            if list(context[start : start + n]) == suffix:
                follow = list(context[start + n : start + n + max_tokens])
                best = follow if len(follow) > len(best) else best
                if len(best) >= max_tokens:
                    break
        if best:
            return best
    return []


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=40) | st.lists(st.integers(0, 2**24), max_size=40), st.integers(1, 12))
def test_lookup_searches_in_c_as_the_slow_reference_does(context, max_tokens):
    """Ids packed 4 bytes each: a match of bytes that straddles two ids is skipped, never proposed."""
    assert lookup_continuation(context, max_tokens) == slow_lookup(context, max_tokens)
    straddling = [256, 0, 5, 1]  # packed: 00 01 00 00 | 00 00 00 00 | ...: the bytes of id 1 (01 00 00 00) at offset 1
    assert lookup_continuation(straddling, 2) == [] == slow_lookup(straddling, 2)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40) | st.lists(st.integers(0, 2**24), max_size=40), st.integers(1, 6),
       st.lists(st.integers(1, 5), max_size=8))
def test_a_match_that_runs_n_tokens_back_needs_the_last_n_tokens_earlier(context, n, steps):
    """`Ngrams.repeats` is the slow check (the last n tokens somewhere before, ending before the last
    token) at every length the text grows through, however far each step grows it, and a looked-up
    match whose text runs n or more tokens back is found only where it says so: the default skips the
    search when only a copy could pay and nothing repeats."""
    ngrams = Ngrams(n)
    for length in [min(grown, len(context)) for grown in accumulate(steps)] + [len(context)]:
        text = context[:length]
        slow = len(text) > n and any(text[start : start + n] == text[-n:] for start in range(len(text) - n))
        assert ngrams.repeats(text) == slow
        if lookup_match(text, 8)[1] >= n:
            assert slow


@given(st.lists(st.lists(st.sampled_from([0.0, 1.0, 2.0, -1.5, float("inf"), float("-inf"), float("nan")]),
                         min_size=3, max_size=3), min_size=1, max_size=6),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.booleans())
def test_argmax_is_torchs_ties_nans_and_views_included(rows, dtype, transposed):
    """`sampling.argmax` (numpy's on the host, for speed) picks what torch's argmax does: the first of equal
    largest values, a NaN before any number, on a row, rows, and a strided view of them."""
    values = torch.tensor(rows, dtype=dtype)
    values = values.t() if transposed else values  # a view whose rows are strided
    assert argmax(values) == values.argmax(dim=-1).tolist()
    assert argmax(values[0]) == values[0].argmax(dim=-1).tolist()
