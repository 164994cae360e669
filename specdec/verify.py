"""Verifiers: pure functions of draft tokens, draft probs, target probs and randomness.

No model and no cache in here. Names follow docs/design.md: target_probs (p), draft_probs (q);
*accepted* draft tokens are kept, a *recovered* token is drawn from the residual after the first
rejection, a *bonus* token is drawn from the target when every draft token was accepted.
Every verifier emits exactly accepted + 1 tokens, so an iteration always makes progress.
"""

from __future__ import annotations

import torch

from specdec import tree
from specdec.sampling import argmax, draw, sample, uniform
from specdec.types import VerifyResult


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, token: int,
             columns: torch.Tensor | None = None) -> torch.Tensor:
    """norm(max(0, p - q)) at one position; a point-mass q removes `token` from p.

    target_probs (p, or what earlier rejected siblings left of it): [vocab]; draft_probs: [vocab],
    or [len(columns)] over the target ids `columns` (`Draft.columns`): q is 0 outside them, where
    p - q = p, so only the columns change. If the residual has no mass (p <= q everywhere, which in
    exact arithmetic means p == q and rejection is impossible; in floating point it can happen)
    fall back to p rather than divide by zero (docs/design.md, pitfall 3).
    """
    if draft_probs is None:
        rest = target_probs.clone()
        rest[token] = 0
    elif columns is None:
        rest = (target_probs - draft_probs).clamp_(min=0)
    else:
        rest = target_probs.clone()
        rest[columns] = (target_probs[columns] - draft_probs).clamp_(min=0)
    total = rest.sum()
    return rest / total if total > 0 else target_probs


def column(columns: torch.Tensor | None, token: int) -> int:
    """The column of target id `token` among `columns` (None: the token itself). A drawn token
    outside its distribution's columns had q = 0 and cannot have been drawn: a broken drafter."""
    if columns is None:
        return token
    found = torch.nonzero(columns == token)
    if found.numel() != 1:
        raise ValueError(f"draft token {token} is not among its distribution's columns exactly once")
    return int(found[0, 0])


def verify_tree(
    tokens: torch.Tensor,  # [n] int64 target ids, the tree's nodes
    parents: torch.Tensor,  # [n] int64, -1 for a child of the root
    # [n, columns]: row i is the distribution node i was drawn from; None: point masses
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,  # [n + 1, vocab]: row 0 scores the root's children, row i + 1 node i's children
    accept_rng: torch.Generator,
    recover_rng: torch.Generator,
    # [columns] int64: the target ids of draft_probs' columns; None: [vocab], in order
    columns: torch.Tensor | None = None,
) -> VerifyResult:
    """Multi-step speculative sampling down a token tree (SpecInfer; Leviathan/Chen for a chain).

    At a node with target distribution p, keep a residual r = p and try its children in order:
    child c, drawn from q_c, is accepted with probability min(1, r(c) / q_c(c)); on rejection
    r <- norm(max(0, r - q_c)). Each step emits exactly r, so the node emits exactly p, as long as
    every child was drawn from its q_c given only what was drawn before it (sampled children: q
    with earlier siblings removed; deterministic children: a point mass). If no child is accepted,
    emit y ~ r; at a leaf, a bonus y ~ p. q is read at the child's column (`columns`): a draft
    with a pruned vocabulary is verified without widening its q to the target's.
    """
    assert target_probs.shape[0] == tokens.numel() + 1, "target_probs needs a row for the root and one per node"
    path, node, parent_of = [], -1, parents.tolist()
    while True:
        rest = target_probs[node + 1]
        for child in tree.children(parent_of, node):
            token = int(tokens[child])
            q = 1.0 if draft_probs is None else float(draft_probs[child, column(columns, token)])
            # q > 0 for a token drawn from q; u < r/q accepts.
            if uniform(accept_rng) * q < float(rest[token]):
                path.append(child)
                node = child
                break
            rest = residual(rest, None if draft_probs is None else draft_probs[child], token, columns)
        else:  # no child accepted, or a leaf: rest is the residual (a leaf's is p itself)
            last = sample(rest, recover_rng)
            return VerifyResult(accepted=len(path), tokens=tokens[path].tolist() + [last], path=path)


