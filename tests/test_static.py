"""The static-slot path (`specdec.runtime.static`), on the CPU: what it computes equals the eager
path's cache step for step, every drafter's greedy output equals plain decoding's, sampled chains
and trees keep the target's distribution, and an iteration reads the device once.

CUDA graphs exist only on a GPU; here the same code runs through the graphs' own input buffers without a
graph ("graphs" on the CPU: padded to the compiled shapes, as a GPU runs it; most tests), or traced by
torch.compile without code generation ("aot_eager"), which is what a graph would capture. "static" (nothing
compiled) runs each forward as it comes, unpadded: `WAYS` checks it beside "graphs".
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import specdec
from conftest import ARCHS, reference_greedy
from specdec.errors import SpecDecError
from specdec.losslessness import check_lossless, format_report
from specdec.runtime import load_model, static
from specdec.runtime.base import Feed
from specdec.runtime.fused import FusedForward
from specdec.runtime.hf import HFModel
from specdec.runtime.static import (BUCKETS, StaticHFModel, first_in_window, read_buckets, static_refusal,
                                     window_read)
from tiny import save_tiny_model

PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]  # repeats, so prompt lookup has something to find
NEW = 40
WAYS = ["graphs", "static"]  # padded to compiled shapes (as a GPU runs them), and as they come


def static64(directory: str, compile: str = "graphs") -> StaticHFModel:
    return load_model(directory, device="cpu", dtype="float64", compile=compile)


@pytest.fixture(scope="module")
def static_llama(model_dirs):
    return static64(model_dirs["llama"])


@pytest.mark.parametrize("way", WAYS)
def test_cache_steps_match_the_eager_cache(model_dirs, load64, way):
    """Prefill, a tree, compaction of its path, truncation, a fork and a chain: the same logits and
    the same cached keys on both paths."""
    eager, static = load64(model_dirs["llama"]).sequence(), static64(model_dirs["llama"], way).sequence()
    steps = [
        lambda s: s.forward(PROMPT),
        lambda s: s.forward([5, 6, 7, 8, 9], parents=[9, 9, 10, 12, 10]),
        lambda s: (s.keep(10, [10, 12, 13]), s.forward([4], parents=[12]))[1],
        lambda s: (s.truncate(8), s.forward([3, 3, 3]))[1],
        lambda s: s.fork(9).forward([7, 1, 2, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]),  # 18 new entries: the 64 bucket
    ]
    for step in steps:
        torch.testing.assert_close(step(static), step(eager), rtol=1e-10, atol=1e-10)
        assert static.cache_len == eager.cache_len
    for (k1, v1), (k2, v2) in zip(static.cache_tensors(), eager.cache_tensors()):
        torch.testing.assert_close(k1, k2, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("steps", [
    [([5, 6, 7, 8, 9], [9, 9, 10, 12, 10]), ([4], [11])],  # below a cached tree node whose parent is under the trunk's end
    [([4, 6], [5, 10])],  # a new entry below the trunk's end
    [([4, 6], [-1, 10])],  # a new root mid-sequence
])
def test_paths_that_leave_the_trunk_early(model_dirs, load64, static_llama, steps):
    """The protocol lets a new entry follow any earlier entry: the mask's trunk is then only what every new entry sees."""
    eager, static = load64(model_dirs["llama"]).sequence(), static_llama.sequence()
    try:
        for sequence in (eager, static):
            sequence.forward(PROMPT)
        for tokens, parents in steps:
            torch.testing.assert_close(static.forward(tokens, parents), eager.forward(tokens, parents), rtol=1e-10, atol=1e-10)
    finally:
        static.release()


def test_a_tree_part_wider_than_a_word_of_bits(tmp_path, load64):
    """A cached tree of 80 nodes, then entries below its last ones: their rows' tree parts span more than the
    64 cells one word of bits holds (two words, a graph of their own), as the eager cache computes them."""
    directory = str(save_tiny_model(tmp_path / "llama", "llama", seed=0, context=160))
    eager, static = load64(directory).sequence(), static64(directory, compile="graphs").sequence()
    tree = ([i % 7 for i in range(80)], [9] * 40 + list(range(10, 50)))  # 40 children of the prompt's end, a chain each
    for tokens, parents in [(PROMPT, None), tree, ([4, 5], [89, 49]), ([6], [90]), ([1, 2, 3], None)]:
        ours, theirs = static.forward(tokens, parents), eager.forward(tokens, parents)
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert {shape[2] for shape, *_ in static.owner.runner().shapes} == {1, 2}


