"""What a request asks for: how tokens are chosen (`SamplingParams`) and when a generation ends
(`Limits`). Plain values, checked when made, with no torch: the CLI checks them before it loads
anything."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from specdec.errors import SpecDecError, check_integer
from specdec.text import check_text


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 is greedy (argmax), its own deterministic mode.
    seed: sampling is repeatable (see `SpeculativeDecoder.request`); None: fresh randomness.

    Cut-offs of the distribution at each position (`sampling.probs_from_logits`): top_k, top_p, and
    min_p (tokens less likely than min_p times the likeliest are dropped). Changes of the logits by
    the tokens before (`penalties.Penalties`, on each draft row's own path): presence_penalty and
    frequency_penalty (OpenAI's: subtracted once per token that occurred in the output, and once per
    occurrence), repetition_penalty (the CTRL paper's, as vLLM and llama.cpp: a logit of a token in the
    prompt or output is divided by it when positive, multiplied when negative) and logit_bias (token id
    -> added to its logit; a dict is taken)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecDecError(f"temperature must be >= 0, got {self.temperature}")
        check_integer(self.top_k, "top_k", minimum=0)  # 0 = off
        if not (0 < self.top_p <= 1):
            raise SpecDecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            check_integer(self.seed, "seed", minimum=0)
        if not (0 <= self.min_p <= 1):
            raise SpecDecError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # OpenAI's range
                raise SpecDecError(f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name)
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise SpecDecError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
                               param="repetition_penalty")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(token), float(value)) for token, value in bias))
        except (TypeError, ValueError):
            raise SpecDecError("logit_bias maps token ids to numbers", param="logit_bias") from None
        if any(token < 0 or not -100 <= value <= 100 for token, value in bias):
            raise SpecDecError("logit_bias maps token ids (>= 0) to values in [-100, 100]", param="logit_bias")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether the tokens before change the logits (a penalty or a bias: `penalties.Penalties`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias)


@dataclass(frozen=True)
class Limits:
    """When a generation ends, and what it reports beside its text: at most `max_new_tokens`
    tokens, or where a stop string begins (EOS ends it too); logprobs: each token's log-probability
    and this many most likely alternatives (None: none)."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the generation beside the model's end tokens
    ignore_eos: bool = False  # the model's end tokens do not end it (the ones in stop_token_ids still do)

    def __post_init__(self):
        check_integer(self.max_new_tokens, "max_new_tokens", minimum=0)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise SpecDecError("stop strings must be non-empty strings", param="stop")
        for s in stop:  # a stop string that no text can hold would never match
            check_text(s, "stop string", param="stop")
        object.__setattr__(self, "stop", stop)
        if self.logprobs is not None:
            check_integer(self.logprobs, "logprobs", minimum=0, maximum=20)
        ids = tuple(self.stop_token_ids)
        for token in ids:
            check_integer(token, "stop_token_ids", minimum=0)
        object.__setattr__(self, "stop_token_ids", ids)


def request_options(sampling: SamplingParams | None, limits: Limits | None,
                    keywords: dict) -> tuple[SamplingParams, Limits]:
    """The Python API's shorthand (`generate(prompt, max_new_tokens=64, temperature=0)`): keywords
    naming fields of SamplingParams or Limits, over the values given (their defaults: none given)."""
    fields = {"sampling": SamplingParams.__dataclass_fields__, "limits": Limits.__dataclass_fields__}
    unknown = [k for k in keywords if not any(k in names for names in fields.values())]
    if unknown:
        raise TypeError(f"unexpected option(s) {', '.join(sorted(unknown))}")
    of = {part: {k: v for k, v in keywords.items() if k in names} for part, names in fields.items()}
    sampling = replace(sampling or SamplingParams(), **of["sampling"])
    limits = replace(limits or Limits(), **of["limits"])
    return sampling, limits
