"""A transformers model on preallocated KV caches, its forwards compiled per shape (CUDA graphs on a GPU).

`HFModel` grows a DynamicCache per sequence and launches every kernel from Python: on a GPU a
one-token step then costs several times what reading the weights does. Here instead
- the model holds a *pool*: per layer, keys and values of `rows` sequences × `cells` entries,
  allocated once. A sequence owns a row; its entries are written in place (an index_put_ at their cell
  numbers) and rolled back by moving a count. The cell past the largest read bucket (`scratch`) is
  written by padding only and read by nothing;
- a forward over several sequences (the server's batch, or one alone) first swaps their rows into
  rows 0, 1, ... (a copy only when the batch changes), then runs on the pool's first `batch` rows:
  one view per batch bucket, so the graphs captured over it keep their addresses. New entries are
  padded to a token bucket (`BUCKETS`), rows to a batch bucket (`BATCHES`), the cells attention reads to a
  read bucket (`read_buckets`: powers of two up to the row; what the batch's rows hold, not the whole row),
  and each (batch, tokens, cells read) shape is compiled once: `torch.compile`, CUDA graphs on a GPU (on the
  static backend nothing is compiled, and nothing padded).
  A sliding-window layer (Gemma 2 and 3's local layers, Mistral's) reads its window alone where the read
  bucket is long (`window_read`: a gather of each row's last window + `WINDOW_SLACK` cells).
  Forwards of more new entries (a prefill chunk) run eagerly on the same pool;
- a forward's inputs are a few integers per row (`_Step`): tokens, positions and cells, each row's trunk,
  count of new entries and first cell a window reads, and the tree part of its mask (the few cells the host
  knows, 64 to a word of bits).
  They go up in one copy through a pinned buffer without waiting, straight into a graph's own
  input buffer; everything else happens inside the captured forward (`step_forward`): each cell's
  position recorded, the attention mask built from those integers (and, for sliding windows, the cells'
  positions), the model run. A step launches one upload and one replay;
- the logits stay on the device when the caller asks (`Feed.on_device`): the engine then reads one small
  tensor per iteration (the argmax path, or the sampling distribution) and nothing else waits for the device.

Invariant (with `entries.SequenceEntries`'): entry i of a sequence sits in cell i of its row, with its own position,
which is at most i (so a window by position starts at a cell at most its first position).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import weakref

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec import tree
from specdec.errors import SpecDecError
from specdec.runtime import base
from specdec.runtime.fused import FusedForward, allow_compiled_shapes, fused_refusal, read_cells, write_cells
from specdec.runtime.hf import HFModel, HFSequence, as_float, longrope_switch, named_tree_refusal

BUCKETS = (1, 4, 16, 64)  # new entries per compiled forward; verify trees and chains pad up to these
BATCHES = (1, 2, 4, 8, 16, 32)  # rows per compiled forward; a server's batch pads up to these
DEFAULT_CONTEXT = 4096  # cells per row unless asked
# the fewest cells per row a forward reads: attention reads the read bucket holding every cell its rows use (powers of
# two from here up to the row, `read_buckets`), as each one's bytes count: an 8B model's 4096-cell row is 512 MB, and a
# step of 16 such rows read 8.6 GB of keys and values beside 16 GB of weights, whatever the rows held
SMALLEST_READ = 512
# the cells past its window a sliding-window layer's read leaves room for: a forward's new entries and a tree's
# uncommitted ones (a chain step, a verify of up to 64, a prefill chunk of 128 each fit; more reads the read bucket)
WINDOW_SLACK = 128
# finished sequences a prefix cache keeps here: each holds a whole row (512 MB for an 8B model at 4096 cells)
KEPT_ROWS = 4
# graphs: each shape captured by hand as a CUDA graph (`_Graphs`; on the CPU the same buffers, replayed
# eagerly); inductor: torch.compile's generated kernels, CUDA graphs on a GPU ("reduce-overhead");
# aot_eager: traced by torch.compile, run eagerly (tests); static: the pool alone, nothing compiled nor padded (each
# forward as it comes, as a prefill chunk runs everywhere: `pads`)
COMPILE_BACKENDS = ("graphs", "inductor", "aot_eager", "static")


class StaticHFModel(HFModel):
    """An HFModel whose sequences live in rows of a static pool, with compiled forwards per shape."""

    device_logits = True
    spare_sequences = KEPT_ROWS
    window_reads = True  # sliding layers read their window alone where it pays (False: as the others; a benchmark's)

    def __init__(self, model, tokenizer, path: str = "", context: int | None = None, backend: str = "graphs",
                 rows: int = 2, fused: bool | None = None):
        """fused: the model's forward as `fused.FusedForward` where it covers the model (None: as the
        environment's SPECDEC_FUSED says, by default on a GPU; see `_why_unfused`)."""
        super().__init__(model, tokenizer, path)
        if backend not in COMPILE_BACKENDS:
            raise SpecDecError(f"unknown compile backend {backend!r}; choose one of {', '.join(COMPILE_BACKENDS)}")
        refusal = static_refusal(model.config)
        if refusal:
            raise SpecDecError(f"{path}: no static cache for this model ({refusal}); run it with compile off")
        self.capacity = self.max_length = min(self.max_length, context or DEFAULT_CONTEXT)
        self.compile_backend = backend
        self.reads = read_buckets(self.capacity)
        # padding writes the scratch cell, past every read bucket: no forward reads it. The row holds 16 cells more
        # (attention kernels pad a mask that is not a multiple of 16, every layer, every step); past the scratch
        # cell they are never written nor read
        self.scratch = self.reads[-1]
        # rows for the finished sequences a prefix cache keeps (KEPT_ROWS) from the start: a pool that grew later
        # would capture every graph again (a GPU check found the default paying for it inside its verifies)
        layout = _cache_layout(self)
        self.pool = _Pool(layout, max(1, rows) + KEPT_ROWS, self.scratch + 16, self.torch_device,
                          self._sliding_layers(len(layout)))
        # who holds each row, weakly: a sequence dropped without release() gives its row back (a prefix
        # cache's kept ones, once the last decoder sharing it is gone), as llama.cpp's give their cells back
        self._holders: list[weakref.ref[StaticSequence] | None] = [None] * self.pool.rows
        self._runner = None
        # (rows, tokens, cells read, cells a sliding layer reads or 0) -> its first forward's seconds
        self.compile_seconds: dict[tuple[int, ...], float] = {}
        self._upload = _Uploader(self.torch_device)
        refusal = fused_refusal(model)
        if fused and refusal:
            raise SpecDecError(f"{path}: no fused forward ({refusal})")
        self.unfused_because = _why_unfused(fused, refusal, self.on_gpu)
        # Inductor's kernels for its elementwise steps on a GPU (static: nothing compiled); as written elsewhere
        # (what the tests check)
        self.fused = None if self.unfused_because else FusedForward(model, compiled=self.on_gpu and self.pads)

    @property
    def states_kind(self) -> tuple[int, ...] | str | None:
        """What a forward returns beside its logits, part of a compiled shape's key (its graph's second
        output): None, "norm" (the final norm's rows) or the layers whose inputs it gives."""
        return self.state_layers or ("norm" if self.keeps_states else None)

    def _sliding_layers(self, count: int) -> list[bool]:
        """Which of the `count` layers attend within the sliding window (`layer_masks` gives them their own mask).
        None of them where the layer types do not name each cache layer (layers sharing caches): all read the bucket."""
        types = getattr(self.model.config, "layer_types", None) or ["sliding_attention"] * count
        if self.sliding_window is None or len(types) != count:
            return [False] * count
        return [kind == "sliding_attention" for kind in types]

    def _window_cells(self, placed, reads: int) -> int:
        """The cells each sliding layer reads in a forward over `placed` reading `reads` cells a row (`window_read`),
        or 0 (it reads them too) where some row's window and new cells do not fit (a large tree, a long chunk)."""
        window = self.sliding_window
        cells = window_read(window, reads) if self.window_reads and any(self.pool.sliding) else 0
        fits = cells and all(feed.sequence.cache_len + len(tokens) - first_in_window(positions, window) <= cells
                             for feed, tokens, positions, _ in placed)
        return cells if fits else 0

    def sequence(self) -> StaticSequence:
        free = self._free_rows()
        if not free:  # a sequence dropped in a reference cycle holds its row until collected: cheaper than a growth
            gc.collect()
            free = self._free_rows()
        if not free:
            self._grow(2 * self.pool.rows)
            free = self._free_rows()
        sequence = StaticSequence(self, free[0])
        self._holders[sequence.row] = weakref.ref(sequence)
        return sequence

    def _holder(self, row: int) -> StaticSequence | None:
        held = self._holders[row]
        return None if held is None else held()

    def _free_rows(self) -> list[int]:
        return [row for row in range(len(self._holders)) if self._holder(row) is None]

    def describe(self) -> str:
        forward = "fused forward" if self.fused else f"transformers' forward ({self.unfused_because})"
        return (f"{super().describe()[:-1]}, static cache of {self.capacity}, compiled with {self.compile_backend}, "
                f"{forward})")

    @property
    def pads(self) -> bool:
        """Whether a forward of up to the largest bucket's tokens and batch is padded to a compiled shape: on every
        backend but static, whose forwards run as they come (padding would be work for nothing: a verify of 9
        tokens computed 16, and Gemma's 262k-wide output product for each)."""
        return self.compile_backend != "static"

    @property
    def compiles(self) -> bool:
        """Whether a shape's first forward compiles (Inductor, a trace) or captures (a CUDA graph) something."""
        return self.compile_backend in ("inductor", "aot_eager") or (self.compile_backend == "graphs" and self.on_gpu)

    def warm_up(self, rows: int = 1, tokens: tuple[int, ...] = BUCKETS, reads: tuple[int, ...] | None = None) -> float:
        """Compile (capture) now the shapes of batches of up to `rows` sequences (their batch buckets), these
        token buckets and read buckets (None: every one), rather than on first use; the seconds it took (0.0:
        nothing compiles here)."""
        if not self.compiles:
            return 0.0
        started = time.perf_counter()
        top = next((b for b in BATCHES if b >= rows), BATCHES[-1])  # past the largest, batches run eagerly
        shapes = [(batch, bucket, cells) for batch in BATCHES if batch <= top for bucket in tokens
                  if bucket <= self.capacity for cells in (self.reads if reads is None else reads) if cells >= bucket]
        free = len(self._free_rows())
        if free < top:  # grown to what the batch needs (a sequence asked of a full pool doubles it)
            self._grow(self.pool.rows + top - free)
        sequences = [self.sequence() for _ in range(top)]  # before any capture: a pool that grows captures again
        try:
            for batch, bucket, cells in tqdm(shapes, desc="compiling the pool's forwards", unit="shape", leave=False,
                                             file=sys.stderr, disable=not self.on_gpu):
                # Inductor's graph trees record on the second or third call (hand capture: the first)
                for _ in range(3):
                    self._forward([base.Feed(s, [0] * bucket) for s in sequences[:batch]], reads=cells)
                    for sequence in sequences[:batch]:
                        sequence.truncate(0)
        finally:
            for sequence in sequences:
                sequence.release()
        base.synchronize(self.torch_device)
        return time.perf_counter() - started

    def forward_batch(self, feeds: list[base.Feed]) -> list[torch.Tensor]:
        """Every feed's new entries in one forward over the pool's first rows (see the module docstring)."""
        return self._forward(feeds)

    @torch.inference_mode()
    def _forward(self, feeds: list[base.Feed], reads: int = 0) -> list[torch.Tensor]:
        """forward_batch's, its attention reading at least `reads` cells a row (the warm-up's read buckets)."""
        base.check_distinct(feeds)
        if any(feed.sequence.owner is not self for feed in feeds):
            raise ValueError("a batched forward takes sequences of its own model only")
        if any(feed.sequence.released for feed in feeds):
            raise ValueError("a released sequence cannot be fed: its row may be another's now")
        placed = [(feed, *feed.sequence.place(feed.tokens, feed.parents)) for feed in feeds]
        longest = max(len(tokens) for _, tokens, _, _ in placed)
        # padded to a compiled shape (rows, tokens, cells read, window read), run by `runner`; else as it comes
        padded = self.pads and longest <= BUCKETS[-1] and len(feeds) <= BATCHES[-1]
        tokens_bucket = _bucket(longest) if padded else longest
        rows = next(b for b in BATCHES if b >= len(feeds)) if padded else len(feeds)
        if rows > self.pool.rows:
            self._grow(rows)
        self._to_first_rows([feed.sequence for feed in feeds])
        by_row = sorted(placed, key=lambda entry: entry[0].sequence.row)  # row r of the forward is the pool's row r
        # every cell a row's entries may see lies below its own count once these are written
        used = max(reads, *(feed.sequence.cache_len + len(tokens) for feed, tokens, _, _ in placed))
        reads = next(cells for cells in self.reads if cells >= used)
        cache = self.pool.cache(rows, reads, self._window_cells(placed, reads))
        inputs, shape = _Step.of(self, by_row, rows, tokens_bucket, cache)
        began = time.perf_counter()
        if padded:
            compiled_shape = (rows, tokens_bucket, cache.reads, cache.window)
            first = compiled_shape not in self.compile_seconds
            out = self.runner()(inputs, shape, cache, self.states_kind)
            if first:
                base.synchronize(self.torch_device)
                self.compile_seconds[compiled_shape] = time.perf_counter() - began
            return self._results(placed, out)
        # a forward as it comes (a prefill chunk; on a pool that compiles nothing, every forward) computes the
        # output product for the tokens its feeds want only: a prompt's chunk wants its last (Gemma's 262k-wide
        # product for 128 tokens cost more than its layers); a model without transformers' logits_to_keep
        # computes every token's
        skipped = min(len(tokens) - base.wanted_count(feed.last, len(tokens)) for feed, tokens, _, _ in placed)
        if self.fused is None and not self.takes_logits_to_keep:
            skipped = 0
        # a step's few queries on a pool that pads nothing take a step's kernels (a padded pool's would compile
        # them for this shape)
        bucketed = not self.pads and longest <= BUCKETS[-1]
        out = self.step_forward(*self._uploaded(inputs, shape), cache, self.states_kind, bucketed=bucketed,
                                keep=tokens_bucket - skipped if skipped else None)
        return self._results(placed, out, skipped)

    def _results(self, placed, out, skipped: int = 0) -> list[torch.Tensor]:
        """Each feed's wanted rows of logits (the tokenizer's columns, float32 or float64), in feed
        order, and of states (on its sequence, or None), from the forward's output `out` (logits, or
        with states kept (logits, states); its logits start at token `skipped`); its entries committed.
        Copies: a CUDA graph's outputs are overwritten by its next replay."""
        logits, states = out if self.keeps_states else (out, None)  # [rows, bucket, vocab], [rows, bucket, width]
        wanted, kept = [], []  # per feed: [rows, vocab], [rows, width] or None
        for feed, tokens, positions, all_parents in placed:
            n, row = len(tokens), feed.sequence.row
            count = base.wanted_count(feed.last, n)
            wanted.append(as_float(logits[row, n - count - skipped: n - skipped, : self.vocab_size]))
            kept.append(None if states is None else as_float(states[row, self.state_rows(n, count, skipped)]))
            feed.sequence.commit(tokens, positions, all_parents)
        host = [i for i, (feed, *_) in enumerate(placed) if not feed.on_device]
        if host:  # one copy to the host for every feed that wants its logits (and states) there
            copied = _to_host([wanted[i] for i in host] + [kept[i] for i in host if kept[i] is not None])
            for i, rows in zip(host, copied):
                wanted[i] = rows
            for i, rows in zip(host, copied[len(host):]):  # none while states are off
                kept[i] = rows
        for (feed, *_), rows in zip(placed, kept):
            feed.sequence.states = rows if rows is None or not feed.on_device else _own(rows, states)
        return [rows if not feed.on_device else _own(rows, logits) for rows, (feed, *_) in zip(wanted, placed)]

    def runner(self):
        """The compiled forward: (a `_Step`'s host inputs, its shape, cache, states kind) -> its output, one
        graph or compiled entry per shape, made on its first call."""
        if self._runner is None:
            self._runner = self._compiled()
        return self._runner

    def _compiled(self):
        if not self.pads:
            raise ValueError("a static pool compiles nothing: its forwards run as they come, with no runner")
        if self.compile_backend == "graphs":
            return _Graphs(self.step_forward, self._upload,
                           capture_on=self.torch_device if self.torch_device.type == "cuda" else None)
        allow_compiled_shapes()  # every model's every shape is an entry of `step_forward`'s code
        inductor = self.compile_backend == "inductor"
        mode = "reduce-overhead" if inductor and self.torch_device.type == "cuda" else None
        step = torch.compile(self.step_forward, mode=mode, dynamic=False, backend=self.compile_backend)
        return lambda inputs, shape, cache, states: step(*self._uploaded(inputs, shape), cache, states)

    def _uploaded(self, inputs: torch.Tensor, shape: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
        """A `_Step`'s host inputs on the device, as `_Step.views` (a forward without a graph's own buffer)."""
        return _Step.views(self._upload([inputs]), shape)

    def step_forward(self, tokens, positions, slots, trunks, counts, starts, tree, cache, states=None,
                     bucketed: bool = True, keep: int | None = None):
        """A forward from its `_Step`'s inputs on the device alone (what a graph captures): the new cells'
        positions recorded, the mask built, the model run. -> `_forward_logits`'s output."""
        self.pool.positions[: tokens.shape[0]].scatter_(1, slots, positions)  # before the mask: windows compare them
        cache.slots = slots
        cache.columns = starts[:, None] + self.pool.index[: cache.window] if cache.window else None
        mask = _Step.mask(self, trunks, counts, tree, positions, cache)
        return self._forward_logits(tokens, positions, mask, cache, states, bucketed, keep)

    def _forward_logits(self, tokens, positions, mask, cache, states=None, bucketed: bool = True,
                        keep: int | None = None):
        """The logits [rows, tokens, vocab] (of the last `keep` tokens where given); with states (their kind,
        `states_kind`), (logits, the states [rows, tokens, width]). bucketed: a step's few queries (a compiled
        shape, or one as it comes on a pool that pads nothing), else a prefill chunk's many."""
        if self.fused is not None:
            return self.fused(tokens, positions, mask, cache, states, bucketed, keep)
        kept = {} if keep is None else {"logits_to_keep": keep}  # given only to models that take it
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                         **{self.cache_keyword: cache}, **kept)
        return (out.logits, self.taken_states()) if states else out.logits

    def _to_first_rows(self, sequences: list[StaticSequence]) -> None:
        """Swap rows so that the sequences hold rows 0 .. len - 1, moving only those outside them
        (a batch that lost a row moves one sequence, not every one after it)."""
        count = len(sequences)
        free = iter(sorted(set(range(count)) - {s.row for s in sequences}))
        for sequence in [s for s in sequences if s.row >= count]:
            target = next(free)
            other = self._holder(target)
            self.pool.swap(target, sequence.row)
            self._holders[target], self._holders[sequence.row] = self._holders[sequence.row], self._holders[target]
            if other is not None:
                other.row = sequence.row
            sequence.row = target

    def _grow(self, rows: int) -> None:
        """More rows (the pool is reallocated; graphs are captured again over the new one)."""
        self.pool.grow(rows)
        self._holders += [None] * (self.pool.rows - len(self._holders))
        self._runner = None

    def _release(self, sequence: StaticSequence) -> None:
        self._holders[sequence.row] = None


