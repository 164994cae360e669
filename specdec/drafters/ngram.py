"""The Katz-backoff trigram as a drafter: a full distribution (stochastic) or its top token."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.drafters.base import ContextDrafter
from specdec.errors import SpecDecError
from specdec.katz import KatzTrigram
from specdec.runtime import CausalLM, tokenizer_fingerprint
from specdec.sampling import probs_from_logits, sample
from specdec.types import Draft
from specdec.params import SamplingParams


class NgramDrafter(ContextDrafter):
    """stochastic=True samples from the n-gram's distribution after the target's sampling transform
    (so q is exact); stochastic=False proposes the top token (point mass). Greedy mode is always top-1.
    """

    def __init__(self, model: KatzTrigram, stochastic: bool = True):
        self.model = model
        self.stochastic = stochastic
        self.name = "ngram" if stochastic else "ngram-top1"

    def fit(self, target: CausalLM) -> None:
        """The n-gram must count the target's token ids: same tokenizer (when recorded), same vocabulary size."""
        expected = tokenizer_fingerprint(target.tokenizer)
        if self.model.fingerprint and self.model.fingerprint != expected:
            raise SpecDecError("the n-gram model was built with another tokenizer than the target's "
                               f"(fingerprint {self.model.fingerprint} vs {expected})")
        if self.model.vocab_size != target.vocab_size:
            raise SpecDecError(f"the n-gram model covers {self.model.vocab_size} tokens; "
                               f"the target's tokenizer has {target.vocab_size}")

    def propose_one(
        self, context: Sequence[int], max_tokens: int, sampling: SamplingParams, rng: torch.Generator
    ) -> Draft:
        context = list(context[-2:])  # a trigram looks at two tokens
        tokens, probs = [], []
        for _ in range(max_tokens):
            if sampling.greedy or not self.stochastic:
                token = self.model.top_token(context)
            else:
                probs.append(probs_from_logits(self.model.log_probs(context), sampling))
                token = sample(probs[-1], rng)
            tokens.append(token)
            context = [context[-1], token]
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=torch.stack(probs) if probs else None)
