"""The runtime protocol on every backend: sequences of entries with parents (chains and token trees)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import specdec
from conftest import ARCHS
from specdec import tree
from reference import path_to


# a tree of 7 nodes below the prefix: two branches at the root, a fork at node 1, depth 3
TREE_TOKENS = [4, 5, 6, 7, 8, 9, 10]
TREE_PARENTS = [-1, 0, -1, 1, 1, 2, 3]
PREFIX = [1, 2, 3, 1, 5, 9, 2, 6, 5, 3, 5]  # longer than mistral's sliding window of 8: the tree mask must apply it
GGUF = ["gguf-f32", "gguf-f16"]


@pytest.fixture
def runtime(request, model_dirs, gguf_models):
    """(model, how close a tree node's logits must be to its path's alone) for an HF arch or a GGUF."""
    if request.param in GGUF:
        return specdec.load_model(gguf_models[request.param], threads=1), 1e-4 if request.param == "gguf-f32" else 2e-2
    return specdec.load_model(model_dirs[request.param], device="cpu", dtype="float64"), 1e-10


def alone(model, tokens: list[int]) -> torch.Tensor:
    sequence = model.sequence()
    logits = sequence.forward(tokens)[-1]
    sequence.release()
    return logits


def fed_tree(model):
    """A new sequence holding PREFIX, then the 7-node tree below its last token in one forward;
    returns the sequence and the tree's logits."""
    sequence = model.sequence()
    sequence.forward(PREFIX)
    return sequence, sequence.forward(TREE_TOKENS, tree.entries(TREE_PARENTS, len(PREFIX) - 1))


@pytest.mark.parametrize("runtime", ARCHS + GGUF, indirect=True)
def test_every_tree_node_matches_its_path_alone(runtime):
    """One forward of a whole tree: each node's logits are its own path's."""
    model, atol = runtime
    parents = torch.tensor(TREE_PARENTS)
    sequence, tree_logits = fed_tree(model)
    for node in range(len(TREE_TOKENS)):
        path = [TREE_TOKENS[i] for i in path_to(parents, node)]
        torch.testing.assert_close(tree_logits[node], alone(model, PREFIX + path), rtol=0, atol=atol)


@pytest.mark.parametrize("runtime", ARCHS + GGUF, indirect=True)
def test_a_tree_fed_node_by_node_deeper_than_the_window(runtime):
    """Two root branches, then a 10-deep chain below the first, one forward per node (as a drafter
    grows a tree). Slots and positions differ by one below the fork, so a sliding window (mistral:
    8) must be applied by position, not by slot."""
    model, atol = runtime
    sequence = model.sequence()
    sequence.forward(PREFIX)
    root = len(PREFIX) - 1
    tokens, parents = [4, 5], [-1, -1]
    sequence.forward(tokens, [root, root])
    for depth in range(2, 12):
        tokens.append(depth % 7 + 1)
        parents.append(0 if depth == 2 else len(tokens) - 2)
        logits = sequence.forward(tokens[-1:], [root + 1 + parents[-1]])[0]
        path = [tokens[i] for i in path_to(torch.tensor(parents), len(tokens) - 1)]
        torch.testing.assert_close(logits, alone(model, PREFIX + path), rtol=0, atol=atol)


@pytest.mark.parametrize("runtime", ARCHS + GGUF, indirect=True)
def test_keep_compacts_a_tree_path(runtime):
    """After keeping the path to node 6 (nodes 0 1 3 6), the next token sees exactly that path."""
    model, atol = runtime
    parents = torch.tensor(TREE_PARENTS)
    sequence, _ = fed_tree(model)
    path = path_to(parents, 6)
    assert path == [0, 1, 3, 6]
    sequence.keep(len(PREFIX), [len(PREFIX) + i for i in path])
    assert sequence.cache_len == len(PREFIX) + 4
    next_logits = sequence.forward([11])[-1]
    # llama.cpp: cells end up in another order than a fresh prefill's, which moves float32 sums a little
    torch.testing.assert_close(next_logits, alone(model, PREFIX + [TREE_TOKENS[i] for i in path] + [11]),
                               rtol=0, atol=max(atol, 1e-3 if model.backend == "llamacpp" else 0))


@pytest.mark.parametrize("runtime", ["llama", "gguf-f16"], indirect=True)
def test_sequences_are_independent(runtime):
    """Two slots of one model at once: what one feeds or drops never shows in the other."""
    model, atol = runtime
    first, second = model.sequence(), model.sequence()
    first.forward(PREFIX)
    second.forward([7, 7, 7])
    first.forward([4, 5], [len(PREFIX) - 1] * 2)
    second.truncate(1)
    torch.testing.assert_close(first.forward([6], [len(PREFIX)])[0], alone(model, PREFIX + [4, 6]), rtol=0, atol=max(atol, 1e-3))
    torch.testing.assert_close(second.forward([8])[0], alone(model, [7, 8]), rtol=0, atol=max(atol, 1e-3))
    first.release()
    second.release()


