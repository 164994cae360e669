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
    """One generation's penalties: counts of the output's tokens (presence, frequency) and the tokens of
    the prompt and output (repetition), kept as the text grows. Only the columns of tokens that occurred or
    carry a bias change, so only those are computed (a few hundred of a 262k vocabulary)."""

    def __init__(self, sampling: SamplingParams, prompt: Sequence[int], vocab_size: int):
        self.sampling, self.vocab_size = sampling, vocab_size
        self.output: dict[int, int] = {}  # occurrences in the output
        self.seen = {t for t in prompt if 0 <= t < vocab_size}  # in the prompt or the output
        self.bias = {token: value for token, value in sampling.logit_bias if token < vocab_size}

    def shape(self, logits: torch.Tensor, tokens: Sequence[int] = (), parents: Sequence[int] = ()) -> torch.Tensor:
        tokens = [int(t) for t in tokens]
        columns = sorted(self.seen | self.bias.keys() | set(tokens))
        if not columns:
            return logits
        where = {token: i for i, token in enumerate(columns)}
        rows = len(tokens) + 1
        counts = torch.zeros(rows, len(columns), dtype=torch.float64)  # each row's: the output, then its own path
        seen = torch.zeros(rows, len(columns), dtype=torch.bool)
        counts[:, [where[t] for t in self.output]] = torch.tensor(list(self.output.values()), dtype=torch.float64)
        seen[:, [where[t] for t in self.seen]] = True
        for node in range(len(tokens)):
            ancestor = node
            while ancestor >= 0:
                counts[1 + node, where[tokens[ancestor]]] += 1
                seen[1 + node, where[tokens[ancestor]]] = True
                ancestor = int(parents[ancestor])
        bias = torch.tensor([self.bias.get(token, 0.0) for token in columns], dtype=torch.float64)
        index = torch.tensor(columns, device=logits.device)
        out = logits.clone()
        out[:, index] = penalised(logits[:, index], counts, seen, bias, self.sampling).to(logits.dtype)
        return out

    def advance(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.output[int(token)] = self.output.get(int(token), 0) + 1
            self.seen.add(int(token))


def penalised(logits: torch.Tensor, output_counts: torch.Tensor, seen: torch.Tensor, bias: torch.Tensor,
              sampling: SamplingParams) -> torch.Tensor:
    """Logits [rows, columns] changed by each row's counts of those columns' tokens (pure). Repetition first
    (it scales the model's logit), then the OpenAI penalties and the bias (they add)."""
    out = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    dtype = out.dtype
    if sampling.repetition_penalty != 1:
        scaled = torch.where(out > 0, out / sampling.repetition_penalty, out * sampling.repetition_penalty)
        out = torch.where(seen.to(out.device), scaled, out)
    counts = output_counts.to(device=out.device, dtype=dtype)
    out = out - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).to(dtype)
    return out + bias.to(device=out.device, dtype=dtype)