def verify_tree_coupled(
    tokens: torch.Tensor,  # [n] int64, point-mass nodes
    parents: torch.Tensor,  # [n] int64, -1 for a child of the root
    target_probs: torch.Tensor,  # [n + 1, vocab], rows as in verify_tree
    noise,  # j -> [vocab] Exp(1) noise of the step's j-th emitted token
) -> VerifyResult:
    """Point-mass drafts verified by drawing: at each node the target's token is drawn with the
    noise of its place, y = argmax(p / E_j) (`sampling.draw`); the walk descends into the child
    that spells it, else emits it. "Draw y ~ p, keep the draft while it spells y" is exactly
    lossless (y is drawn from p whatever was drafted), and more: every emitted token is the very
    token plain decoding draws with the same E_j, so when E_j is fixed by the token's place in the
    output (`RandomStreams.noise`), the text does not depend on the draft at all. A drafter that
    proposed argmax(q / E_j) (`sampling.ranked`) is kept with probability
    P(argmax(q / E) = argmax(p / E)) at least (1 - TV) / (1 + TV): the Gumbel coupling."""
    assert target_probs.shape[0] == tokens.numel() + 1, "target_probs needs a row for the root and one per node"
    return _follow_target(tokens, parents, lambda node, accepted: draw(target_probs[node + 1], noise(accepted)))


def verify_tree_greedy(
    tokens: torch.Tensor,  # [n] int64
    parents: torch.Tensor,  # [n] int64
    target_logits: torch.Tensor,  # [n + 1, vocab], rows as in verify_tree
) -> VerifyResult:
    """Follow the target's argmax down the tree while some child carries it; then emit that argmax."""
    choices = argmax(target_logits)  # no draft: plain greedy decoding, choices[0]
    return _follow_target(tokens, parents, lambda node, accepted: choices[node + 1])


def _follow_target(tokens: torch.Tensor, parents: torch.Tensor, target_token) -> VerifyResult:
    """The walk of the point-mass verifiers: `target_token(node, accepted)` is the target's token
    below `node` (-1: the root) after `accepted` kept nodes, asked once per node in walk order;
    descend into the child that spells it, else emit it."""
    ids, parent_of = tokens.tolist(), parents.tolist()
    path, node = [], -1
    while True:
        token = target_token(node, len(path))
        child = tree.child(parent_of, ids, node, token)
        if child is None:
            return VerifyResult(accepted=len(path), tokens=[ids[i] for i in path] + [token], path=path)
        path.append(child)
        node = child


def verify_chain(
    draft_tokens: torch.Tensor,  # [n] int64
    draft_probs: torch.Tensor | None,  # [n, columns], or None for point-mass drafts
    target_probs: torch.Tensor,  # [n + 1, vocab]; row i scores draft_tokens[i], row n is the bonus
    accept_rng: torch.Generator,
    recover_rng: torch.Generator,
    columns: torch.Tensor | None = None,  # [columns] int64 target ids of draft_probs' columns; None: [vocab]
) -> VerifyResult:
    """Modified rejection sampling (Leviathan Alg. 1, Chen Alg. 2): a chain is a tree of one branch.

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); q_i(x_i) = 1 for point-mass drafts,
    which makes this "accept with probability p_i(x_i)".
    """
    parents = torch.tensor(tree.chain_parents(draft_tokens.numel()), dtype=torch.long)
    return verify_tree(draft_tokens, parents, draft_probs, target_probs, accept_rng, recover_rng, columns)


def verify_greedy(
    draft_tokens: torch.Tensor,  # [n] int64
    target_logits: torch.Tensor,  # [n + 1, vocab]
) -> VerifyResult:
    """Keep the longest draft prefix that equals the target's argmax, then the target's own argmax."""
    return verify_tree_greedy(draft_tokens, torch.tensor(tree.chain_parents(draft_tokens.numel()), dtype=torch.long),
                              target_logits)
