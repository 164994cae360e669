"""Token trees as parent pointers: pure functions for depths, paths, positions and attention masks.

A tree hangs below the last committed token (the *root*, which is not a node). Node i has a token
and a parent: -1 for a child of the root, otherwise a node index smaller than i (so nodes are in
topological order). A chain of n drafts is the tree with parents [-1, 0, 1, ..., n - 2].
"""

from __future__ import annotations

import torch


def chain_parents(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.long) - 1


def check_parents(parents: torch.Tensor) -> None:
    """Every parent is -1 or an earlier node."""
    index = torch.arange(parents.numel())
    if parents.numel() and not bool(((parents >= -1) & (parents < index)).all()):
        raise ValueError(f"tree parents must be -1 or an earlier node, got {parents.tolist()}")


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node: 1 for a child of the root."""
    return torch.tensor(_depths(parents.tolist()), dtype=torch.long)


def _depths(parents: list[int]) -> list[int]:
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def is_chain(parents: torch.Tensor) -> bool:
    return parents.tolist() == list(range(-1, parents.numel() - 1))


def children(parents: torch.Tensor, node: int) -> list[int]:
    """Children of `node` (-1 = the root) in index order, which is the order they are verified in."""
    return [i for i, parent in enumerate(parents.tolist()) if parent == node]


def child(parents: list[int], tokens: list[int], node: int, token: int) -> int | None:
    """The first child of `node` (-1 = the root) that spells `token`, or None; every walk down a
    tree by tokens (verifying, matching committed text, merging proposals) takes this one. Plain
    lists (a tensor's `tolist()`, taken once per walk): no tensor element is read per step."""
    return next((i for i, (parent, t) in enumerate(zip(parents, tokens)) if parent == node and t == token), None)


def trials(parents: torch.Tensor, path: list[int]) -> list[tuple[int, bool]]:
    """Every node that verification reached (a child of the root or of an accepted node), and
    whether it was accepted (on the accepted `path`)."""
    accepted = set(path)
    return [(node, node in accepted) for parent in [-1, *path] for node in children(parents, parent)]


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Nodes from the root's child down to `node` (empty for the root)."""
    parent_of, path = parents.tolist(), []
    while node >= 0:
        path.append(node)
        node = parent_of[node]
    return path[::-1]


def entries(parents: torch.Tensor, root: int) -> torch.Tensor:
    """Node parents as cache entries, for a tree whose root is entry `root` and whose node i is
    entry root + 1 + i (the runtime protocol's parents)."""
    return torch.where(parents < 0, torch.full_like(parents, root), parents + root + 1)
