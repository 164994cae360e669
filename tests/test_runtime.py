"""The runtime interface: explicit positions and masks over cached + new tokens (what trees need)."""

from __future__ import annotations

import pytest
import torch

import specdec
from conftest import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_two_branches_in_one_forward_match_each_path_alone(arch, model_dirs):
    """Prefix [1 2 3], then branches [4 5] and [6] fed together: each node sees only its own path."""
    model = specdec.load_model(model_dirs[arch], device="cpu", dtype="float64")
    prefix, nodes, parents = [1, 2, 3], [4, 5, 6], [-1, 0, -1]  # node 1's parent is node 0; nodes 0, 2 hang below the prefix
    depth = [1, 2, 1]
    mask = torch.zeros(len(nodes), len(prefix) + len(nodes), dtype=torch.bool)
    mask[:, : len(prefix)] = True
    for i in range(len(nodes)):
        j = i
        while j >= 0:  # a node attends to itself and its ancestors
            mask[i, len(prefix) + j] = True
            j = parents[j]
    model.forward(prefix)
    positions = torch.tensor([len(prefix) + d - 1 for d in depth])
    tree_logits = model.forward(nodes, positions=positions, attention_mask=mask)
    model.reset()
    alone = model.forward(prefix + [4, 5])[-2:]
    model.reset()
    other = model.forward(prefix + [6])[-1]
    torch.testing.assert_close(tree_logits[:2], alone, rtol=0, atol=1e-10)
    torch.testing.assert_close(tree_logits[2], other, rtol=0, atol=1e-10)
    # compaction: keep the path [4 5]; the cache then equals a fresh prefill of prefix + [4 5]
    model.reset()
    model.forward(prefix)
    model.forward(nodes, positions=positions, attention_mask=mask)
    model.keep([0, 1, 2, 3, 4])
    next_logits = model.forward([7])
    model.reset()
    torch.testing.assert_close(next_logits, model.forward(prefix + [4, 5, 7])[-1:], rtol=0, atol=1e-10)


def test_bad_mask_shape_and_positions_are_refused(model_dirs):
    model = specdec.load_model(model_dirs["llama"], device="cpu")
    with pytest.raises(ValueError, match="attention_mask must be"):
        model.forward([1, 2], attention_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(specdec.SpecDecError, match="beyond the model's context"):
        model.forward([1], positions=torch.tensor([64]))
    with pytest.raises(ValueError, match="cannot truncate"):
        model.truncate(5)
