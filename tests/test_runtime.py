"""The runtime interface: explicit positions and masks over cached + new tokens (what trees need)."""

from __future__ import annotations

import pytest
import torch

import specdec
from conftest import ARCHS
from specdec import tree


# a tree of 7 nodes below the prefix: two branches at the root, a fork at node 1, depth 3
TREE_TOKENS = [4, 5, 6, 7, 8, 9, 10]
TREE_PARENTS = [-1, 0, -1, 1, 1, 2, 3]
PREFIX = [1, 2, 3, 1, 5, 9, 2, 6, 5, 3, 5]  # longer than mistral's sliding window of 8: the tree mask must apply it


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tree_node_matches_its_path_alone(arch, model_dirs):
    """One forward of a whole tree under `tree_inputs`: each node's logits are its own path's (float64)."""
    model = specdec.load_model(model_dirs[arch], device="cpu", dtype="float64")
    prefix, parents = PREFIX, torch.tensor(TREE_PARENTS)
    model.forward(prefix)
    positions, mask = tree.tree_inputs(parents, len(prefix), new=len(TREE_TOKENS))
    tree_logits = model.forward(TREE_TOKENS, positions=positions, attention_mask=mask)
    for node in range(len(TREE_TOKENS)):
        path = [TREE_TOKENS[i] for i in tree.path_to(parents, node)]
        model.reset()
        alone = model.forward(prefix + path)[-1]
        torch.testing.assert_close(tree_logits[node], alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tree_fed_node_by_node_deeper_than_the_window(arch, model_dirs):
    """Two root branches, then a 10-deep chain below the first, one forward per node (as a drafter
    grows a tree). Slots and positions differ by one below the fork, so a sliding window (mistral:
    8) must be applied by position, not by slot."""
    model = specdec.load_model(model_dirs[arch], device="cpu", dtype="float64")
    model.forward(PREFIX)
    tokens, parents = [4, 5], [-1, -1]
    positions, mask = tree.tree_inputs(torch.tensor(parents), len(PREFIX), new=2)
    model.forward(tokens, positions=positions, attention_mask=mask)
    for depth in range(2, 12):
        tokens.append(depth % 7 + 1)
        parents.append(0 if depth == 2 else len(tokens) - 2)
        positions, mask = tree.tree_inputs(torch.tensor(parents), len(PREFIX), new=1)
        logits = model.forward(tokens[-1:], positions=positions, attention_mask=mask)[0]
        path = [tokens[i] for i in tree.path_to(torch.tensor(parents), len(tokens) - 1)]
        alone = specdec.load_model(model_dirs[arch], device="cpu", dtype="float64").forward(PREFIX + path)[-1]
        torch.testing.assert_close(logits, alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_compacts_a_tree_path(arch, model_dirs):
    """After keeping the path to node 6 (nodes 0 1 3 6), the cache equals a fresh prefill of that path."""
    model = specdec.load_model(model_dirs[arch], device="cpu", dtype="float64")
    prefix, parents = PREFIX, torch.tensor(TREE_PARENTS)
    model.forward(prefix)
    positions, mask = tree.tree_inputs(parents, len(prefix), new=len(TREE_TOKENS))
    model.forward(TREE_TOKENS, positions=positions, attention_mask=mask)
    path = tree.path_to(parents, 6)
    assert path == [0, 1, 3, 6]
    model.keep(len(prefix), [len(prefix) + i for i in path])
    next_logits = model.forward([11])
    model.reset()
    expected = model.forward(prefix + [TREE_TOKENS[i] for i in path] + [11])[-1:]
    torch.testing.assert_close(next_logits, expected, rtol=0, atol=1e-10)


def test_bad_mask_shape_and_positions_are_refused(model_dirs):
    model = specdec.load_model(model_dirs["llama"], device="cpu")
    with pytest.raises(ValueError, match="attention_mask must be"):
        model.forward([1, 2], attention_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(specdec.SpecDecError, match="beyond the model's context"):
        model.forward([1], positions=torch.tensor([64]))
    with pytest.raises(ValueError, match="cannot truncate"):
        model.truncate(5)
    with pytest.raises(ValueError, match="cannot keep"):
        model.keep(0, [9])
