"""Verifiers: pure functions of draft tokens, draft probs, target probs and randomness.

No model and no cache in here. Names follow DESIGN.md: target_probs (p), draft_probs (q);
*accepted* draft tokens are kept, a *recovered* token is drawn from the residual after the first
rejection, a *bonus* token is drawn from the target when every draft token was accepted.
Every verifier emits exactly accepted + 1 tokens, so an iteration always makes progress.
"""

from __future__ import annotations

import torch

from specdec.sampling import sample, uniform
from specdec.types import VerifyResult


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)) at one position; a point-mass q removes `token` from p.

    target_probs, draft_probs: [vocab]. If the residual has no mass (p <= q everywhere, which in
    exact arithmetic means p == q and rejection is impossible; in floating point it can happen)
    fall back to p rather than divide by zero (DESIGN pitfall 3).
    """
    if draft_probs is None:
        rest = target_probs.clone()
        rest[token] = 0
    else:
        rest = (target_probs - draft_probs).clamp_(min=0)
    total = rest.sum()
    return rest / total if total > 0 else target_probs


def verify_chain(
    draft_tokens: torch.Tensor,  # [n] int64
    draft_probs: torch.Tensor | None,  # [n, vocab], or None for point-mass drafts
    target_probs: torch.Tensor,  # [n + 1, vocab]; row i scores draft_tokens[i], row n is the bonus
    accept_rng: torch.Generator,
    recover_rng: torch.Generator,
) -> VerifyResult:
    """Modified rejection sampling (Leviathan Alg. 1, Chen Alg. 2): output ~ target exactly.

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); q_i(x_i) = 1 for point-mass drafts,
    which makes this "accept with probability p_i(x_i)".
    """
    n = draft_tokens.numel()
    assert target_probs.shape[0] == n + 1, "target_probs needs one row per draft token plus the bonus row"
    for i in range(n):
        token = int(draft_tokens[i])
        p = float(target_probs[i, token])
        q = 1.0 if draft_probs is None else float(draft_probs[i, token])
        # q > 0 always holds for a token that was sampled from q; u < p/q accepts.
        if uniform(accept_rng) * q >= p:
            row_q = None if draft_probs is None else draft_probs[i]
            recovered = sample(residual(target_probs[i], row_q, token), recover_rng)
            return VerifyResult(accepted=i, tokens=draft_tokens[:i].tolist() + [recovered])
    bonus = sample(target_probs[n], recover_rng)
    return VerifyResult(accepted=n, tokens=draft_tokens.tolist() + [bonus])


def verify_greedy(
    draft_tokens: torch.Tensor,  # [n] int64
    target_logits: torch.Tensor,  # [n + 1, vocab]
) -> VerifyResult:
    """Keep the longest draft prefix that equals the target's argmax, then the target's own argmax."""
    n = draft_tokens.numel()
    choices = target_logits.argmax(dim=-1)  # [n + 1]
    mismatches = (choices[:n] != draft_tokens).nonzero()
    accepted = int(mismatches[0]) if len(mismatches) else n
    return VerifyResult(accepted=accepted, tokens=choices[: accepted + 1].tolist())