def test_rows_are_reused_swapped_and_grown(model_dirs):
    """A released row is taken again; a sequence alone runs in row 0 (swapped there, its cache with
    it); more sequences than rows grow the pool, keeping every cache."""
    static_llama = static64(model_dirs["llama"])
    first, second = static_llama.sequence(), static_llama.sequence()
    rows = first.row, second.row
    before = second.forward(PROMPT)[-1]
    assert second.row == 0 and first.row == rows[1]  # swapped
    first.release()
    third = static_llama.sequence()
    assert third.row == rows[1]
    more = [static_llama.sequence() for _ in range(static_llama.pool.rows)]
    assert static_llama.pool.rows >= len(more) + 2
    torch.testing.assert_close(second.forward([5], parents=[len(PROMPT) - 2])[0], second.forward([5], parents=[len(PROMPT) - 2])[0])
    fresh = static_llama.sequence()
    torch.testing.assert_close(fresh.forward(PROMPT)[-1], before, rtol=1e-10, atol=1e-10)
    for sequence in (second, third, fresh, *more):
        sequence.release()


def test_a_sequence_dropped_unreleased_gives_its_row_back(model_dirs):
    """Rows are held weakly, as llama.cpp's sequences give their cells back when dropped: decoders made one
    after another over one target (each keeping finished sequences in the prefix cache they share, which goes
    with the last of them) leave its pool as it was, where each growth would capture every graph again."""
    target = static64(model_dirs["llama"])
    rows = target.pool.rows
    for _ in range(rows + 1):
        decoder = specdec.SpeculativeDecoder(target, None)
        decoder.generate(PROMPT * 3, max_new_tokens=4, temperature=0)
        assert decoder.prefixes.tokens > 0  # it keeps a finished sequence, in a row of its own
        del decoder  # no garbage collection asked: nothing holding a row lies in a reference cycle
    assert target.pool.rows == rows
    dropped = target.sequence()
    row = dropped.row
    del dropped
    assert target.sequence().row == row


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("kind", ["chain", "tree", "plain"])
def test_rows_of_a_batch_decode_as_if_alone(arch, kind, way, model_dirs, load64):
    """The server's continuous batching over static rows: five requests joining at different steps,
    greedy and sampled; each row's tokens equal its generation alone (float64)."""
    from test_batching import PROMPTS, drafters, run_batch

    target = static64(model_dirs[arch], way)
    decoder = specdec.SpeculativeDecoder(target, drafters(load64(model_dirs[f"{arch}-near"]))[kind](), gamma=3)
    requests = [dict(prompt=prompt, max_new_tokens=12 + 3 * i, temperature=0.0 if i % 2 else 1.0, top_k=5 * (i % 3), seed=i)
                for i, prompt in enumerate(PROMPTS)]
    batched = run_batch(decoder, requests, joins=[0, 0, 2, 3, 7])
    for request, result in zip(requests, batched):
        assert result.tokens == decoder.generate(**request).tokens


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_drafter_equals_plain_greedy(arch, way, model_dirs, load64):
    target = static64(model_dirs[arch], way)
    want = reference_greedy(load64(model_dirs[arch]), PROMPT, NEW)
    near = specdec.ModelDrafter(load64(model_dirs[f"{arch}-near"]))
    drafters = {
        "plain": (None, "auto"),
        "chain": (near, 3),
        "tree": (specdec.ModelDrafter(load64(model_dirs[f"{arch}-near"]), tree=specdec.TreeShape(nodes=8)), 3),
        "prompt-lookup": (specdec.PromptLookupDrafter(), 4),
        "auto": (specdec.AutoDrafter(near, specdec.PromptLookupDrafter()), "auto"),
    }
    for name, (drafter, gamma) in drafters.items():
        decoder = specdec.SpeculativeDecoder(target, drafter, gamma=gamma)
        assert decoder.generate(PROMPT, max_new_tokens=NEW, temperature=0).tokens == want, name
        assert decoder.generate(PROMPT, max_new_tokens=NEW, temperature=0).tokens == want, f"{name}, from a kept prefix"


def test_compiled_forwards_equal_plain_greedy(model_dirs, load64):
    """torch.compile traces the forwards of two buckets (aot_eager: no code generation on the CPU)."""
    target = static64(model_dirs["llama"], compile="aot_eager")
    want = reference_greedy(load64(model_dirs["llama"]), PROMPT, NEW)
    near = specdec.ModelDrafter(load64(model_dirs["llama-near"]))
    for drafter, gamma in ((None, "auto"), (near, 3)):
        assert specdec.SpeculativeDecoder(target, drafter, gamma=gamma).generate(PROMPT, max_new_tokens=NEW, temperature=0).tokens == want
    # plain steps, verifies of 4, the prompt; each at the read buckets its rows reached (10 + 40 cells: all three)
    assert target.reads == (16, 32, 64)
    assert {shape[:2] for shape in target.compile_seconds} == {(1, 1), (1, 4), (1, 16)}
    assert {shape[2] for shape in target.compile_seconds} == {16, 32, 64}


