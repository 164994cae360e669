"""Penalties and biases: the target's logits at a position changed by the tokens before it.

Each is a deterministic function of the text before the position (`SamplingParams`: presence,
frequency and repetition penalties, a logit bias), so speculation verifies against it exactly when
every row of a draft is changed by the tokens on that row's own path: the committed text, then the
draft tokens from the root down to the row's node (`Penalties.shape`). The draft model's q is left as
it is (it is what the draft was drawn from; the verifier needs only that). As the constraint's
`Matcher`, a `RowShaper` the engine applies before verification and advances with each step's tokens.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specdec.params import SamplingParams


class RowShaper(Protocol):
    """What changes the target's rows before verification, knowing each row's path: a constraint's
    `Matcher` (what the grammar allows) and `Penalties`. Both follow the committed text."""

    def shape(self, logits: torch.Tensor, tokens: Sequence[int] = (), parents: Sequence[int] = ()) -> torch.Tensor:
        """Rows [root, node 0, node 1, ...] of a step's logits, changed on their own paths; a new tensor."""
        ...

    def advance(self, tokens: Sequence[int]) -> None:
        """The step committed these tokens."""
        ...


class Penalties:
    """One generation's penalties: counts of the output's tokens (presence, frequency) and of the
    prompt's and output's (repetition), kept as the text grows."""

    def __init__(self, sampling: SamplingParams, prompt: Sequence[int], vocab_size: int):
        self.sampling, self.vocab_size = sampling, vocab_size
        self.output = torch.zeros(vocab_size, dtype=torch.float64)  # occurrences in the output
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # in the prompt or the output
        self.seen[torch.tensor([t for t in prompt if 0 <= t < vocab_size], dtype=torch.long)] = True
        bias = torch.zeros(vocab_size, dtype=torch.float64)
        for token, value in sampling.logit_bias:
            if token < vocab_size:
                bias[token] = value
        self.bias = bias

    def shape(self, logits: torch.Tensor, tokens: Sequence[int] = (), parents: Sequence[int] = ()) -> torch.Tensor:
        rows = len(tokens) + 1
        output = self.output.expand(rows, -1).clone()  # each row's counts: the output, then its own path
        for node in range(len(tokens)):
            ancestor = node
            while ancestor >= 0:
                output[1 + node, int(tokens[ancestor])] += 1
                ancestor = int(parents[ancestor])
        return penalised(logits, output, self.seen.expand(rows, -1) | (output > 0), self.bias, self.sampling)

    def advance(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.output[int(token)] += 1
            self.seen[int(token)] = True


def penalised(logits: torch.Tensor, output_counts: torch.Tensor, seen: torch.Tensor, bias: torch.Tensor,
              sampling: SamplingParams) -> torch.Tensor:
    """Logits [rows, vocab] changed by each row's counts (pure: the tests' reference reads it too).
    Repetition first (it scales the model's logit), then the OpenAI penalties and the bias (they add)."""
    out = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    dtype = out.dtype
    if sampling.repetition_penalty != 1:
        scaled = torch.where(out > 0, out / sampling.repetition_penalty, out * sampling.repetition_penalty)
        out = torch.where(seen.to(out.device), scaled, out)
    counts = output_counts.to(device=out.device, dtype=dtype)
    out = out - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).to(dtype)
    return out + bias.to(device=out.device, dtype=dtype)
