"""End to end: the joint distribution of the first 3 generated tokens is the target's.

Tiny saved models (vocabulary 16), loaded through the real loader, generating through the public
API. The target's exact joint over 16^3 sequences is enumerated with no-cache forwards; samples
from speculative decoding are compared with it by a chi-square test (cells with expected count
< 5 pooled). Seeds are fixed, so each test is deterministic; were the implementation exact, a
test would fail with probability ALPHA = 1e-4 over the choice of seeds.
"""

from __future__ import annotations

import zlib
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

import specdec
import specdec.api
from specdec.katz import KatzTrigram
from specdec.sampling import probs_from_logits
from specdec.params import SamplingParams

ALPHA = 1e-4
SAMPLES = 4000
LENGTH = 3
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: prompt lookup has drafts to offer
SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7-topk5": dict(temperature=0.7, top_k=5),
    "topp0.8": dict(temperature=1.0, top_p=0.8),
}


def exact_joint(target: specdec.CausalLM, sampling: SamplingParams) -> dict[tuple, float]:
    """P(y1 y2 y3) under the target with the sampling transform, by full enumeration."""
    vocab = target.vocab_size
    joint = {(): 1.0}
    for _ in range(LENGTH):
        prefixes = list(joint)
        batch = torch.tensor([PROMPT + list(p) for p in prefixes])
        with torch.inference_mode():
            logits = target.model(batch).logits[:, -1, :vocab]
        probs = probs_from_logits(logits, sampling)
        joint = {p + (t,): joint[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in range(vocab)}
    return joint


def chi_square_pvalue(counts: Counter, joint: dict[tuple, float], samples: int) -> float:
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, prob in joint.items():
        if prob * samples >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(prob * samples)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += prob * samples
    impossible = sum(n for seq, n in counts.items() if joint.get(seq, 0.0) == 0)
    assert impossible == 0, f"{impossible} samples the target gives probability 0"
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)  # float rounding only; both sum to `samples`
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def sample_joint(decoder: specdec.SpeculativeDecoder, sampling: dict, base_seed: int, keyed: bool = True):
    """keyed False: the default drafter's seeded requests, which draw by position from point-mass
    drafts, instead draw from sequential streams and verify drawn drafts by rejection sampling (as
    its unseeded requests do)."""
    counts, drafted, accepted = Counter(), 0, 0
    for i in range(SAMPLES):
        generation = decoder.request(PROMPT, max_new_tokens=LENGTH, seed=base_seed + i, **sampling)
        result = decoder.run(generation if keyed else generation.drawn(base_seed + i))
        counts[tuple(result.tokens)] += 1
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    return counts, drafted, accepted


@pytest.fixture(scope="module")
def target(model_dirs):
    return specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def drafters(model_dirs):
    rng = torch.Generator().manual_seed(5)
    corpus = [torch.randint(0, 16, (200,), generator=rng).tolist() for _ in range(5)]
    ngram = KatzTrigram.build([PROMPT * 3] + corpus, vocab_size=16)
    draft_model = specdec.ModelDrafter(specdec.load_model(model_dirs["qwen2-draft"], device="cpu", dtype="float64"))
    return {
        "draft-model": draft_model,
        "ngram": specdec.NgramDrafter(ngram, stochastic=True),
        "prompt-lookup": specdec.PromptLookupDrafter(),
        "auto": specdec.AutoDrafter(draft_model, specdec.PromptLookupDrafter()),  # the default, its policy deciding
    }


# every setting for the drafters that draw from a distribution (the transform then shapes q as well as
# p); point-mass drafters, whose drafts the transform does not touch, at one setting each, every
# setting still met by three drafters (20-30 s a case on 2 cores)
FIRST_TOKEN_CASES = [(name, setting) for name in ("draft-model", "auto/drawn") for setting in SETTINGS] + [
    ("ngram", "t1"), ("prompt-lookup", "t0.7-topk5"), ("auto", "topp0.8")]


@pytest.mark.statistical
@pytest.mark.parametrize("drafter_name,setting", FIRST_TOKEN_CASES)
def test_first_tokens_follow_target_joint(target, drafters, drafter_name, setting):
    """auto: seeded, so keyed draws and point-mass drafts; auto/drawn: its drawn drafts and rejection sampling."""
    auto = drafter_name.startswith("auto")
    decoder = specdec.SpeculativeDecoder(target, drafters["auto" if auto else drafter_name], gamma="auto" if auto else 2)
    assert_follows_target(decoder, SETTINGS[setting], seed_key=f"{drafter_name}/{setting}", keyed=drafter_name != "auto/drawn")


def assert_follows_target(decoder: specdec.SpeculativeDecoder, sampling: dict, seed_key: str, keyed: bool = True) -> None:
    """SAMPLES generations of LENGTH tokens, seeded by seed_key, must follow the target's exact joint."""
    counts, drafted, accepted = sample_joint(decoder, sampling, base_seed=zlib.crc32(seed_key.encode()), keyed=keyed)
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    pvalue = chi_square_pvalue(counts, exact_joint(decoder.target, SamplingParams(**sampling)), SAMPLES)
    assert pvalue > ALPHA, f"p-value {pvalue:.3g}: speculative output does not follow the target"


@pytest.mark.statistical
def test_chi_square_catches_an_accept_everything_verifier(target, drafters, monkeypatch):
    """The test has power: a verifier that keeps every draft token is rejected."""
    from specdec import engine
    from specdec.types import VerifyResult

    def accept_all(draft, logits, sampling, streams, noise=None):
        target_probs = probs_from_logits(logits, sampling)
        bonus = int(torch.multinomial(target_probs[-1], 1, generator=streams.recover))
        return VerifyResult(len(draft), draft.tokens.tolist() + [bonus])

    monkeypatch.setattr(engine, "_verify", accept_all)
    decoder = specdec.SpeculativeDecoder(target, drafters["draft-model"], gamma=2)
    counts, _, _ = sample_joint(decoder, SETTINGS["t1"], base_seed=0)
    assert chi_square_pvalue(counts, exact_joint(target, SamplingParams(**SETTINGS["t1"])), SAMPLES) < ALPHA