def test_graph_buffers_equal_plain_greedy(model_dirs, load64):
    """The hand-captured graphs' path ("graphs"): each shape's inputs copied into its own buffers
    (on the CPU nothing is captured), alone and in a batch of rows joining at different steps."""
    from test_batching import PROMPTS, run_batch

    target = static64(model_dirs["llama"], compile="graphs")
    want = reference_greedy(load64(model_dirs["llama"]), PROMPT, NEW)
    tree = specdec.ModelDrafter(load64(model_dirs["llama-near"]), tree=specdec.TreeShape(nodes=8))
    for drafter, gamma in ((None, "auto"), (tree, 3)):
        assert specdec.SpeculativeDecoder(target, drafter, gamma=gamma).generate(PROMPT, max_new_tokens=NEW, temperature=0).tokens == want
    decoder = specdec.SpeculativeDecoder(target, tree, gamma=3)
    requests = [dict(prompt=prompt, max_new_tokens=10 + 2 * i, temperature=0.0) for i, prompt in enumerate(PROMPTS)]
    results = run_batch(decoder, requests, joins=[0, 1, 1, 3, 4])
    assert len(target.runner().shapes) >= 4  # rows and token buckets, each with its own buffers
    for request, result in zip(requests, results):
        assert result.tokens == decoder.generate(**request).tokens


def test_read_buckets_double_from_512_cells_up_to_the_row(monkeypatch):
    monkeypatch.setattr(static, "SMALLEST_READ", 512)  # as shipped (the tests' fixture starts them at 16)
    assert read_buckets(4096) == (512, 1024, 2048, 4096)
    assert read_buckets(32768) == (512, 1024, 2048, 4096, 8192, 16384, 32768)
    assert read_buckets(1000) == (512, 1008)  # the last rounded up to 16 cells
    assert read_buckets(512) == (512,) and read_buckets(100) == (112,)
    # no bucket just under the last: 4096 beside 4112 would double the compiled shapes for 16 cells
    assert read_buckets(4100) == (512, 1024, 2048, 4112) and read_buckets(600) == (608,)


@pytest.mark.parametrize("fused", [False, True])
def test_steps_across_read_buckets_equal_the_eager_cache(model_dirs, load64, fused):
    """One token at a time from 1 cell to a row of 60 (not a multiple of 16: read buckets 16, 32, 64, the scratch
    cell at 64), then a tree across a bucket's end: each step's logits those of the eager cache, in float64."""
    eager = load64(model_dirs["llama"])
    pool = StaticHFModel(eager.model, eager.tokenizer, "llama", context=60, backend="graphs", fused=fused)
    assert (pool.capacity, pool.reads, pool.scratch) == (60, (16, 32, 64), 64)
    mine, reference = pool.sequence(), eager.sequence()
    tokens = [(5 * i + 1) % 14 + 1 for i in range(56)]
    for token in tokens:
        torch.testing.assert_close(mine.forward([token]), reference.forward([token]), rtol=1e-10, atol=1e-10)
    mine.truncate(26), reference.truncate(26)  # then a tree of 5 (31 cells: 32 read), and 3 more below it (34: 64)
    for tree_tokens, parents in (([5, 6, 7, 8, 9], [25, 25, 26, 28, 26]), ([4, 4, 4], [27, 31, 32])):
        torch.testing.assert_close(mine.forward(tree_tokens, parents), reference.forward(tree_tokens, parents),
                                   rtol=1e-10, atol=1e-10)
    assert {shape[2] for shape in pool.compile_seconds} == {16, 32, 64}


@pytest.mark.parametrize("fused", [False, True])
def test_a_forward_reads_no_cell_past_its_read_bucket(model_dirs, fused):
    """Attention reads the read bucket that holds its rows' cells (16 of 16, 32, 64 here), not the whole row:
    cells past it may hold anything, NaN here, and change nothing (reading them made every logit NaN). In a
    batch of 3 padded to 4 rows, the padding row reads its cell 0 only."""
    eager = specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")
    static = StaticHFModel(eager.model, eager.tokenizer, "llama", backend="graphs", fused=fused)
    assert static.reads == (16, 32, 64)
    prompts = [PROMPT, PROMPT[:7], PROMPT[2:]]
    sequences = [static.sequence() for _ in prompts]
    for sequence, prompt in zip(sequences, prompts):
        sequence.forward(prompt)
    for tensor in (*static.pool.keys, *static.pool.values):
        tensor[:, :, 16:] = float("nan")
    got = static.forward_batch([specdec.runtime.base.Feed(sequence, [5]) for sequence in sequences])
    assert (4, 1, 16, 0) in static.compile_seconds  # three rows of at most 11 cells: the batch bucket 4, 16 cells read
    for rows, prompt in zip(got, prompts):
        torch.testing.assert_close(rows[-1], eager.sequence().forward(prompt + [5])[-1], rtol=1e-10, atol=1e-10)


def test_a_sliding_layer_reads_its_window_where_the_read_bucket_is_three_times_longer(monkeypatch):
    monkeypatch.setattr(static, "WINDOW_SLACK", 128)  # as shipped (the tests' fixture leaves 8 cells)
    assert window_read(512, 1024) == 0 and window_read(512, 2048) == 640  # Gemma 3 1B's window: 511 + 128 cells
    assert window_read(1024, 2048) == 0 and window_read(1024, 4096) == 1152  # Gemma 3 4B-27B's
    assert window_read(4096, 8192) == 0 and window_read(4096, 16384) == 4224  # Mistral 7B v0.1's
    assert window_read(None, 32768) == 0
    assert first_in_window([40, 41, 41], 8) == 33 and first_in_window([3], 8) == 0


