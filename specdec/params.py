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
    seed: sampling is repeatable (see `SpeculativeDecoder.request`); None: fresh randomness."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecDecError(f"temperature must be >= 0, got {self.temperature}")
        check_integer(self.top_k, "top_k", minimum=0)  # 0 = off
        if not (0 < self.top_p <= 1):
            raise SpecDecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            check_integer(self.seed, "seed", minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Limits:
    """When a generation ends, and what it reports beside its text: at most `max_new_tokens`
    tokens, or where a stop string begins (EOS ends it too); logprobs: each token's log-probability
    and this many most likely alternatives (None: none)."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

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