class StaticSequence(HFSequence):
    """One sequence in a row of the pool. The bookkeeping (tokens, positions, parents, trunk) is
    `SequenceEntries`'; the cache is the row's, so rollback and compaction are device index operations."""

    def __init__(self, owner: StaticHFModel, row: int):
        super().__init__(owner)
        self._cache = None
        self.row = row
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.owner._release(self)
        self.released = True

    def forward(self, tokens, parents=None, last: int | None = None, on_device: bool = False) -> torch.Tensor:
        """As `CachedSequence.forward`; on_device: the logits stay on the model's device."""
        return self.owner.forward_batch([base.Feed(self, tokens, parents, last, on_device)])[0]

    @torch.inference_mode()
    def keep(self, start: int, indices: list[int]) -> None:
        self._check_held()
        indices = self.kept_path(start, indices)
        if indices != list(range(start, start + len(indices))):  # a chain's path is already in place
            self.owner.pool.move(self.row, self.owner._upload([indices]), start)
        self.keep_entries(start, indices)

    @torch.inference_mode()
    def fork(self, length: int) -> StaticSequence:
        self._check_held()
        self.check_fork(length)
        other = self.owner.sequence()
        self.owner.pool.copy(self.row, other.row, length)  # after sequence(): a grown pool moved nothing but addresses
        self.share_entries(other, length)
        return other

    def _check_held(self) -> None:
        if self.released:
            raise ValueError("a released sequence cannot be used: its row may be another's now")

    def cache_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n, row = self.cache_len, self.row
        return [(keys[row : row + 1, :, :n], values[row : row + 1, :, :n])
                for keys, values in zip(self.owner.pool.keys, self.owner.pool.values)]