@pytest.fixture(scope="module")
def sliding(tmp_path_factory) -> dict[str, str]:
    """Mistral (every layer sliding) and Gemma 3 (sliding and full layers), windows of 8 cells."""
    root = tmp_path_factory.mktemp("sliding")
    return {arch: str(save_tiny_model(root / arch, arch, seed=seed, layers=3)) for seed, arch in
            enumerate(("mistral", "gemma3"))}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_windowed_reads_equal_the_eager_cache(sliding, arch, fused):
    """Past 32 cells a row's sliding layers read 16 cells (its window of 8 and 8 new or uncommitted ones) where
    the others read 64: one token at a time to 60 cells (from 56 on, the window read ends at the bucket's end
    and starts before the window), a tree of 4 to the row's end, then at 44 cells a tree of 5 and 3 below it
    (uncommitted cells inside the window read), then a chain of 18 (more than the window read holds: every layer
    reads the 64). Each step's logits those of the eager cache, in float64."""
    eager = specdec.load_model(sliding[arch], device="cpu", dtype="float64")
    pool = StaticHFModel(eager.model, eager.tokenizer, arch, backend="graphs", fused=fused)
    assert (pool.reads, pool.sliding_window, window_read(8, 64)) == ((16, 32, 64), 8, 16)
    mine, reference = pool.sequence(), eager.sequence()
    tokens = [(5 * i + 1) % 14 + 1 for i in range(60)]
    for token in tokens:
        torch.testing.assert_close(mine.forward([token]), reference.forward([token]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mine.forward([3, 4, 5, 6], [59, 59, 60, 61]),
                               reference.forward([3, 4, 5, 6], [59, 59, 60, 61]), rtol=1e-10, atol=1e-10)
    mine.truncate(44), reference.truncate(44)
    for tree_tokens, parents in (([5, 6, 7, 8, 9], [43, 43, 44, 46, 44]), ([4, 4, 4], [45, 48, 49])):
        torch.testing.assert_close(mine.forward(tree_tokens, parents), reference.forward(tree_tokens, parents),
                                   rtol=1e-10, atol=1e-10)
    mine.truncate(40), reference.truncate(40)
    torch.testing.assert_close(mine.forward(tokens[:18]), reference.forward(tokens[:18]), rtol=1e-10, atol=1e-10)
    assert {(1, 1, 32, 0), (1, 1, 64, 16), (1, 16, 64, 16), (1, 64, 64, 0)} <= set(pool.compile_seconds)


@pytest.mark.parametrize("fused", [False, True])
def test_windowed_forwards_trace_whole(sliding, fused):
    """torch.compile traces a forward whose sliding layers read their windows (aot_eager: what a GPU compiles and
    captures), the fused forward's layers compiled whole too: no graph break, each step's logits the eager cache's."""
    from torch._dynamo.utils import counters

    counters.clear()
    eager = specdec.load_model(sliding["gemma3"], device="cpu", dtype="float64")
    pool = StaticHFModel(eager.model, eager.tokenizer, "gemma3", backend="aot_eager", fused=fused)
    if fused:
        pool.fused = FusedForward(pool.model, compiled=True, scope="layers", backend="aot_eager")
    mine, reference = pool.sequence(), eager.sequence()
    for token in [(5 * i + 1) % 14 + 1 for i in range(40)]:
        torch.testing.assert_close(mine.forward([token]), reference.forward([token]), rtol=1e-10, atol=1e-10)
    assert (1, 1, 64, 16) in pool.compile_seconds and not counters["graph_break"]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_sliding_layer_reads_no_cell_before_its_window(sliding, arch, fused):
    """In a batch of 3 rows (padded to 4) of 36 to 45 cells, every cell of a sliding layer before its row's window
    holds NaN, and cells past the read bucket in every layer: nothing changes (reading one would make the
    logits NaN). Mistral's every layer, Gemma 3's local ones."""
    eager = specdec.load_model(sliding[arch], device="cpu", dtype="float64")
    pool = StaticHFModel(eager.model, eager.tokenizer, arch, backend="graphs", fused=fused)
    tokens = [(3 * i + 2) % 14 + 1 for i in range(45)]
    prompts = [tokens[:40], tokens, tokens[3:39]]
    sequences = [pool.sequence() for _ in prompts]
    for sequence, prompt in zip(sequences, prompts):
        sequence.forward(prompt)
    layers = [i for i, sliding in enumerate(pool.pool.sliding) if sliding]
    assert layers == ([0, 1, 2] if arch == "mistral" else [0, 2])  # Gemma 3's layer types: local, global, local
    for sequence, prompt in zip(sequences, prompts):
        first = len(prompt) - 8 + 1  # the next token's window
        for index in layers:
            for tensor in (pool.pool.keys[index], pool.pool.values[index]):
                tensor[sequence.row, :, :first] = float("nan")
    for tensor in (*pool.pool.keys, *pool.pool.values):
        tensor[:, :, 64:] = float("nan")
    got = pool.forward_batch([specdec.runtime.base.Feed(sequence, [5]) for sequence in sequences])
    assert (4, 1, 64, 16) in pool.compile_seconds
    for rows, prompt in zip(got, prompts):
        torch.testing.assert_close(rows[-1], eager.sequence().forward(prompt + [5])[-1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fused", [False, True])
def test_a_chunk_past_the_largest_bucket_computes_the_logits_it_gives_only(tmp_path, fused):
    """A forward of more new entries than a compiled shape holds (a prefill chunk) runs the output product over
    the tokens its feeds want: a prompt's chunk its last one, not 100. Alone and in a batch of rows of other
    lengths wanting other counts, the logits are the eager cache's, and so are the states a head reads (the
    final norm's, for the rows of logits given)."""
    directory = str(save_tiny_model(tmp_path / "llama", "llama", seed=3, context=256))
    eager = specdec.load_model(directory, device="cpu", dtype="float64")
    prompts = [[(7 * i + 3) % 14 + 1 for i in range(length)] for length in (100, 90, 70)]
    # fed alone, then rows of 100 and 90 wanting 1 and 5 (the product over tokens 85-99), then all three
    # with the last wanting every one (over all 100); then 70 after 20 cached, wanting 2
    feeds = [[(0, 1)], [(0, 1), (1, 5)], [(0, 1), (1, 5), (2, None)]]
    eager.keep_states(True)

    def eager_forward(prompt, last):
        sequence = eager.sequence()
        return sequence.forward(prompt, last=last), sequence.states

    want = [[eager_forward(prompts[i], last) for i, last in rows] for rows in feeds]
    want_after = eager_forward(prompts[1], 2)
    eager.keep_states(False)
    pool = StaticHFModel(eager.model, eager.tokenizer, "llama", backend="graphs", fused=fused)
    pool.keep_states(True)
    widths = []  # the tokens each output product ran over (the model is shared: the eager ones ran above)
    pool.model.lm_head.register_forward_hook(lambda module, inputs, output: widths.append(inputs[0].shape[1]))
    for rows, wanted in zip(feeds, want):
        sequences = [pool.sequence() for _ in rows]
        got = pool.forward_batch([Feed(s, prompts[i], last=last) for s, (i, last) in zip(sequences, rows)])
        for mine, sequence, (logits, states) in zip(got, sequences, wanted):
            torch.testing.assert_close(mine, logits, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(sequence.states, states, rtol=1e-10, atol=1e-10)
    sequences[1].truncate(20)
    torch.testing.assert_close(sequences[1].forward(prompts[1][20:], last=2), want_after[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sequences[1].states, want_after[1], rtol=1e-10, atol=1e-10)
    assert widths == [1, 15, 100, 2]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("backend, shapes", [
    ("static", [(3, 10, 7), (1, 5, 5)]),  # as they come: rows, tokens, the output product's tokens
    ("graphs", [(4, 16, 16), (1, 16, 16)]),  # padded to the compiled shapes (a batch bucket of 4, a token bucket of 16)
])
def test_a_pool_that_compiles_nothing_pads_nothing(model_dirs, fused, backend, shapes):
    """On a pool that compiles nothing (static) a forward runs as it comes, as a prefill chunk past the largest
    bucket does: a batch of 3 rows of 10, 7 and 4 entries wanting their last logits runs 3 rows of 10 and the
    output product from the first token a row wants (the 4-entry row's 4th: 7 of 10), a tree verify of 5 entries
    runs 5 tokens, not its bucket's 16. Each gives the eager cache's logits."""
    eager = specdec.load_model(model_dirs["llama"], device="cpu", dtype="float64")  # its own: hooked below
    prompts, tree = [PROMPT, PROMPT[:7], PROMPT[3:7]], dict(tokens=[5, 6, 7, 8, 9], parents=[9, 9, 10, 12, 10])
    references = [eager.sequence() for _ in prompts]
    want = [reference.forward(prompt, last=1) for reference, prompt in zip(references, prompts)]
    want_tree = references[0].forward(**tree)
    pool = StaticHFModel(eager.model, eager.tokenizer, "llama", backend=backend, fused=fused)
    seen = []  # (rows, tokens) each forward embedded, then the tokens its output product ran over (the pool's only)
    pool.model.model.embed_tokens.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape))
    pool.model.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape[1]))
    sequences = [pool.sequence() for _ in prompts]
    got = pool.forward_batch([Feed(s, prompt, last=1) for s, prompt in zip(sequences, prompts)])
    for mine, logits in zip(got, want):
        torch.testing.assert_close(mine, logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sequences[0].forward(**tree), want_tree, rtol=1e-10, atol=1e-10)
    assert [(*seen[i], seen[i + 1]) for i in range(0, len(seen), 2)] == shapes
    if backend == "static":
        with pytest.raises(ValueError, match="compiles nothing"):
            pool.runner()


def test_a_released_sequence_is_refused(model_dirs):
    model = static64(model_dirs["llama"])
    sequence = model.sequence()
    sequence.forward(PROMPT)
    sequence.release()
    other = model.sequence()
    assert other.row == sequence.row
    for use in (lambda: sequence.forward([1]), lambda: sequence.keep(2, []), lambda: sequence.fork(2)):
        with pytest.raises(ValueError, match="released sequence"):
            use()


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("tree", [None, 6])
def test_sampled_chains_and_trees_are_lossless(load64, model_dirs, tree, way):
    near = specdec.ModelDrafter(load64(model_dirs["llama-near"]), tree=specdec.TreeShape(nodes=tree) if tree else None)
    decoder = specdec.SpeculativeDecoder(static64(model_dirs["llama"], way), near, gamma=3)
    report = check_lossless(decoder, [PROMPT], samples=400, length=2, seed=5, alpha=1e-3, progress=False, temperature=1.0)
    assert report.passed, format_report(report)
    assert 0 < report.accepted < report.drafted


class Resident(torch.Tensor):
    """A tensor that would live on the device: every read of its values by the host is counted
    (once: after torch.compile has run in the process, a read may come back through this hook);
    what `.cpu()` returns is the host's own copy."""

    reads = 0
    HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__int__,
                  torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__}
    _inside = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.HOST_READS and not Resident._inside:
            Resident.reads += 1
        inside, Resident._inside = Resident._inside, True
        try:
            result = super().__torch_function__(func, types, args, kwargs or {})
        finally:
            Resident._inside = inside
        return result.as_subclass(torch.Tensor) if func is torch.Tensor.cpu else result  # the host's copy


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_an_iteration_reads_the_device_once(static_llama, load64, model_dirs, monkeypatch, sampling):
    """The logits stay on the device (marked here as `Resident`); greedy verification reads their
    argmax, sampled verification their distribution, once per iteration, whatever was drafted."""
    results = StaticHFModel._results

    def resident_results(self, placed, logits, skipped=0):
        return [row.as_subclass(Resident) if feed.on_device else row
                for (feed, *_), row in zip(placed, results(self, placed, logits, skipped))]

    monkeypatch.setattr(StaticHFModel, "_results", resident_results)
    for drafter, gamma in ((None, "auto"), (specdec.ModelDrafter(load64(model_dirs["llama-near"])), 3), (specdec.PromptLookupDrafter(), 4)):
        Resident.reads = 0
        result = specdec.SpeculativeDecoder(static_llama, drafter, gamma=gamma).generate(PROMPT, max_new_tokens=24, seed=1, **sampling)
        assert Resident.reads == result.stats.target_forwards, (drafter, Resident.reads, result.stats.target_forwards)


