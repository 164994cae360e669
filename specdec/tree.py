"""Token trees as parent pointers: pure functions for checks, depths, walks, cache entries and the
boolean attention masks built from parents (ancestry) and positions (sliding windows).

A tree hangs below the last committed token (the *root*, which is not a node). Node i has a token
and a parent: -1 for a child of the root, otherwise a node index smaller than i (so nodes are in
topological order). A chain of n drafts is the tree with parents [-1, 0, 1, ..., n - 2].
The masks are boolean (True: may attend); turning them into what a model's attention reads is the
runtime's job (docs/design.md, pitfall 11).
"""

from __future__ import annotations

from typing import Sequence

import torch


def chain_parents(n: int, start: int = 0) -> list[int]:
    """The parents of n nodes (or cache entries) appended as a chain after `start` ones: start - 1,
    start, ... A list: the runtime's bookkeeping takes it on every forward; a tree wraps it."""
    return list(range(start - 1, start + n - 1))


def check_parents(parents: torch.Tensor | Sequence[int], start: int = 0) -> None:
    """Every parent is -1 or an earlier node: node i, appended after `start` ones (entry start + i of
    a cache), follows -1 or a node below start + i. So nodes are in topological order."""
    for i, parent in enumerate(parents.tolist() if isinstance(parents, torch.Tensor) else parents):
        if not -1 <= parent < start + i:
            raise ValueError(f"entry {start + i} cannot follow entry {parent}: parents must be -1 or earlier entries")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for a child of the root."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def is_chain(parents: torch.Tensor) -> bool:
    return parents.tolist() == list(range(-1, parents.numel() - 1))


def children(parents: Sequence[int], node: int) -> list[int]:
    """Children of `node` (-1 = the root) in index order, which is the order they are verified in."""
    return [i for i, parent in enumerate(parents) if parent == node]


def child(parents: list[int], tokens: list[int], node: int, token: int) -> int | None:
    """The first child of `node` (-1 = the root) that spells `token`, or None; every walk down a
    tree by tokens (verifying, matching committed text, merging proposals) takes this one. Plain
    lists (a tensor's `tolist()`, taken once per walk): no tensor element is read per step."""
    return next((i for i, (parent, t) in enumerate(zip(parents, tokens)) if parent == node and t == token), None)


def trials(parents: Sequence[int], path: list[int], in_order: bool = False) -> list[tuple[int, bool]]:
    """Every node that verification reached (a child of the root or of an accepted node), and
    whether it was accepted (on the accepted `path`). in_order: the verifier tries a node's children
    one after another until one is accepted (`verify.verify_tree`, sampling), so the children after
    the accepted one were never tried; else (greedy, keyed) every child of a reached node was a trial:
    it is accepted iff it spells the target's token, whatever its siblings."""
    accepted, tried = set(path), []
    for parent in [-1, *path]:
        for node in children(parents, parent):
            tried.append((node, node in accepted))
            if in_order and node in accepted:
                break
    return tried


def entries(parents: Sequence[int], root: int) -> list[int]:
    """Node parents as cache entries, for a tree whose root is entry `root` and whose node i is
    entry root + 1 + i (the runtime protocol's parents)."""
    return [root if parent < 0 else parent + root + 1 for parent in parents]


def new_entries(tokens, parents: Sequence[int] | None, start: int) -> tuple[list[int], list[int]]:
    """A forward's tokens and parents as lists, checked (`check_parents`): one parent per token;
    parents default to a chain after the `start` cached entries."""
    tokens = [int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist()]
    parents = chain_parents(len(tokens), start) if parents is None else [int(p) for p in parents]
    if len(parents) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens need {len(tokens)} parents, got {len(parents)}")
    check_parents(parents, start)
    return tokens, parents


def check_kept_path(parents: Sequence[int], start: int, indices: Sequence[int], length: int) -> None:
    """For keeping a path of a cache of `length` entries: `indices` (entries >= start) must be a
    chain below entry start - 1."""
    if not 0 <= start <= length:
        raise ValueError(f"cannot keep {start} entries of a cache of {length}")
    above = start - 1
    for index in indices:
        if not start <= index < length or parents[index] != above:
            raise ValueError(f"cannot keep entries {list(indices)} after {start}: they must be a chain below "
                             f"entry {start - 1}")
        above = index


def ancestry(parents: Sequence[int], trunk: int, start: int, n: int) -> torch.Tensor:
    """[n, start + n] bool: which entries each of entries start .. start + n - 1 attends to, its
    ancestors and itself, for a cache whose entries have `parents` (every entry's). Entries below
    `trunk` are a chain that every later entry descends from, so each sees them whole."""
    walks = _walks(parents, trunk, start, n)
    joined = torch.tensor([joined for _, joined in walks], dtype=torch.long)
    mask = torch.arange(start + n)[None, :] <= joined[:, None]  # the chain's cells 0 .. joined
    mask[[j for j, (own, _) in enumerate(walks) for _ in own], [entry for own, _ in walks for entry in own]] = True
    return mask


def ancestry_bits(parents: Sequence[int], trunk: int, start: int, n: int) -> tuple[int, list[int]]:
    """`ancestry` as integers: (cut, each new entry's row from cell `cut` on, bit k for cell cut + k).
    Every new entry sees all cells below `cut`: the lowest cell that some entry's path leaves the chain
    below (at most `trunk`)."""
    walks = _walks(parents, trunk, start, n)
    cut = min([trunk] + [joined + 1 for _, joined in walks])
    return cut, [sum(1 << (entry - cut) for entry in own) | ((1 << (joined + 1 - cut)) - 1) for own, joined in walks]


def _walks(parents: Sequence[int], trunk: int, start: int, n: int) -> list[tuple[list[int], int]]:
    """Each new entry's walk to the root: (its path from `trunk` on, itself first; the chain entry below
    `trunk` that the path joins, -1 for none). The entry sees its path and the chain's cells 0 .. joined."""
    walks = []
    for entry in range(start, start + n):
        own = []
        while entry >= trunk:
            own.append(entry)
            entry = parents[entry]
        walks.append((own, entry))
    return walks


def sliding_window(allowed: torch.Tensor, key_positions: torch.Tensor, positions: torch.Tensor,
                   window: int) -> torch.Tensor:
    """`allowed` [batch, n, keys] bool, cut to a sliding window: a query at position p (`positions`
    [batch, n]) sees keys at positions > p - window only (`key_positions` [batch, keys]). By position,
    not by cache slot: while a tree is cached, an entry's slot is not its position."""
    return allowed & (key_positions[:, None, :] > positions[:, :, None] - window)
