"""Leviathan et al.'s analysis as pure functions: expected tokens per iteration and the speedup
they buy at measured costs.

On a CPU a verify of γ + 1 tokens costs more than one decoding step, so predictions use measured
per-call costs: t_target(k) = seconds for one target forward over k new tokens. The policy and the
bench both read the speedup from `speedup`.
"""

from __future__ import annotations


def expected_tokens(alpha: float, gamma: float) -> float:
    """E[tokens per iteration] = (1 − α^{γ+1}) / (1 − α): γ drafts (a mean depth need not be whole),
    each accepted with an i.i.d. probability α, and the token every iteration emits; γ + 1 at α = 1."""
    if alpha >= 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup(tokens: float, draft_seconds: float, verify_seconds: float, plain_seconds: float = 1.0) -> float:
    """An iteration's speedup over plain decoding: tokens · t_plain / (drafting + verifying).

    With tokens = E[tokens](α, γ), draft_seconds = γ · t_draft(1), verify_seconds = t_target(γ + 1) and
    plain_seconds = t_target(1) it is Leviathan's speedup(γ). With plain_seconds left at 1 it is the
    iteration's tokens per second, which is what a policy compares across depths."""
    return tokens * plain_seconds / (draft_seconds + verify_seconds)


def weight_bytes_per_token(target_forwards: int, target_bytes: int, draft_forwards: int, draft_bytes: int,
                           tokens: int) -> float:
    """Bytes of weights streamed per generated token: needs no clock, so it is free of timing noise."""
    return (target_forwards * target_bytes + draft_forwards * draft_bytes) / max(tokens, 1)