def test_between_replays_nothing_works_over_a_rows_cells(model_dirs, load64, monkeypatch):
    """The mask and the cells' positions are built inside the captured forward (`StaticHFModel.step_forward`)
    from a few integers per row: between two replays no op computes anything as wide as a row's cells (on a
    GPU each op there is a launch the device waits for), whatever was drafted. (The old path built the mask,
    [rows, tokens, cells], between them.)"""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    target = static64(model_dirs["llama"], compile="graphs")
    widths, outside = [], [True]

    class Widths(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if outside[0] and not func.is_view:  # a view (a row of the pool, say) computes nothing
                widths.extend(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    step_forward = target.step_forward

    def captured(*args, **kwargs):
        outside[0] = False
        try:
            return step_forward(*args, **kwargs)
        finally:
            outside[0] = True

    monkeypatch.setattr(target, "step_forward", captured)
    target._runner = None  # made again around the patched forward
    tree = specdec.ModelDrafter(load64(model_dirs["llama-near"]), tree=specdec.TreeShape(nodes=8))
    for drafter, gamma in ((None, "auto"), (tree, 3)):
        decoder = specdec.SpeculativeDecoder(target, drafter, gamma=gamma)
        with Widths():
            decoder.generate(PROMPT, max_new_tokens=16, temperature=0)
    assert widths and not [shape for shape in widths if target.pool.cells in shape]


def test_compile_settings(model_dirs, monkeypatch):
    assert type(load_model(model_dirs["llama"], device="cpu")) is HFModel  # auto: eager on the CPU
    assert type(load_model(model_dirs["llama"], device="cpu", compile="off")) is HFModel
    model = load_model(model_dirs["llama"], device="cpu", compile="static", context=32)
    assert isinstance(model, StaticHFModel) and model.max_length == model.capacity == 32
    with pytest.raises(SpecDecError, match="unknown compile setting"):
        load_model(model_dirs["llama"], device="cpu", compile="fast")
    with pytest.raises(SpecDecError, match="context applies"):
        load_model(model_dirs["llama"], device="cpu", compile="off", context=32)
    with pytest.raises(SpecDecError, match="compile applies to transformers"):
        load_model("x.gguf", compile="on")


def test_a_decoder_compiles_its_forwards_before_its_first_request(model_dirs, capsys, monkeypatch):
    """A decoder built on a pool that compiles (traced here: aot_eager; on a GPU, CUDA graphs) compiles
    every token bucket of every batch bucket its slots may fill before it is handed out, and says how long it
    took; a pool that compiles nothing (the CPU's graphs: no capture) is not run to warm it."""
    decoder = specdec.load(model_dirs["llama"], model_dirs["llama-near"], backend="transformers", device="cpu",
                           dtype="float64", compile="aot_eager", slots=3)
    buckets = [b for b in BUCKETS if b <= decoder.target.capacity]
    assert set(decoder.target.compile_seconds) == {(rows, b, cells, 0) for rows in (1, 2, 4) for b in buckets
                                                   for cells in decoder.target.reads if cells >= b}
    assert set(decoder.drafter.draft_model.compile_seconds) == set(decoder.target.compile_seconds)
    assert "the target's forwards compiled in" in capsys.readouterr().err
    plain = specdec.load(model_dirs["llama"], backend="transformers", device="cpu", compile="graphs", plain=True)
    assert plain.target.compile_seconds == {} and "compiled" not in capsys.readouterr().err
    assert plain.target.warm_up(rows=4) == 0.0 and plain.target.compile_seconds == {}
    # warmed for 9 rows, as a GPU warms it (the CPU's graphs, uncaptured): a batch of 9 pads to 16 rows, and the
    # pool grows to those, not to twice what it held whenever a sequence found it full
    monkeypatch.setattr(StaticHFModel, "compiles", property(lambda self: True))
    pool = plain.target.pool
    assert pool.rows < 16 and plain.target.warm_up(rows=9, tokens=(1,)) > 0 and pool.rows == 16


def test_a_pool_the_gpu_cannot_hold_is_refused_by_name(monkeypatch):
    """Its size against the device's free memory, before anything is allocated: what to lower, not an
    out-of-memory traceback. (An 8B shape's layer: 8 key heads of 128, bfloat16.)"""
    from specdec.runtime.static import _Pool

    layout = [((1, 8, 1, 128), (1, 8, 1, 128), torch.bfloat16)] * 32
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2_000_000_000, 80_000_000_000))
    with pytest.raises(SpecDecError, match=r"the static pool \(21 rows × 4112 cells of keys and values\) needs "
                                           r"11\.3 GB and 2\.0 GB of cuda are free: lower --context or --slots"):
        _Pool(layout, rows=21, cells=4112, device=torch.device("cuda"), sliding=[False] * 32)
    assert _Pool(layout, rows=1, cells=16, device=torch.device("cpu"), sliding=[False] * 32).bytes(21) == 21 * 16 * (32 * 4096 + 8)


