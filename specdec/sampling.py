"""Pure functions: logits -> sampling distribution, and draws from an explicit generator.

The same transform must be applied to the target's and the drafter's logits at every position
(docs/design.md, pitfall 2), so there is exactly one function that does it: `probs_from_logits`.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.params import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then min-p; returns float32 (or float64 for float64 input).

    logits: [..., vocab]. Not for greedy mode: temperature 0 is argmax, decided by the caller.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / _representable(params.temperature, dtype)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        probs = _nucleus(probs, params.top_p)
    if params.min_p > 0:  # the likeliest token always stays (its own ratio is 1)
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _representable(temperature: float, dtype: torch.dtype) -> float:
    """The temperature clamped into the dtype's normal range: a temperature that would underflow to 0
    (or overflow to inf) acts as its limit, never as 0/0 = NaN. Logit gaps are 0 or at least one
    rounding step, so below the smallest normal number every gap already sends exp to 0 (greedy:
    uniform over the tied best), and above the largest every scaled gap is 0 (uniform)."""
    info = torch.finfo(dtype)
    return min(max(temperature, info.tiny), info.max)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False  # the most likely token always stays, even when top_p underflows to 0
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs: [vocab] (need not be normalised, must have positive mass).

    Inverse CDF in float64: the first token whose cumulative mass exceeds u · total, so a token of
    probability 0 is never drawn. Ten times faster than torch.multinomial on an 8k vocabulary.
    """
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    token = int(torch.searchsorted(cdf, u, right=True)[0])
    if token >= len(cdf):  # u · total rounded up to the total: the last token with mass
        token = int(torch.nonzero(probs)[-1])
    return token


def uniform(generator: torch.Generator) -> float:
    """u ~ U[0, 1)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


class RandomStreams:
    """Independent, reproducible generators for the three kinds of randomness (docs/design.md, pitfall 6).

    draft: sampling draft tokens; accept: acceptance uniforms; recover: recovered and bonus tokens.
    Never the global RNG: the same seed gives the same output. keyed: instead, the output's i-th
    token is drawn with noise that depends on the seed and i alone, whatever was drawn before
    (`noise`, `draw`; see `verify.verify_tree_coupled`).
    """

    def __init__(self, seed: int | None, keyed: bool = False):
        root = np.random.SeedSequence(seed)
        draft, accept, recover = (int(s.generate_state(1, np.uint64)[0] >> 1) for s in root.spawn(3))
        self.seed = root.entropy
        self.keyed = keyed  # the output's tokens are drawn with `noise` (the accept and recover streams unused)
        self.draft = torch.Generator().manual_seed(draft)
        self.accept = torch.Generator().manual_seed(accept)
        self.recover = torch.Generator().manual_seed(recover)

    def noise(self, position: int, size: int) -> torch.Tensor:
        """E ~ Exp(1), [size] float64 (never 0), for the output's token at `position`: a function of
        the seed, the position and the size alone, however many draws came before it. A drafter
        ranks its proposals for that position with it, and the verifier draws the target's token
        with it (`draw`)."""
        key = int(np.random.SeedSequence([self.seed, position]).generate_state(1, np.uint64)[0] >> 1)
        noise = torch.empty(size, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(key))
        return noise.clamp_(min=torch.finfo(torch.float64).tiny)  # p / 0 would be nan (p = 0) or inf


class StepNoise:
    """A keyed generation's noise for one engine step: offset -> that of the output token `offset`
    places after those generated so far (0: the next one). What the drafter asks for is kept for the
    verifier, which then draws with the very noise the draft was ranked by; the verifier's own
    (each offset asked once, in order) is not kept. Lives one step: a few vectors of the vocabulary's size."""

    def __init__(self, streams: RandomStreams, start: int, size: int):
        self.streams, self.start, self.size = streams, start, size
        self._ranked: dict[int, torch.Tensor] = {}

    def __call__(self, offset: int) -> torch.Tensor:
        if offset not in self._ranked:
            self._ranked[offset] = self.streams.noise(self.start + offset, self.size)
        return self._ranked[offset]

    def for_verifier(self, offset: int) -> torch.Tensor:
        noise = self._ranked.pop(offset, None)
        return noise if noise is not None else self.streams.noise(self.start + offset, self.size)


def argmax(values: torch.Tensor) -> int | list[int]:
    """`values.argmax(dim=-1).tolist()`: each row's largest (the first among equals, a NaN before any number).
    On the host it is numpy's, which reads a float32 or float64 row about 12 times as fast as torch 2.x's CPU
    kernel (5 rows of Gemma 3's 262k logits: 62 against 745 µs, a verify's every greedy step)."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return values.detach().numpy().argmax(axis=-1).tolist()
    return values.argmax(dim=-1).tolist()


def draw(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """The token argmax(probs / noise), noise ~ Exp(1) i.i.d. (the Gumbel-max trick): a draw from
    probs ([vocab], need not be normalised), exact; with the same noise, two close distributions
    mostly draw the same token."""
    return argmax(_keys(probs, noise))


def ranked(probs: torch.Tensor, noise: torch.Tensor, count: int) -> list[int]:
    """The first `count` tokens by probs / noise (Gumbel-top-k: draws without replacement), those
    with probability 0 left out; the first is `draw(probs, noise)`."""
    keys = _keys(probs, noise)
    top = torch.topk(keys, min(count, len(keys)))
    return [int(t) for t, k in zip(top.indices, top.values) if k > 0]


def _keys(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs / noise over the tokens both cover (a draft's padded rows beyond the target's
    vocabulary are never drawn by it)."""
    size = min(len(probs), len(noise))
    return probs[:size].double() / noise[:size]
