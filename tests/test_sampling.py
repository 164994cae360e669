"""The sampling transform, the random streams, prompt lookup and the γ policies."""

from __future__ import annotations

import torch

from specdec.drafters.prompt_lookup import lookup_continuation
from specdec.engine import AdaptiveGamma
from specdec.sampling import RandomStreams, probs_from_logits, sample
from specdec.types import SamplingParams

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
    assert lookup_continuation(context, 10) == [7, 8, 5, 2, 3]
    assert lookup_continuation([4, 5, 6], 3) == []
    assert lookup_continuation([4], 3) == []


def test_adaptive_gamma_grows_and_shrinks_within_bounds():
    policy = AdaptiveGamma(start=4, low=2, high=6)
    for _ in range(5):
        policy.update(drafted=policy.gamma, accepted=policy.gamma)
    assert policy.gamma == 6
    for _ in range(10):
        policy.update(drafted=policy.gamma, accepted=0)
    assert policy.gamma == 2
    policy.update(drafted=0, accepted=0)
    assert policy.gamma == 2