class FakeCuda:
    """torch.cuda's streams as they behave, without a GPU: a stream belongs to the device it is made on (the
    current device unless named); `stream(s)` makes s current on its device until it is left; `graph`
    captures the kernels launched on its capture stream (one of the current device unless given), and a
    capture that fails leaves its stream current (torch ends the capture before it leaves the stream);
    the sync debug mode makes a wait on the device raise. `ran`: for each forward, the stream current on
    the pool's device (its kernels go there) and the stream capturing, if any. `waits`: where the forward
    waits on the device ("always", "in capture": something the debug mode does not see; None: never)."""

    def __init__(self, monkeypatch, pool_device: torch.device, waits: str | None = None):
        self.current_device, self.pool_device, self.waits = torch.device("cuda", 0), pool_device, waits
        self.current: dict[torch.device, object] = {}
        self.capturing, self.captures, self.ran, self.mode = None, 0, [], 0
        for name in ("Stream", "current_stream", "stream", "graph", "CUDAGraph", "graph_pool_handle",
                     "get_sync_debug_mode", "set_sync_debug_mode"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def Stream(self, device=None):
        stream = type("Stream", (), {"wait_stream": lambda self, other: None})()
        stream.device = torch.device(device) if device is not None else self.current_device
        return stream

    def current_stream(self, device=None):
        device = torch.device(device) if device is not None else self.current_device
        return self.current.setdefault(device, self.Stream(device))

    @contextlib.contextmanager
    def stream(self, stream):
        previous = self.current_stream(stream.device)
        self.current[stream.device] = stream
        try:
            yield
        finally:
            self.current[stream.device] = previous

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None):
        self.capturing = stream if stream is not None else self.Stream()
        self.captures += 1
        previous = self.current_stream(self.capturing.device)
        self.current[self.capturing.device] = self.capturing
        try:
            yield
        except RuntimeError:
            self.capturing = None  # the capture's end fails, and its stream stays current
            raise
        self.current[self.capturing.device] = previous
        self.capturing = None

    def CUDAGraph(self):
        return type("CUDAGraph", (), {"replay": lambda self: None})()

    def graph_pool_handle(self):
        return None

    def get_sync_debug_mode(self):
        return self.mode

    def set_sync_debug_mode(self, mode):
        self.mode = mode

    def forward(self, *inputs):
        if self.waits == "always" and self.mode == "error" or self.waits == "in capture" and self.capturing:
            raise RuntimeError("a synchronizing CUDA operation")
        self.ran.append((self.current_stream(self.pool_device), self.capturing))
        return torch.zeros(1)


