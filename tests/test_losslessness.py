"""`specdec verify`: the losslessness check passes lossless decoders and fails a broken one.

Tiny saved llama checkpoints (vocabulary 16) through the real loader, float64 on the CPU. Seeds
are fixed, so every test is deterministic. The check itself promises that a lossless decoder fails
with probability <= alpha (1e-3 here) over the seeds; the broken-verifier tests were run at several
seeds and fail by a wide margin (chi-square p ~ 1e-15 against a per-test level of 5e-4).
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, hypergeom

import specdec
import specdec.cli
from specdec import engine, losslessness
from specdec.losslessness import (
    check_lossless,
    chi_square_homogeneity,
    format_report,
    pooled_table,
    tv_permutation_test,
)
from specdec.sampling import probs_from_logits
from specdec.types import VerifyResult

SAMPLES = 400
REPEATING = [1, 2, 3, 1, 2, 3, 1, 2]  # prompt lookup has drafts to offer
PROMPTS = [REPEATING, [5, 9, 4, 12]]
EXACT = ["--device", "cpu", "--dtype", "float64"]


@pytest.fixture(scope="module")
def target(load64, model_dirs):
    return load64(model_dirs["llama"])


@pytest.fixture(scope="module")
def near(load64, model_dirs):
    return specdec.ModelDrafter(load64(model_dirs["llama-near"]))


@pytest.fixture(scope="module")
def unrelated(load64, model_dirs):
    return specdec.ModelDrafter(load64(model_dirs["llama-draft"]))


def accept_everything(draft, logits, sampling, streams, noise=None):
    """A lossy verifier: keeps every draft token, then a bonus token."""
    if sampling.greedy:
        return VerifyResult(len(draft), draft.tokens.tolist() + [int(logits[-1].argmax())])
    target_probs = probs_from_logits(logits, sampling)
    bonus = int(torch.multinomial(target_probs[-1], 1, generator=streams.recover))
    return VerifyResult(len(draft), draft.tokens.tolist() + [bonus])


# ---- the library check on real decoders -----------------------------------------------------------


@pytest.mark.parametrize("sampling, prompts", [
    (dict(temperature=1.0), PROMPTS),
    (dict(temperature=0.8, top_p=0.9), PROMPTS[:1]),
])
def test_passes_with_a_draft_model(target, near, sampling, prompts):
    decoder = specdec.SpeculativeDecoder(target, near, gamma=3)
    report = check_lossless(decoder, prompts, samples=SAMPLES, length=2, seed=11, alpha=1e-3, progress=False, **sampling)
    assert report.passed, format_report(report)
    assert 0 < report.accepted < report.drafted, "acceptances and rejections must both be exercised"
    assert report.level == pytest.approx(1e-3 / (6 * len(prompts)))  # chi-square and TV: the pair, token 1, token 2
    for check in report.checks:
        assert sum(check.plain.values()) == sum(check.speculative.values()) == SAMPLES
        assert check.cells >= 2 and 0 <= check.tv <= check.tv_threshold
        assert check.p_value > report.level and check.tv_p_value > report.level
        assert [p["position"] for p in check.positions] == [1, 2]
        assert all(p["p_value"] > report.level and p["tv_p_value"] > report.level for p in check.positions)
    assert "PASS" in format_report(report)


def test_passes_with_prompt_lookup(target):
    decoder = specdec.SpeculativeDecoder(target, specdec.PromptLookupDrafter(), gamma=3)
    report = check_lossless(decoder, [REPEATING], samples=SAMPLES, length=2, seed=3, progress=False)
    assert report.passed, format_report(report)
    assert 0 < report.accepted < report.drafted


def test_greedy_compares_continuations_exactly(target, near):
    for drafter in (near, specdec.PromptLookupDrafter()):
        decoder = specdec.SpeculativeDecoder(target, drafter, gamma=3)
        report = check_lossless(decoder, PROMPTS, samples=SAMPLES, length=12, temperature=0, progress=False)
        assert report.passed, format_report(report)
        assert report.level is None and report.drafted > 0
        for check in report.checks:
            assert check.p_value is None and check.plain == check.speculative
            assert list(check.plain.values()) == [1] and len(next(iter(check.plain))) == 12


@pytest.mark.parametrize("seed", [0, 7_000])
def test_fails_when_the_verifier_accepts_everything(target, unrelated, monkeypatch, seed):
    """The check has power: a lossy verifier is caught, by both tests."""
    monkeypatch.setattr(engine, "_verify", accept_everything)
    decoder = specdec.SpeculativeDecoder(target, unrelated, gamma=3)
    report = check_lossless(decoder, [REPEATING], samples=300, length=2, seed=seed, progress=False)
    assert not report.passed
    (check,) = report.checks
    assert check.p_value < report.level and check.tv > check.tv_threshold
    assert "FAIL" in format_report(report)


def test_a_fault_deep_in_the_draft_is_caught_at_the_default_length(target, near, monkeypatch):
    """A verifier whose only fault is the bonus token after a fully accepted 4-token draft (the
    target's argmax instead of a draw): invisible to 2-token continuations, caught at the default
    length (γ + 1) by the test on token 5's marginal."""
    exact_verify = engine._verify

    def greedy_bonus(draft, logits, sampling, streams, noise=None):
        result = exact_verify(draft, logits, sampling, streams, noise)
        if len(draft) == 4 and result.accepted == 4:
            result.tokens[-1] = int(logits[-1].argmax())
        return result

    monkeypatch.setattr(engine, "_verify", greedy_bonus)
    decoder = specdec.SpeculativeDecoder(target, near, gamma=4)
    short = check_lossless(decoder, [REPEATING], samples=SAMPLES, length=2, seed=4, progress=False)
    assert short.passed and short.warnings  # blind there, and it says so
    report = check_lossless(decoder, [REPEATING], samples=SAMPLES, seed=4, progress=False)
    assert report.length == 5 and not report.passed, format_report(report)
    (check,) = report.checks
    assert [p["position"] for p in check.positions if min(p["p_value"], p["tv_p_value"]) <= report.level] == [5]
    assert "at token 5" in format_report(report)


def test_greedy_fails_when_the_verifier_accepts_everything(target, unrelated, monkeypatch):
    monkeypatch.setattr(engine, "_verify", accept_everything)
    decoder = specdec.SpeculativeDecoder(target, unrelated, gamma=3)
    report = check_lossless(decoder, PROMPTS, samples=1, length=8, temperature=0, progress=False)
    assert not report.passed
    assert "greedy continuations differ at token" in format_report(report)


def test_seeds_are_reproducible_and_distinct(target, near):
    decoder = specdec.SpeculativeDecoder(target, near, gamma=2)

    def run(seed):
        report = check_lossless(decoder, PROMPTS[:1], samples=25, length=3, seed=seed, progress=False)
        return report.checks[0]

    first, again, other = run(5), run(5), run(6)
    assert (first.plain, first.speculative, first.tv_p_value) == (again.plain, again.speculative, again.tv_p_value)
    assert first.plain != first.speculative  # independent seeds for the two decoders
    assert (first.plain, first.speculative) != (other.plain, other.speculative)


def test_reports_a_drafter_that_was_never_exercised(target):
    decoder = specdec.SpeculativeDecoder(target, specdec.PromptLookupDrafter(), gamma=3)
    report = check_lossless(decoder, [[5, 9, 4, 12]], samples=20, length=1, progress=False)
    assert report.drafted == 0 and report.acceptance_rate is None
    assert any("not exercised" in w for w in report.checks[0].warnings)
    assert "the drafter proposed nothing" in format_report(report)


@pytest.mark.parametrize("options, message", [
    (dict(samples=0), "samples must be a positive integer"),
    (dict(length=0), "length must be a positive integer"),
    (dict(alpha=0.0), "alpha must be in"),
    (dict(alpha=1.0), "alpha must be in"),
    (dict(seed=-1), "seed must be"),
    (dict(top_p=0.0), "top_p"),
    (dict(prompts="hi"), "list of at least one prompt"),
    (dict(prompts=[1, 2]), "list of at least one prompt"),
    (dict(prompts=[]), "list of at least one prompt"),
])
def test_rejects_bad_settings(target, near, options, message):
    decoder = specdec.SpeculativeDecoder(target, near)
    options = {"prompts": PROMPTS, **options}
    with pytest.raises(specdec.SpecDecError, match=message):
        check_lossless(decoder, progress=False, **options)


def test_needs_a_drafter(target):
    with pytest.raises(specdec.SpecDecError, match="no drafter"):
        check_lossless(specdec.SpeculativeDecoder(target), PROMPTS, samples=5, progress=False)


# ---- the statistics, on hand-made counts ----------------------------------------------------------


def test_pooling_keeps_cells_with_combined_count_ten():
    plain = Counter({(1,): 30, (2,): 8, (3,): 2, (4,): 1})
    speculative = Counter({(1,): 25, (2,): 3, (3,): 1})
    table, pooled = pooled_table(plain, speculative)
    # (3,) and (4,) pool to 4 < 10 samples, so they join the smallest kept cell (2,)
    assert table.tolist() == [[30, 11], [25, 4]] and pooled == 4
    table, pooled = pooled_table(plain + Counter({(5,): 6}), speculative)
    assert table.tolist() == [[30, 8, 9], [25, 3, 1]] and pooled == 10  # "other" reaches 10: its own cell


def test_a_single_cell_passes():
    same = Counter({(4, 2): 50})
    table, _ = pooled_table(same, same)
    assert table.shape == (2, 1)
    assert chi_square_homogeneity(table) == (0.0, 1.0)
    tv, threshold, pvalue, _ = tv_permutation_test(same, same, level=1e-3, rng=np.random.default_rng(0))
    assert tv == 0.0 and pvalue == 1.0 and threshold == 0.0
    rare = Counter({(i,): 1 for i in range(8)})  # every continuation seen once: pooled into one cell
    assert pooled_table(rare, Counter({(i,): 1 for i in range(8, 16)}))[0].shape == (2, 1)


def test_chi_square_matches_scipy():
    rng = np.random.default_rng(1)
    for cells in (2, 3, 9):
        table = rng.integers(5, 60, size=(2, cells))
        statistic, pvalue = chi_square_homogeneity(table)
        expected = chi2_contingency(table, correction=False)
        assert statistic == pytest.approx(expected.statistic, rel=1e-12)
        assert pvalue == pytest.approx(expected.pvalue, rel=1e-9)


def test_tv_permutation_p_value_matches_the_exact_hypergeometric():
    plain, speculative = Counter({"x": 14, "y": 6}), Counter({"x": 7, "y": 13})
    tv, threshold, pvalue, permutations = tv_permutation_test(plain, speculative, level=1e-3, rng=np.random.default_rng(2))
    assert tv == pytest.approx(0.35)
    # a_x ~ Hypergeom(40 samples, 21 of them x, 20 drawn); S = 2|2 a_x - 21| >= 14  <=>  |2 a_x - 21| >= 7
    null = hypergeom(40, 21, 20)
    exact = null.cdf(7) + null.sf(13)
    assert permutations == 20_000
    assert pvalue == pytest.approx(exact, abs=4 * (exact / permutations) ** 0.5 + 1e-4)
    assert threshold > tv  # p ~ 0.01 is above the level: TV under the threshold


def test_tv_permutation_handles_continuations_seen_once():
    """Continuations seen once are drawn as one colour; compare with plain label permutations."""
    rng = np.random.default_rng(3)
    plain = Counter(rng.choice(6, 60, p=[0.3, 0.2, 0.1, 0.1, 0.1, 0.2]).tolist()) + Counter({100 + i: 1 for i in range(20)})
    speculative = Counter(rng.choice(6, 60, p=[0.1, 0.1, 0.2, 0.2, 0.2, 0.2]).tolist()) + Counter({200 + i: 1 for i in range(20)})
    n = 80
    tv, _, pvalue, _ = tv_permutation_test(plain, speculative, level=5e-4, rng=rng)
    labels = np.array(list((plain + speculative).elements()))
    observed = 0.5 * sum(abs(plain[k] - speculative[k]) for k in set(labels.tolist())) / n
    assert tv == pytest.approx(observed)
    null = []
    for _ in range(4000):
        half = rng.permutation(labels)
        a, b = Counter(half[:n].tolist()), Counter(half[n:].tolist())
        null.append(0.5 * sum(abs(a[k] - b[k]) for k in set(labels.tolist())) / n)
    reference = (1 + sum(t >= observed - 1e-12 for t in null)) / (len(null) + 1)
    assert pvalue == pytest.approx(reference, abs=0.03)


def test_tv_threshold_agrees_with_the_p_value():
    rng = np.random.default_rng(4)
    for shift in (0.0, 0.05, 0.1, 0.2):
        plain = Counter(rng.choice(5, 300, p=[0.2] * 5).tolist())
        speculative = Counter(rng.choice(5, 300, p=[0.2 + shift, 0.2 - shift, 0.2, 0.2, 0.2]).tolist())
        level = 1e-3
        tv, threshold, pvalue, _ = tv_permutation_test(plain, speculative, level, rng)
        assert (pvalue <= level) == (tv > threshold)


def test_default_length_covers_the_whole_draft_depth(target, near, load64, model_dirs):
    """Finding: the default length of 2 verified only the first draft position of every sample."""
    chain = specdec.SpeculativeDecoder(target, near, gamma=4)
    tree = specdec.SpeculativeDecoder(target, specdec.ModelDrafter(load64(model_dirs["llama-near"]), tree=specdec.TreeShape(6)), gamma=3)
    for decoder, depth in ((chain, 4), (tree, 3)):
        report = check_lossless(decoder, PROMPTS[:1], samples=30, seed=2, progress=False)
        assert report.length == depth + 1 and report.warnings == []
        (check,) = report.checks
        assert all(len(continuation) == depth + 1 for continuation in check.speculative)
    report = check_lossless(chain, PROMPTS[:1], samples=30, length=2, seed=2, progress=False)
    assert report.warnings == ["only draft positions 1-1 of 4 were verified: a 2-token continuation never reaches "
                               "the deeper ones; use length 5 (the default) to exercise the whole draft"]
    assert "WARNING: only draft positions 1-1 of 4" in format_report(report)


# ---- the `specdec verify` command --------------------------------------------------------------


build_parser = specdec.cli.build_parser


@pytest.fixture
def cli(capsys):
    def run(*argv) -> tuple[int, str, str]:
        code = specdec.cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_cli_prints_pass(cli, model_dirs):
    code, out, err = cli("verify", "--target", model_dirs["llama"], "--draft", model_dirs["llama-near"], "--prompt", "hi ej",
                         "--samples", 150, "--seed", 1, *EXACT)
    assert code == 0, err
    assert "'hi ej': chi-square p" in out and "acceptance" in out
    assert out.strip().splitlines()[-1].startswith("PASS: ")
    assert "fails this check with probability <= 0.001" in out


def test_cli_json(cli, model_dirs):
    code, out, err = cli("verify", "--target", model_dirs["llama"], "--prompt-lookup", "--gamma", 4, "--prompt", "abcabcab", "--prompt", "hi ej",
                         "--samples", 100, "--top-k", 6, "--alpha", 0.01, "--json", *EXACT)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["passed"] is True and report["drafter"] == "prompt-lookup" and report["top_k"] == 6
    assert report["level_per_test"] == pytest.approx(0.01 / (12 * 2))  # 2 tests on the whole and on each of 5 tokens, 2 prompts
    assert [p["prompt"] for p in report["prompts"]] == ["abcabcab", "hi ej"]
    first = report["prompts"][0]
    assert sum(c["plain"] for c in first["continuations"]) == sum(c["speculative"] for c in first["continuations"]) == 100
    assert {"p_value", "tv", "tv_threshold", "acceptance_rate", "warnings"} <= set(first)
    assert report["length"] == 5 and report["warnings"] == []  # the default: gamma 4 + 1


def test_cli_fails_with_exit_1_on_a_broken_verifier(cli, model_dirs, monkeypatch):
    monkeypatch.setattr(engine, "_verify", accept_everything)
    code, out, err = cli("verify", "--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"], "--prompt", "abcabcab",
                         "--samples", 250, *EXACT)
    assert code == 1
    assert "FAIL" in out and "most frequent continuations" in out
    assert err.strip().splitlines()[-1].startswith("specdec: error: losslessness check failed")