class _Step:
    """One forward's inputs, built on the host as one row of integers: tokens, positions and cells
    [rows, bucket], each row's trunk, count of new entries and first cell its sliding layers read (0 where they
    read as the others do) [rows], and the tree part of its mask as bits,
    column j of entry i bit j % 64 of word [r, i, j // 64] ([rows, bucket, words], words a power of two: a
    graph per (rows, bucket, words); one word holds a target's verify and a draft tree of up to 64 cells)."""

    @staticmethod
    def of(owner: StaticHFModel, placed, rows: int, bucket: int, cache: SlotCache) -> tuple[torch.Tensor, tuple]:
        """(the inputs end to end [host int64], their shape (rows, bucket, words)), for a forward over `cache`."""
        scratch, window = owner.scratch, cache.window
        tokens, positions, slots, trunks, counts, starts, seen = [], [], [], [], [], [], []
        for feed, row_tokens, row_positions, all_parents in placed:
            sequence, n = feed.sequence, len(row_tokens)
            start, trunk = sequence.cache_len, sequence._trunk
            pad = bucket - n
            tokens += row_tokens + [0] * pad
            positions += row_positions + [0] * pad
            slots += list(range(start, start + n)) + [scratch] * pad
            # each entry's cells from the trunk on, as one integer (bit j: cell trunk + j); a chain after a chain
            # (trunk == start): each entry sees the new ones up to itself (a shortcut: `ancestry_bits` gives the
            # same rows). Cells below `trunk` are seen whole: a tree cuts it where some new entry's path leaves the
            # chain earlier
            if sequence.continues_chain(all_parents, start, n):
                seen.append([(2 << i) - 1 for i in range(n)])
            else:
                trunk, bits = tree.ancestry_bits(all_parents, trunk, start, n)
                seen.append(bits)
            trunks.append(trunk)
            counts.append(n)
            # the window's cells within the read bucket: they hold every cell the row's sliding layers see
            starts.append(min(first_in_window(row_positions, owner.sliding_window), cache.reads - window)
                          if window else 0)
        padding = rows - len(placed)  # padding rows: other sequences' rows (or free ones), scratch only
        tokens += [0] * bucket * padding
        positions += [0] * bucket * padding
        slots += [scratch] * bucket * padding
        trunks += [0] * padding
        counts += [0] * padding
        starts += [0] * padding
        widest = max((entry.bit_length() for entries in seen for entry in entries), default=1)
        words = 1 << (-(-max(1, widest) // 64) - 1).bit_length()
        bits = [word for entries in seen for entry in entries + [0] * (bucket - len(entries))
                for word in _words(entry, words)]
        inputs = torch.tensor(tokens + positions + slots + trunks + counts + starts + bits
                              + [0] * (padding * bucket * words))
        return inputs, (rows, bucket, words)

    @staticmethod
    def views(inputs: torch.Tensor, shape: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
        """The inputs (on the device) as (tokens, positions, slots, trunks, counts, starts, tree)."""
        rows, bucket, words = shape
        tokens, positions, slots, trunks, counts, starts, tree = inputs.split([rows * bucket] * 3 + [rows] * 3
                                                                              + [rows * bucket * words])
        return (tokens.view(rows, bucket), positions.view(rows, bucket), slots.view(rows, bucket), trunks, counts,
                starts, tree.view(rows, bucket, words))

    @staticmethod
    def mask(owner: StaticHFModel, trunks, counts, tree, positions, cache: SlotCache):
        """The model's attention mask(s) over the cells `cache` reads: a row's first `reads` cells, [rows, 1,
        bucket, reads], and for sliding layers reading their window its `columns`, [rows, 1, bucket, window].
        Entry j of row r sees its row's trunk (cells < trunk) and its ancestors from the trunk on (`tree`, [rows,
        bucket, words]: bit j of word w, cell trunk + 64 w + j); padding entries see the first cell read only
        (finite in every row: zeros or an entry's; what padding writes goes to the scratch cell, past every read
        bucket)."""
        rows, bucket, words = tree.shape
        reads, index, width = cache.reads, owner.pool.index, 64 * words
        cells = index[: reads + 1]  # and a column past them, where the tree part's columns beyond them land
        allowed = (cells[None, None, :] < trunks[:, None, None]).expand(rows, bucket, -1).clone()
        seen = ((tree[..., None] >> index[:64]) & 1).view(rows, bucket, width) != 0
        columns = (trunks[:, None, None] + torch.arange(width, device=tree.device)).clamp(max=reads)
        # beyond a row's span (the width's padding too): False, on cells it never sees or on the column past them
        allowed.scatter_(2, columns.expand(rows, bucket, width), seen)
        padding = (index[:bucket][None, :] >= counts[:, None])[:, :, None]

        def padded(allowed):  # padding entries see the first cell read
            return torch.where(padding, index[: allowed.shape[-1]] == 0, allowed)

        full = padded(allowed[..., :reads]), owner.pool.positions[:rows, :reads]  # windows by positions
        if cache.columns is None:
            return owner.layer_masks(*full, positions)
        columns = cache.columns  # [rows, window], below `reads`
        window = padded(allowed.gather(2, columns[:, None, :].expand(rows, bucket, -1)))
        return owner.layer_masks(*full, positions, sliding=(window, owner.pool.positions[:rows].gather(1, columns)))


def _words(bitset: int, words: int) -> list[int]:
    """A bitset as `words` int64s, 64 bits each, lowest first (bit 63 as int64's sign)."""
    out = []
    for _ in range(words):
        word, bitset = bitset & 0xFFFF_FFFF_FFFF_FFFF, bitset >> 64
        out.append(word - (1 << 64) if word >> 63 else word)
    return out


def read_buckets(capacity: int) -> tuple[int, ...]:
    """The cells a row's attention may read: `SMALLEST_READ` and its doubles below three quarters of `capacity`
    (a last one just under it would cost the compiled shapes of a bucket and save a few cells), then the
    capacity rounded up to 16 (attention kernels pad a mask otherwise). Each is a compiled shape of its own."""
    doubles = (SMALLEST_READ << k for k in range(max(1, capacity).bit_length()))
    return (*(cells for cells in doubles if 4 * cells < 3 * capacity), -(-capacity // 16) * 16)


def window_read(window: int | None, reads: int) -> int:
    """The cells a sliding-window layer reads where the others read `reads` a row: its window and `WINDOW_SLACK`
    cells more, rounded up to 16; 0 (it reads the `reads` cells too) where that is over a third of them, or it has no
    window. Reading a window gathers it, a copy: its cells read, written and read again."""
    if window is None:
        return 0
    cells = -(-(window - 1 + WINDOW_SLACK) // 16) * 16
    return cells if 3 * cells <= reads else 0


def first_in_window(positions: list[int], window: int) -> int:
    """The first cell a sliding layer may see from queries at `positions`: the window of the first position
    starts there, and every cell's position is at most its index (no queries: 0)."""
    return max(0, min(positions, default=0) - window + 1)


def _bucket(count: int) -> int:
    """The smallest bucket holding `count`, or count itself beyond the largest (a forward not compiled)."""
    return next((b for b in BUCKETS if b >= count), count)


class _Pool:
    """Keys and values of `rows` sequences × `cells` entries per layer, each cell's position, and
    per batch size a cache object over the first rows (views that keep their addresses)."""

    def __init__(self, layout: list, rows: int, cells: int, device: torch.device, sliding: list[bool]):
        """sliding: which layers read their window alone where a forward's cache reads windows."""
        self.layout, self.cells, self.device, self.sliding = layout, cells, device, sliding
        self.rows = 0
        self.grow(rows)
        # 0, 1, ...: over the cells and one past them, a bucket's entries, a word's bits
        self.index = torch.arange(max(cells + 1, BUCKETS[-1]), device=device)

    def bytes(self, rows: int) -> int:
        """What `rows` rows of keys, values and positions take."""
        row = sum((k[1] * k[3] + v[1] * v[3]) * dtype.itemsize for k, v, dtype in self.layout) + 8
        return rows * self.cells * row

    def grow(self, rows: int) -> None:
        """The pool reallocated with `rows` rows, the old rows copied in. A pool that would not fit in the
        device's free memory is refused by name (the old one, and its rows, stay as they were)."""
        self._check_room(rows)
        old = (self.keys, self.values, self.positions) if self.rows else None
        self.keys = [torch.zeros(rows, k[1], self.cells, k[3], dtype=dtype, device=self.device)
                     for k, _, dtype in self.layout]
        self.values = [torch.zeros(rows, v[1], self.cells, v[3], dtype=dtype, device=self.device)
                       for _, v, dtype in self.layout]
        self.positions = torch.zeros(rows, self.cells, dtype=torch.long, device=self.device)
        if old is not None:
            for new, previous in zip((*self.keys, *self.values, self.positions), (*old[0], *old[1], old[2])):
                new[: previous.shape[0]] = previous
        self.rows = rows
        self._caches: dict[tuple[int, int, int], SlotCache] = {}

    def _check_room(self, rows: int) -> None:
        if self.device.type != "cuda":
            return  # the CPU's memory is the machine's: an allocation that fails says so itself
        free, _ = torch.cuda.mem_get_info(self.device)
        # and what torch's allocator holds but no tensor uses: it allocates from that first
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        needed = self.bytes(rows)  # a grown pool is allocated before the old one is freed
        if needed > free:
            raise SpecDecError(f"the static pool ({rows} rows × {self.cells} cells of keys and values) needs "
                               f"{needed / 1e9:.1f} GB and {free / 1e9:.1f} GB of {self.device} are free: lower "
                               "--context or --slots, or run with --compile off")

    def cache(self, rows: int, reads: int, window: int = 0) -> SlotCache:
        """The first `rows` rows as a forward's cache, its attention reading their first `reads` cells, and its
        sliding layers `window` cells from each row's start (`window_read`; 0: `reads` cells too)."""
        key = (rows, reads, window)
        if key not in self._caches:
            keys, values = [k[:rows] for k in self.keys], [v[:rows] for v in self.values]
            # written in place inside the compiled forward: Inductor's CUDA graphs keep their addresses
            for tensor in (*keys, *values, self.positions):
                torch._dynamo.mark_static_address(tensor)
            self._caches[key] = SlotCache(keys, values, reads, window, self.sliding)
        return self._caches[key]

    def tensors(self):
        return (*self.keys, *self.values, self.positions)

    def swap(self, a: int, b: int) -> None:
        for tensor in self.tensors():
            tensor[[a, b]] = tensor[[b, a]]

    def move(self, row: int, source: torch.Tensor, start: int) -> None:
        """Cells `source` of a row to cells start, start + 1, ..."""
        end = start + source.numel()
        for tensor in (*self.keys, *self.values):
            tensor[row, :, start:end] = tensor[row].index_select(1, source)
        self.positions[row, start:end] = self.positions[row].index_select(0, source)

    def copy(self, source: int, target: int, length: int) -> None:
        for tensor in (*self.keys, *self.values):
            tensor[target, :, :length] = tensor[source, :, :length]
        self.positions[target, :length] = self.positions[source, :length]


class _Graphs:
    """Forwards captured as CUDA graphs by hand, one per (rows, tokens, tree words) shape: each has its own
    input buffer, which a step's inputs are uploaded into (`_Uploader`), and replays the whole forward
    (`StaticHFModel.step_forward`: positions, mask, model) from it; the weights and the pool are read where
    they are (torch.compile's "cudagraphs" backend instead copied every weight and the whole pool in as
    inputs before each replay). A shape whose forward cannot be captured (a host sync inside the
    model) runs eagerly, said once on stderr. capture_on: the pool's CUDA device, whose streams capture the
    graphs (it need not be the current device: cuda:1); None (the CPU): the same buffers, no graph."""

    def __init__(self, forward, upload: _Uploader, capture_on: torch.device | None):
        self.forward, self.upload, self.capture_on = forward, upload, capture_on
        self.shapes: dict[tuple, tuple] = {}  # shape -> (graph or None, input buffer, output)
        self.memory = torch.cuda.graph_pool_handle() if capture_on is not None else None

    def __call__(self, inputs: torch.Tensor, shape: tuple[int, int, int], cache, states=None):
        key = (shape, id(cache), states)  # with states (their kind) the graph has a second output
        if key not in self.shapes:
            buffer = torch.empty(inputs.numel(), dtype=torch.long, device=self.upload.device)
            self.upload([inputs], into=buffer)
            self.shapes[key] = self._record(buffer, shape, cache, states)
        else:
            self.upload([inputs], into=self.shapes[key][1])
        graph, buffer, output = self.shapes[key]
        if graph is None:
            return self.forward(*_Step.views(buffer, shape), cache, states)
        graph.replay()
        return output

    def _record(self, buffer, shape, cache, states):
        if self.capture_on is None:
            return None, buffer, None
        inputs = _Step.views(buffer, shape)
        # both streams of the pool's device: a capture on a stream of another (the current) device records
        # none of the forward's kernels, and every replay would return the capture's output again
        main, side = torch.cuda.current_stream(self.capture_on), torch.cuda.Stream(self.capture_on)
        side.wait_stream(main)
        try:
            # warm-up runs write what the replay writes (the same keys at the same cells); the second, compiled
            # already, must not wait on the device: a forward that does is never captured (a capture it broke
            # would leave torch's allocator counting a capture under way)
            with torch.cuda.stream(side):
                self.forward(*inputs, cache, states)
                with _syncs_refused():
                    self.forward(*inputs, cache, states)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()  # a replay runs on its capture stream's device (torch guards it)
            with torch.cuda.stream(side):  # left even where the capture's end fails (torch's own context is not)
                with torch.cuda.graph(graph, pool=self.memory, stream=side):
                    output = self.forward(*inputs, cache, states)
        except RuntimeError as error:
            main.wait_stream(side)
            print(f"specdec: a forward of shape {shape} runs without a CUDA graph: "
                  f"{' '.join(str(error).split())[:200]}",
                  file=sys.stderr)
            return None, buffer, None
        return graph, buffer, output


@contextlib.contextmanager
def _syncs_refused():
    """Any wait of the host on the device raises (torch's sync debug mode) inside, as a capture would fail."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _own(rows: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Rows of a forward's output as a tensor of their own (a graph's next replay overwrites its output): a
    copy, unless their conversion to float32 (from bfloat16, float16) made one already."""
    return rows.clone() if rows.dtype == output.dtype else rows


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host, in one copy."""
    copied = torch.cat([t.reshape(-1) for t in tensors]).cpu().split([t.numel() for t in tensors])
    return [rows.view(t.shape).to(t.dtype) for rows, t in zip(copied, tensors)]


class SlotLayer(CacheLayerMixin):
    is_compileable = True
    supports_early_init = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, reads: int):
        """reads: the cells its attention reads a row (a window's, or the first ones)."""
        super().__init__()
        self.keys, self.values, self.reads, self.is_initialized = keys, values, reads, True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError  # SlotCache.update writes at its slots

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.reads, 0

    def get_seq_length(self) -> int:
        return 0  # not used: positions and the 4-D mask are always given

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """Rows of the pool as transformers sees them: `update` writes each row's new keys and values at
    its cells (`slots`, [rows, n], set before each forward) and returns the cells its attention reads: the rows'
    first `reads`, or a sliding layer's window (`columns` [rows, window], set before each forward where
    `window`); the mask hides the rest."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], reads: int, window: int,
                 sliding: list[bool]):
        """window: the cells of its window each `sliding` layer reads (0: the first `reads`, as the others)."""
        windowed = [bool(window) and slides for slides in sliding]
        super().__init__(layers=[SlotLayer(k, v, window if reads_window else reads)
                                 for k, v, reads_window in zip(keys, values, windowed)])
        self.reads, self.window, self.windowed = reads, window, windowed
        self.slots: torch.Tensor | None = None
        self.columns: torch.Tensor | None = None
        # [rows, 1] beside slots [rows, n]
        self.row_index = torch.arange(keys[0].shape[0], device=keys[0].device)[:, None]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [rows, heads, n, head dim], written at cells slots[r, j] of row r
        in place (`fused.write_cells`); returns the cells the layer reads of its rows (`fused.read_cells`)."""
        keys, values, row_index, slots, reads, columns = self.cells(layer_idx)
        write_cells(keys, row_index, slots, key_states)
        write_cells(values, row_index, slots, value_states)
        return read_cells(keys, reads, columns), read_cells(values, reads, columns)

    def cells(self, layer_idx: int) -> tuple:
        """A layer's pool rows (keys, values: [rows, kv heads, cells, d]), where this forward writes in
        them and what it reads: (keys, values, row_index [rows, 1], slots [rows, n], reads, its window's
        columns [rows, window] or None)."""
        layer = self.layers[layer_idx]
        columns = self.columns if self.windowed[layer_idx] else None
        return layer.keys, layer.values, self.row_index, self.slots, self.reads, columns


class _Uploader:
    """Integers to the device without waiting for it: through one pinned buffer, reused only once its
    previous copy is done (on the CPU, plain tensors)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def __call__(self, parts: list, into: torch.Tensor | None = None) -> torch.Tensor:
        """The parts (lists of ints, int64 host tensors) end to end on the device [total]: in the first
        elements of `into`, else in a new tensor."""
        flat = torch.cat([torch.as_tensor(part, dtype=torch.long).reshape(-1) for part in parts])
        n = flat.numel()
        if self.device.type != "cuda":
            return flat if into is None else into[:n].copy_(flat)
        if self._copied is not None:
            self._copied.synchronize()
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(max(2 * n, 4096), dtype=torch.long, pin_memory=True)
        self._staging[:n] = flat
        target = into[:n] if into is not None else torch.empty(n, dtype=torch.long, device=self.device)
        target.copy_(self._staging[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return target


def _why_unfused(fused: bool | None, refusal: str | None, on_gpu: bool) -> str | None:
    """Why a pool runs transformers' forward, or None for the fused one. fused: asked for (True), not
    (False), or as SPECDEC_FUSED says: "auto" (unset: on a GPU), "on" (the CPU too) or "off" (the escape
    hatch, should the fused forward ever fail a model it claims)."""
    if fused is False:
        return "not asked for"
    if refusal is not None:
        return refusal
    if fused:
        return None
    setting = os.environ.get("SPECDEC_FUSED", "auto").strip().lower()
    if setting not in ("auto", "on", "off"):
        raise SpecDecError(f"SPECDEC_FUSED={setting!r}: choose auto, on or off")
    if setting == "off":
        return "turned off by SPECDEC_FUSED=off"
    if setting == "auto" and not on_gpu:
        return "fused on GPUs only, unless asked for (SPECDEC_FUSED=on)"
    return None


def static_refusal(config) -> str | None:
    """Why a model cannot run on static slots, or None."""
    tree = named_tree_refusal(config)
    if tree:
        return f"its masks are not exact ({tree})"
    if longrope_switch(config) is not None:
        return "longrope recomputes the whole cache when the context passes its switch"
    if config.model_type in ("mamba", "mamba2", "jamba", "falcon_mamba", "zamba", "bamba", "recurrent_gemma", "lfm2",
                             "qwen3_next"):
        return "its layers keep recurrent state, not keys and values"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    return None


def _cache_layout(model: HFModel) -> list:
    """Each layer's key and value shapes and dtype, from one eager forward of one token."""
    cache = DynamicCache()
    with torch.inference_mode():
        tokens = torch.zeros(1, 1, dtype=torch.long, device=model.torch_device)
        model.model(input_ids=tokens, use_cache=True, **{model.cache_keyword: cache})
    layout = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or keys.dim() != 4:
            raise SpecDecError(f"{model.path}: a cache layer of {type(layer).__name__} holds no keys and values")
        layout.append((tuple(keys.shape), tuple(values.shape), keys.dtype))
    return layout