def test_a_pool_on_a_second_gpu_captures_its_graphs_there(monkeypatch):
    """A pool on cuda:1 while cuda:0 is current: its graphs' warm-up runs and capture run on streams of
    cuda:1. On a stream of the current device a capture records none of the forward's kernels, and every
    replay returns the capture's output again. (torch.cuda faked: `FakeCuda`.)"""
    from specdec.runtime.static import _Graphs, _Uploader

    cuda = FakeCuda(monkeypatch, torch.device("cuda", 1))
    graphs = _Graphs(cuda.forward, _Uploader(torch.device("cpu")), capture_on=cuda.pool_device)
    graphs(torch.arange(7), (1, 1, 1), cache=None)
    (*warm_ups, (stream, capturing)) = cuda.ran
    assert capturing is not None and stream is capturing  # the forward's kernels were captured
    default = cuda.current_stream(cuda.pool_device)
    assert warm_ups and all(s.device == cuda.pool_device and s is not default and not c for s, c in warm_ups)


@pytest.mark.parametrize("waits", ["always", "in capture"])
def test_a_forward_that_waits_on_the_device_runs_without_a_graph(monkeypatch, capsys, waits):
    """A forward that waits on the device cannot be captured: one whose warm-up waits (the sync debug mode
    raises there) never begins a capture, which would leave torch's allocator counting one under way; one
    whose capture fails leaves the pool's device on its own stream. Either shape then runs eagerly, said
    on stderr, the debug mode as it was."""
    from specdec.runtime.static import _Graphs, _Uploader

    cuda = FakeCuda(monkeypatch, torch.device("cuda", 1), waits=waits)
    default = cuda.current_stream(cuda.pool_device)
    graphs = _Graphs(cuda.forward, _Uploader(torch.device("cpu")), capture_on=cuda.pool_device)
    for _ in range(2):
        graphs(torch.arange(7), (1, 1, 1), cache=None)
    assert "runs without a CUDA graph" in capsys.readouterr().err
    assert cuda.current_stream(cuda.pool_device) is default and cuda.mode == 0
    eager = cuda.ran[-2:]  # each call's forward, on the default stream, nothing capturing
    assert all(stream is default and capturing is None for stream, capturing in eager)
    assert cuda.captures == (waits == "in capture")  # begun only where the warm-up could not tell