@pytest.mark.parametrize("argv, message", [
    (["--samples", "0"], "samples must be a positive integer"),
    (["--length", "0"], "length must be a positive integer"),
    (["--alpha", "2"], "alpha must be in"),
    (["--temperature", "-1"], "temperature must be"),
])
def test_cli_rejects_bad_settings_before_loading(cli, argv, message):
    args = build_parser().parse_args(["verify", "--target", "/nonexistent", *argv])
    with pytest.raises(specdec.SpecDecError, match=message):
        args.run(args)
    code, _, err = cli("verify", "--target", "/nonexistent", *argv)
    assert code == 1 and err.startswith("specdec: error: ") and message.split()[0] in err


def test_cli_argument_errors(cli, model_dirs, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["verify", "--gamma", "0"])
    assert info.value.code == 2
    capsys.readouterr()
    code, _, err = cli("verify", "--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"], "--prompt-lookup", "--gamma", "3")
    assert code == 1 and "choose at most one drafter" in err
    code, _, err = cli("verify", "--target", model_dirs["llama"], "--plain", "--prompt", "hi", *EXACT)
    assert code == 1 and "nothing to verify" in err


def test_continuations_that_end_early_count_as_ended_at_later_positions():
    """Marginals of continuations of unequal length (EOS, the context's end): an ended slot is -1."""
    rng = np.random.default_rng(0)
    plain = Counter({(1, 2, 3): 40, (1,): 30, (4, 2): 30})
    check = losslessness.PromptCheck(prompt=[1], prompt_tokens=1, plain=plain, speculative=Counter(plain), texts={},
                                     drafted=1, accepted=1, passed=False)
    losslessness._compare(check, 0.01, rng)
    assert check.passed and [p["position"] for p in check.positions] == [1, 2, 3]
    assert losslessness._marginal(plain, 2) == Counter({3: 40, -1: 60})