@pytest.mark.parametrize("runtime", ["llama", "gguf-f16"], indirect=True)
def test_bad_parents_and_overflows_are_refused(runtime):
    model, _ = runtime
    sequence = model.sequence()
    with pytest.raises(ValueError, match="parents must be -1 or earlier entries"):
        sequence.forward([1, 2], [-1, 5])
    sequence.forward([1, 2, 3])
    with pytest.raises(specdec.SpecDecError, match="overflow|beyond the model.s context"):
        sequence.forward([1] * model.max_length)
    with pytest.raises(ValueError, match="cannot truncate"):
        sequence.truncate(5)
    with pytest.raises(ValueError, match="cannot keep"):
        sequence.keep(1, [2])  # entry 2 follows entry 1, not entry 0
    sequence.keep(1, [1])
    assert sequence.cache_len == 2


def test_the_small_batch_product_equals_f_linear_wherever_it_is_used():
    from specdec.runtime import cpu_matmul

    layer = torch.nn.Linear(24, 40)
    cpu_matmul.use_small_batch_matmul(layer)
    layer.transposed_rows = frozenset(cpu_matmul.BUCKETS)  # force the transposed form for every small batch
    import types
    layer.forward = types.MethodType(cpu_matmul._small_batch_linear, layer)
    for rows in (1, 2, 3, 5, 8, 16, 17):
        x = torch.randn(1, rows, 24)
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
    assert cpu_matmul.transposed_wins(40, 24, torch.float32, 1) <= set(cpu_matmul.BUCKETS)


@st.composite
def caches_with_new_entries(draw):
    """(parents of every entry, trunk, start, n): a committed chain below `trunk`, then entries each after any
    earlier one (so some paths leave the chain below the trunk); the n new entries from `start` on, which may
    lie below the trunk (an EAGLE-3 head reads committed entries again). Up to 92 cells: rows wider than the
    static pool's 64-bit words."""
    trunk = draw(st.integers(0, 80))
    start = draw(st.integers(0, trunk + 3))
    n = draw(st.integers(0, 9))
    parents = list(range(-1, trunk - 1))
    for entry in range(trunk, max(trunk, start + n)):
        parents.append(draw(st.integers(-1, entry - 1)))
    return parents, trunk, start, n


@given(caches_with_new_entries())
def test_the_tree_masks_are_each_entrys_ancestors(cache):
    """`tree.ancestry` and its integers (`tree.ancestry_bits`, the static pool's rows) against a walk of every
    parent to the root: each new entry sees itself and its ancestors; the cut is the first cell below the trunk
    that some new entry does not see, and bit k of an entry's row is whether it sees cell cut + k."""
    parents, trunk, start, n = cache
    seen = []
    for entry in range(start, start + n):
        cells = set()
        while entry >= 0:
            cells.add(entry)
            entry = parents[entry]
        seen.append(cells)
    mask = tree.ancestry(parents, trunk, start, n)
    assert [set(row.nonzero().flatten().tolist()) for row in mask] == seen
    cut, rows = tree.ancestry_bits(parents, trunk, start, n)
    assert cut == next((cell for cell in range(trunk) if any(cell not in cells for cells in seen)), trunk)
    assert rows == [sum(1 << (cell - cut) for cell in cells if cell >= cut) for cells in seen]


def test_the_static_pools_rows_for_a_chain_continuing_the_cache_are_its_shortcuts():
    """`_Step.of` writes a chain after a chain without walking it: entry i sees the new entries up to itself."""
    for start in range(8):
        for n in range(1, 8):
            parents = list(range(-1, start + n - 1))
            assert tree.ancestry_bits(parents, start, start, n) == (start, [(2 << i) - 1 for i in range(n)])


def test_the_tree_masks_follow_parents_and_positions():
    """`tree.ancestry` against the slow path walk: each new entry sees the trunk whole, then exactly its
    path; `tree.sliding_window` keeps keys whose position is within the window of the query's."""
    trunk, start = 3, 4  # entries 0-2: committed chain; entry 3: a node kept below it; then TREE_PARENTS
    parents = [-1, 0, 1, 2] + [p + start if p >= 0 else start - 1 for p in TREE_PARENTS]
    mask = tree.ancestry(parents, trunk, start, len(TREE_PARENTS))
    for j in range(len(TREE_PARENTS)):
        seen = set(range(start)) | {start + i for i in path_to(TREE_PARENTS, j)}
        assert mask[j].nonzero().flatten().tolist() == sorted(seen)
    positions = torch.tensor([[3, 4, 4, 5, 5, 6, 6]])
    key_positions = torch.tensor([[0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7]])
    windowed = tree.sliding_window(torch.ones(1, 7, 11, dtype=torch.bool), key_positions, positions, window=3)
    for query, position in enumerate(positions[0].tolist()):
        assert windowed[0, query].tolist() == [key > position - 3 for key in key_positions[0].tolist()]