def test_models_the_static_slots_cannot_take_are_refused_by_name():
    from transformers import LlamaConfig, MambaConfig

    longrope = LlamaConfig(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                         "original_max_position_embeddings": 32}, hidden_size=16, num_attention_heads=2)
    assert "longrope" in static_refusal(longrope)
    assert "recurrent" in static_refusal(MambaConfig())
    assert static_refusal(LlamaConfig()) is None
    assert BUCKETS[0] == 1 and list(BUCKETS) == sorted(BUCKETS)


def test_logprobs_from_device_logits_equal_the_eager_paths(static_llama, load64, model_dirs):
    eager = load64(model_dirs["llama"])
    near = specdec.ModelDrafter(load64(model_dirs["llama-near"]))
    results = [specdec.SpeculativeDecoder(model, near, gamma=3).generate(PROMPT, max_new_tokens=12, temperature=0, logprobs=3)
               for model in (static_llama, eager)]
    assert results[0].tokens == results[1].tokens
    for mine, theirs in zip(results[0].logprobs, results[1].logprobs):
        assert mine.token == theirs.token and mine.logprob == pytest.approx(theirs.logprob, abs=1e-9)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_the_cost_curve_times_forwards_as_decoding_runs_them(static_llama, monkeypatch):
    """On the pool the timed forwards leave their logits on the device, as the engine does (a copy
    of k rows of logits to the host is not what a verify pays)."""
    from specdec import profiling

    asked = []
    forward = StaticHFModel.forward_batch
    monkeypatch.setattr(StaticHFModel, "forward_batch", lambda self, feeds: asked.extend(f.on_device for f in feeds) or forward(self, feeds))
    curve, rounds, _ = profiling.measure_curve(static_llama, sizes=(1, 2, 4), max_rounds=1)
    assert set(curve) == {1, 2, 4} and all(seconds > 0 for seconds in curve.values()) and rounds == 1
    assert asked[0] is False and set(asked[1:]) == {True}  # the prefix's logits come back; the timed ones stay


def test_a_prefix_cache_keeps_few_rows(static_llama):
    """Each kept sequence holds a whole row of the pool: a prefix cache keeps KEPT_ROWS of them."""
    from specdec.runtime.prefix import PrefixCache
    from specdec.runtime.static import KEPT_ROWS

    cache = PrefixCache(static_llama, 4096, min_shared=2)
    for i in range(KEPT_ROWS + 3):
        sequence = static_llama.sequence()
        sequence.forward([i % 16, 1, 2, 3])
        cache.put(sequence, [i % 16, 1, 2, 3, 4][:4])
    assert len(cache._kept) == KEPT_ROWS
