"""Leviathan et al.'s analysis as pure functions: expected tokens, predicted speedup, optimal γ.

On a CPU a verify of γ + 1 tokens costs more than one decoding step, so predictions use measured
per-call costs: t_target[k] = seconds for one target forward over k new tokens.
"""

from __future__ import annotations


def acceptance_from_distributions(target_probs, draft_probs) -> float:
    """α = Σ_x min(p(x), q(x)) = 1 − TV(p, q), for one position."""
    return float((target_probs.minimum(draft_probs)).sum())


def expected_tokens(alpha: float, gamma: float) -> float:
    """E[tokens per iteration] = (1 − α^{γ+1}) / (1 − α): γ drafts (a mean depth need not be whole),
    each accepted with an i.i.d. probability α, and the token every iteration emits; γ + 1 at α = 1."""
    if alpha >= 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, gamma: int, t_target: dict[int, float], t_draft: float) -> float:
    """speedup(γ) = E[tokens] · t_target(1) / (γ · t_draft + t_target(γ + 1)), versus plain decoding."""
    return expected_tokens(alpha, gamma) * t_target[1] / (gamma * t_draft + t_target[gamma + 1])


def optimal_gamma(alpha: float, t_target: dict[int, float], t_draft: float) -> int:
    """The γ ≥ 1 with the largest predicted speedup among those whose verify cost was measured."""
    candidates = [g for g in t_target if g >= 1 and g + 1 in t_target]
    return max(candidates, key=lambda g: predicted_speedup(alpha, g, t_target, t_draft))


def weight_bytes_per_token(target_forwards: int, target_bytes: int, draft_forwards: int, draft_bytes: int, tokens: int) -> float:
    """Bytes of weights streamed per generated token: needs no clock, so it is free of timing noise."""
    return (target_forwards * target_bytes + draft_forwards * draft_bytes) / max(tokens, 1)
