"""Slow references for tests: plain walks over a tree that the package itself never needs."""

from __future__ import annotations

import torch


def path_to(parents: torch.Tensor | list[int], node: int) -> list[int]:
    """Nodes from the root's child down to `node` (empty for the root, -1)."""
    parent_of = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    path = []
    while node >= 0:
        path.append(node)
        node = parent_of[node]
    return path[::-1]
