"""The losslessness check behind `specdec verify`: check on your own models and settings that
speculative decoding is lossless.

For every prompt, `samples` continuations of `length` tokens are drawn with plain decoding (the
same target, no drafter) and `samples` with the speculative decoder; the two empirical
distributions of the whole continuation are compared by two exact-or-classical two-sample tests:

- **chi-square test of homogeneity** on the 2 x K table (plain / speculative x continuation).
  Continuations seen fewer than `MIN_CELL` = 10 times in both samples together are pooled into one
  "other" cell; if that cell still has fewer than 10, it is merged into the smallest kept cell.
  With equal sample sizes every cell then has an expected count >= 5 per row, the classical
  condition for the asymptotic chi-square law. One cell left (both samples all alike): p = 1.
- **total variation distance** TV = 1/2 sum_k |plain_k/n - speculative_k/n| between the two
  empirical distributions, no pooling, with a **permutation threshold**: under the null hypothesis
  (speculative == plain) the 2n continuations are exchangeable, so the plain half is a uniformly
  random n-subset of the pooled multiset, i.e. its counts are multivariate hypergeometric. We draw
  B such splits and use the Monte-Carlo p-value (1 + #{TV_b >= TV}) / (B + 1), which is exactly
  valid for any B; the reported threshold is the TV above which that p-value drops below the level.
  Unlike a fixed concentration bound this adapts to the support: with many rare continuations the
  empirical TV is large even under the null, and the threshold grows with it.

The same two tests also run on the marginal distribution of each position 1..length of the
continuation (a continuation that ended earlier, at EOS, counts as an "ended" symbol there): the
whole continuation has many rare values when it is long, a single position has at most a
vocabulary's, so a fault at any draft depth keeps its power to show. That is 2 * (1 + length) tests
per prompt (2 for length 1, where the position is the continuation), each at level
alpha / (tests * prompts) (Bonferroni), so a lossless decoder fails the whole check with
probability <= alpha (the chi-square part being asymptotic).
Greedy decoding (temperature 0) is deterministic: one plain and one speculative continuation per
prompt must be token-for-token equal; no statistics, no false failures.

Seeds: prompt j, sample i uses seed + 2*samples*j + i for plain decoding and
seed + 2*samples*j + samples + i for speculative decoding: all distinct, all reproducible (greedy:
samples = 1 for this purpose), each drawn as an unseeded request is (`Generation.drawn`): a seeded
request under the default drafter draws by position instead, exactly plain decoding's draws
(tested in the test suite). The permutation draws use numpy's generator seeded with [seed, j].
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from specdec.decoder import SpeculativeDecoder
from specdec.config import check_verify_settings
from specdec.errors import SpecDecError
from specdec.params import Limits, SamplingParams

MIN_CELL = 10  # pooled count below which a continuation joins the "other" cell
PERMUTATIONS_PER_REJECTION = 20  # B ~ 20 / level: the threshold is the ~20th largest of B null TVs
MAX_PERMUTATIONS = 200_000
DEFAULT_PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def push(self, item):"]

Continuation = tuple[int, ...]


@dataclass
class PromptCheck:
    """The comparison for one prompt. Statistics are None in greedy mode (exact comparison)."""

    prompt: str | list[int]
    prompt_tokens: int
    plain: Counter  # continuation (token ids) -> count
    speculative: Counter
    texts: dict  # continuation -> its text
    drafted: int  # draft tokens proposed over all speculative samples
    accepted: int
    passed: bool
    p_value: float | None = None  # chi-square, pooled cells
    chi_square: float | None = None
    cells: int | None = None  # after pooling
    pooled_fraction: float | None = None  # share of all samples in pooled cells
    tv: float | None = None
    tv_threshold: float | None = None  # None: too few permutations to reject at this level
    tv_p_value: float | None = None
    permutations: int | None = None
    positions: list[dict] = field(default_factory=list)  # the same tests on each position's marginal
    warnings: list[str] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def to_dict(self) -> dict:
        keys = sorted(set(self.plain) | set(self.speculative),
                      key=lambda k: (-(self.plain[k] + self.speculative[k]), k))
        return {
            "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens,
            "passed": self.passed,
            "p_value": self.p_value,
            "chi_square": self.chi_square,
            "cells": self.cells,
            "pooled_fraction": self.pooled_fraction,
            "tv": self.tv,
            "tv_threshold": self.tv_threshold,
            "tv_p_value": self.tv_p_value,
            "permutations": self.permutations,
            "positions": self.positions,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "warnings": self.warnings,
            "continuations": [
                {"tokens": list(k), "text": self.texts.get(k, ""), "plain": self.plain[k],
                 "speculative": self.speculative[k]}
                for k in keys
            ],
        }


@dataclass
class LosslessnessReport:
    checks: list[PromptCheck]
    samples: int
    length: int
    sampling: SamplingParams
    seed: int
    alpha: float
    level: float | None  # per test: alpha / (tests per prompt * prompts); None in greedy mode
    drafter: str
    gamma: int | str
    warnings: list[str] = field(default_factory=list)  # about the check as a whole

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def drafted(self) -> int:
        return sum(check.drafted for check in self.checks)

    @property
    def accepted(self) -> int:
        return sum(check.accepted for check in self.checks)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "alpha": self.alpha,
            "level_per_test": self.level,
            "samples": self.samples,
            "length": self.length,
            "temperature": self.sampling.temperature,
            "top_k": self.sampling.top_k,
            "top_p": self.sampling.top_p,
            "seed": self.seed,
            "drafter": self.drafter,
            "gamma": self.gamma,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "warnings": self.warnings,
            "prompts": [check.to_dict() for check in self.checks],
        }


def check_lossless(
    speculative: SpeculativeDecoder,
    prompts: Sequence[str | Sequence[int]],
    samples: int = 1000,
    length: int | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    alpha: float = 1e-3,
    progress: bool = True,
    **shorthand,
) -> LosslessnessReport:
    """Compare `speculative` with plain decoding of its own target (no second load); see the module doc.

    A lossless decoder fails with probability <= alpha; greedy (temperature 0) compares exactly.
    length: tokens per continuation; default the draft depth + 1, so that every draft position
    (and the bonus token after a fully accepted draft) is verified. A shorter one is reported.
    sampling: the setting checked (default temperature 1; shorthand: its fields as keywords); seed:
    the check's own, from which every sample's seed follows.
    """
    sampling = replace(sampling or SamplingParams(), **shorthand)
    if speculative.drafter is None:
        raise SpecDecError("nothing to verify: the decoder has no drafter, so it already decodes plainly")
    depth = draft_depth(speculative)
    length = depth + 1 if length is None else length
    check_verify_settings(samples, length, alpha, seed)
    if isinstance(prompts, str) or not len(prompts) or any(isinstance(p, int) for p in prompts):
        raise SpecDecError("prompts must be a list of at least one prompt (each a string or a list of token ids)")
    prompt_ids = [speculative.prompt_ids(prompt) for prompt in prompts]  # validates all before sampling
    plain = SpeculativeDecoder(speculative.target)
    runs = 1 if sampling.greedy else samples
    level = None if sampling.greedy else alpha / (tests_per_prompt(length) * len(prompts))
    checks = []
    with tqdm(total=2 * runs * len(prompts), desc="verify", unit="sample", disable=not progress, leave=False) as bar:
        for j, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
            base = seed + 2 * runs * j
            setting = (sampling, Limits(max_new_tokens=length))
            texts: dict[Continuation, str] = {}
            plain_counts, _ = _sample(plain, ids, runs, base, setting, texts, bar)
            spec_counts, (drafted, accepted) = _sample(speculative, ids, runs, base + runs, setting, texts, bar)
            check = PromptCheck(
                prompt=prompt if isinstance(prompt, str) else [int(i) for i in prompt], prompt_tokens=len(ids),
                plain=plain_counts, speculative=spec_counts, texts=texts, drafted=drafted, accepted=accepted,
                passed=True,
            )
            if sampling.greedy:
                check.passed = plain_counts == spec_counts
            else:
                _compare(check, level, np.random.default_rng([seed, j]))
            check.warnings += _exercise_warnings(drafted, accepted, length)
            checks.append(check)
    drafter = speculative.drafter.name
    report = LosslessnessReport(checks, samples, length, sampling, seed, alpha, level, drafter, speculative.gamma)
    if length < depth + 1:
        report.warnings.append(
            f"only draft positions 1-{length - 1} of {depth} were verified: a {length}-token continuation never "
            f"reaches the deeper ones; use length {depth + 1} (the default) to exercise the whole draft"
        )
    return report


TYPICAL_AUTO_DEPTH = 4


def draft_depth(decoder: SpeculativeDecoder) -> int:
    """How deep the decoder drafts: its γ (a tree's depth); for "auto", a typical depth of the policy's."""
    return decoder.gamma if isinstance(decoder.gamma, int) else TYPICAL_AUTO_DEPTH


def _sample(decoder, ids, runs, first_seed, setting, texts, bar) -> tuple[Counter, tuple[int, int]]:
    (sampling, limits), counts, drafted, accepted = setting, Counter(), 0, 0
    for i in range(runs):
        seeded = replace(sampling, seed=first_seed + i)
        # the path unseeded requests take
        result = decoder.run(decoder.request(ids, seeded, limits).drawn(first_seed + i))
        key = tuple(result.tokens)  # shorter than `length` only after EOS or at the context's end
        counts[key] += 1
        texts.setdefault(key, result.text)
        drafted += result.stats.drafted
        accepted += result.stats.accepted
        bar.update()
    return counts, (drafted, accepted)


def tests_per_prompt(length: int) -> int:
    """Chi-square and TV on the whole continuation, and on each position's marginal when length > 1."""
    return 2 * (1 + (length if length > 1 else 0))


def _compare(check: PromptCheck, level: float, rng: np.random.Generator) -> None:
    joint = compare_samples(check.plain, check.speculative, level, rng)
    for name, value in joint.items():
        setattr(check, name, value)
    length = max(map(len, check.plain | check.speculative))
    if length > 1:
        check.positions = [
            {"position": i + 1,
             **compare_samples(_marginal(check.plain, i), _marginal(check.speculative, i), level, rng)}
            for i in range(length)
        ]
    check.passed = all(p["p_value"] > level and p["tv_p_value"] > level for p in [joint, *check.positions])
    if check.pooled_fraction > 0.5:
        check.warnings.append(
            f"{check.pooled_fraction:.0%} of the samples are continuations seen fewer than {MIN_CELL} times: "
            "the whole-continuation tests have little power here (the per-position tests still do); "
            "more --samples or a --top-k sharpen both"
        )


def compare_samples(plain: Counter, speculative: Counter, level: float, rng: np.random.Generator) -> dict:
    """Both two-sample tests on one pair of empirical distributions."""
    table, pooled = pooled_table(plain, speculative)
    chi_square, p_value = chi_square_homogeneity(table)
    tv, tv_threshold, tv_p_value, permutations = tv_permutation_test(plain, speculative, level, rng)
    return {"p_value": p_value, "chi_square": chi_square, "cells": table.shape[1],
            "pooled_fraction": pooled / (2 * sum(plain.values())),
            "tv": tv, "tv_threshold": tv_threshold, "tv_p_value": tv_p_value, "permutations": permutations}


def _marginal(counts: Counter, position: int) -> Counter:
    """The token at `position` of each continuation; -1 where it had ended before (EOS)."""
    marginal = Counter()
    for continuation, count in counts.items():
        marginal[continuation[position] if position < len(continuation) else -1] += count
    return marginal


def _exercise_warnings(drafted: int, accepted: int, length: int) -> list[str]:
    if drafted == 0:
        why = " (one token is never drafted: use a length >= 2)" if length == 1 else ""
        return [f"the drafter proposed nothing for this prompt: the speculative path was not exercised{why}"]
    if accepted == drafted:
        return ["every draft token was accepted: the rejection path was not exercised"]
    if accepted == 0:
        return ["no draft token was accepted: the acceptance path was not exercised"]
    return []


def pooled_table(plain: Counter, speculative: Counter, min_cell: int = MIN_CELL) -> tuple[np.ndarray, int]:
    """[2, cells] counts (row 0 plain, row 1 speculative) and how many samples went into pooled cells.

    Cells with combined count < min_cell form one "other" cell; if it is itself below min_cell
    it joins the smallest kept cell, so every cell has a combined count >= min_cell (unless all
    samples are pooled, then there is a single cell).
    """
    keys = sorted(set(plain) | set(speculative), key=lambda k: (-(plain[k] + speculative[k]), k))
    kept = [[plain[k], speculative[k]] for k in keys if plain[k] + speculative[k] >= min_cell]
    rare = [k for k in keys if plain[k] + speculative[k] < min_cell]
    other = [sum(plain[k] for k in rare), sum(speculative[k] for k in rare)]
    if sum(other) and (sum(other) >= min_cell or not kept):
        kept.append(other)
    elif sum(other):
        smallest = kept[-1]  # keys are sorted by combined count, descending
        smallest[0] += other[0]
        smallest[1] += other[1]
    return np.array(kept, dtype=np.int64).T.reshape(2, -1), sum(other)


def chi_square_homogeneity(table: np.ndarray) -> tuple[float, float]:
    """Pearson's statistic and asymptotic p-value for a [2, cells] table with positive column sums.

    Equals scipy.stats.chi2_contingency(table, correction=False); scipy is only a test dependency.
    """
    if table.shape[1] < 2:
        return 0.0, 1.0  # one cell: both samples are all alike
    observed = table.astype(np.float64)
    expected = observed.sum(axis=1, keepdims=True) * observed.sum(axis=0, keepdims=True) / observed.sum()
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    # chi-square survival function: the regularised upper incomplete gamma Q(dof/2, x/2)
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                           torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, pvalue


def tv_permutation_test(
    plain: Counter, speculative: Counter, level: float, rng: np.random.Generator,
    max_permutations: int = MAX_PERMUTATIONS
) -> tuple[float, float | None, float, int]:
    """(TV, threshold, Monte-Carlo p-value, permutations) for two samples of equal size n.

    TV = S / 2n with the integer S = sum_k |2 a_k - N_k| (a_k plain count, N_k combined count).
    Under the null the plain counts are multivariate hypergeometric given N; p = (1 + #{S_b >= S}) / (B + 1)
    is exactly valid. p <= level  <=>  TV > threshold, the (k+1)-th largest null TV, k = floor(level (B+1)) - 1.
    Continuations seen once contribute 1 to S whichever side they fall on: they are drawn as one colour.
    """
    n = sum(plain.values())
    if sum(speculative.values()) != n or n == 0:
        raise ValueError("the permutation test needs two non-empty samples of equal size")
    keys = sorted(set(plain) | set(speculative))
    a = np.array([plain[k] for k in keys], dtype=np.int64)
    combined = a + np.array([speculative[k] for k in keys], dtype=np.int64)
    observed = int(np.abs(2 * a - combined).sum())
    varying = combined >= 2
    singles = int((~varying).sum())
    colors = combined[varying]
    permutations = min(max_permutations, math.ceil(PERMUTATIONS_PER_REJECTION / level))
    k = math.floor(level * (permutations + 1)) - 1
    if colors.size == 0:  # every continuation seen once: S = 2n whatever the split
        null = np.full(permutations, observed, dtype=np.int64)
    else:
        all_colors = np.append(colors, singles) if singles else colors
        null = np.empty(permutations, dtype=np.int64)
        chunk = max(1, 4_000_000 // all_colors.size)
        for start in range(0, permutations, chunk):
            rows = min(chunk, permutations - start)
            draws = rng.multivariate_hypergeometric(all_colors, n, size=rows, method="count")[:, : colors.size]
            null[start : start + rows] = np.abs(2 * draws - colors).sum(axis=1) + singles
    pvalue = (1 + int((null >= observed).sum())) / (permutations + 1)
    threshold = None if k < 0 else float(np.partition(null, permutations - k - 1)[permutations - k - 1]) / (2 * n)
    return observed / (2 * n), threshold, pvalue, permutations


# ---- the `specdec verify` command ---------------------------------------------------------------


def failure_summary(report: LosslessnessReport) -> str:
    """One line on why a report failed: how many prompts, and the first one's evidence."""
    failed = [c for c in report.checks if not c.passed]
    return (f"losslessness check failed: speculative decoding differs from plain decoding on {len(failed)} of "
            f"{len(report.checks)} prompts ({_short(failed[0].prompt)}: {_evidence(failed[0], report.level)})")


def format_report(report: LosslessnessReport) -> str:
    s = report.sampling
    mode = "greedy" if s.greedy else f"temperature {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g}"
    runs = "1 continuation" if s.greedy else f"{report.samples} samples"
    lines = [
        f"verify: drafter {report.drafter} (gamma {report.gamma}) vs plain decoding · {mode} · "
        f"{len(report.checks)} prompts × {runs} × {report.length} tokens · seed {report.seed}"
    ]
    for check in report.checks:
        rate = check.acceptance_rate
        acceptance = f"acceptance {rate:.1%} of {check.drafted} drafted" if rate is not None else "nothing drafted"
        lines.append(f"  {'ok  ' if check.passed else 'FAIL'} {_short(check.prompt)}: "
                     f"{_evidence(check, report.level)} · {acceptance}")
        lines += [f"       note: {w}" for w in check.warnings]
        if not check.passed and not s.greedy:
            lines.append("       most frequent continuations (plain / speculative):")
            keys = sorted(set(check.plain) | set(check.speculative),
                          key=lambda k: -(check.plain[k] + check.speculative[k]))
            lines += [f"         {check.texts.get(k, '')!r:24} {check.plain[k]:6} / {check.speculative[k]}"
                      for k in keys[:5]]
    rate = report.acceptance_rate
    lines.append(f"overall acceptance {rate:.1%} ({report.accepted} of {report.drafted} draft tokens)"
                 if rate is not None else "overall: the drafter proposed nothing")
    if s.greedy:
        odds = "greedy continuations compared token for token (no false failures)"
    else:
        odds = (f"a lossless decoder fails this check with probability <= {report.alpha:g} "
                f"(each of {tests_per_prompt(report.length) * len(report.checks)} tests at level {report.level:.3g})")
    lines += [f"WARNING: {w}" for w in report.warnings]
    verdict = "PASS: no difference between speculative and plain decoding detected" if report.passed else \
        "FAIL: speculative decoding differs from plain decoding"
    lines.append(f"{verdict}; {odds}")
    return "\n".join(lines)


def _evidence(check: PromptCheck, level: float | None) -> str:
    if check.p_value is None:  # greedy
        if check.passed:
            return "greedy continuations equal"
        (plain,), (spec,) = check.plain, check.speculative
        first = next((i for i, (x, y) in enumerate(zip(plain, spec)) if x != y), min(len(plain), len(spec)))
        return (f"greedy continuations differ at token {first}: plain {check.texts[plain]!r}, "
                f"speculative {check.texts[spec]!r}")
    threshold = "n/a" if check.tv_threshold is None else f"{check.tv_threshold:.3f}"
    chi = f"chi-square p {check.p_value:.3g} ({check.cells} cells)"
    tv = f"TV {check.tv:.3f} (null threshold {threshold}, p {check.tv_p_value:.3g})"
    if check.p_value <= level:
        chi += f" <= {level:.3g}"
    if check.tv_p_value <= level:
        tv += f" <= {level:.3g}"
    evidence = f"{chi} · {tv}"
    if check.positions:
        worst = min(check.positions, key=lambda p: min(p["p_value"], p["tv_p_value"]))
        lowest = min(worst["p_value"], worst["tv_p_value"])
        evidence += (f" · by position: lowest p {lowest:.3g} at token {worst['position']}"
                     + (f" <= {level:.3g}" if lowest <= level else ""))
    return evidence


def _short(prompt, width: int = 32) -> str:
    text = repr(prompt) if isinstance(prompt, str) else str(prompt)
    return text if len(text) <= width else text[: width - 1] + "…"
