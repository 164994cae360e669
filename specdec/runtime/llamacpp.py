"""A GGUF model on llama.cpp (through llama-cpp-python's low-level bindings) behind the runtime protocol.

Sequences and trees map onto llama.cpp's sequence ids in one unified KV cache (`kv_unified`, so
copying a sequence id onto cells is bookkeeping, not a copy of keys and values):

- A *branch* is a sequence id whose cells are exactly one root-to-tip path: positions 0..tip, one
  cell each. A sequence slot starts with one branch, its *base*, which holds the committed text.
- A new entry extends its parent's branch when the parent is that branch's tip; otherwise it opens a
  branch: the path down to the deepest cached ancestor is copied onto a fresh id (`seq_cp` over
  positions 0..that ancestor), and every new ancestor in the same batch carries the id too.
- A token's first id is its own branch, and llama.cpp attends from a token to the cells holding its
  first id at positions up to its own: exactly its ancestors and itself. All branches of a batch
  agree below the batch (they were copied from the same cells), which llama.cpp requires of
  sequence ids that share a token.
- `keep` puts the base id on the accepted path (`seq_cp` from the path's branch), drops the base's
  other cells and every other branch (`seq_rm`); freed cells are reused.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from specdec.errors import SpecDecError
from specdec.runtime import base, cpu_head
from specdec.config import OUTPUT_LAYERS
from specdec.runtime.entries import SequenceEntries
from specdec.runtime.prefix import make_room
from specdec.runtime.llama_lib import (GGUFTokenizer, Weights, bindings, buffer_text, check_gguf_file, clear_log,
                                       last_log, untiled_matmuls)

MAX_SEQUENCE_IDS = 128  # branch ids shared by all sequences of a model (llama.cpp reserves logits rows for as many)
DEFAULT_CONTEXT = 4096  # positions per sequence unless asked (the training context when shorter)
# tokens (and logits rows: llama.cpp keeps vocab x BATCH floats) per llama_decode; longer inputs go in pieces
BATCH = 128


class LlamaCppModel(base.CheckedTrees):
    """A GGUF file loaded by llama.cpp: one model, one context whose KV cells all sequences share."""

    backend = "llamacpp"
    peer_kind = "llama_cpp.generate"  # llama-cpp-python's generate() on the same file (`bench.peers`)
    batch_tokens = BATCH  # tokens per llama_decode (the peers' n_batch)
    device = "cpu"  # logits and states come out on the CPU, whatever layers are offloaded
    spare_sequences = None  # a kept sequence holds a sequence id: `max_sequence_ids` bounds them
    device_logits = False  # forward returns logits on the CPU
    max_sequence_ids = MAX_SEQUENCE_IDS
    compile_backend = None  # llama.cpp runs its own graphs
    columns = None  # logits over the whole vocabulary
    reads_target_states = False  # its sequences take no states from another model
    times_ops = True  # `runtime.op_times` splits a forward's time by kind of op

    def __init__(self, path: str | os.PathLike, threads: int | None = None, gpu_layers: int = 0,
                 context: int | None = None, tokenizer=None, slots: int = 1, prefix_tokens: int = 0,
                 prefix_cells: int = 0, output_layer: str = "auto", batch_invariant: bool = False):
        if output_layer not in OUTPUT_LAYERS:
            raise SpecDecError(f"unknown output layer {output_layer!r}; choose one of {', '.join(OUTPUT_LAYERS)}")
        self.llama_cpp = lib = bindings()
        self.path = str(path)
        check_gguf_file(Path(path))
        self.batch_invariant = batch_invariant
        if batch_invariant:
            untiled_matmuls()
        self._weights = Weights(lib, Path(path), gpu_layers, batch_invariant)
        self._model = self._weights.model
        if lib.llama_model_is_recurrent(self._model) or lib.llama_model_is_hybrid(self._model):
            raise SpecDecError(f"{path}: recurrent models cannot take back rejected draft tokens; "
                               "specdec needs an attention model")
        self._vocab = self._weights.vocab
        self.vocab_size = lib.llama_vocab_n_tokens(self._vocab)
        self.tokenizer = tokenizer or GGUFTokenizer(self._weights)
        if len(self.tokenizer) != self.vocab_size:
            raise SpecDecError(f"{path}: the model has {self.vocab_size} tokens but the tokenizer has "
                               f"{len(self.tokenizer)}")
        trained = lib.llama_model_n_ctx_train(self._model)
        self.max_length = min(context or DEFAULT_CONTEXT, trained) if trained > 0 else (context or DEFAULT_CONTEXT)
        self.on_gpu = bool(gpu_layers)
        self.compile_seconds: dict[tuple[int, ...], float] = {}  # nothing compiled
        # KV cells: `slots` sequences of max_length entries fit at once. The prefix cache it is loaded
        # for (prefix_tokens) keeps its prefixes in cells no running sequence holds and gives them
        # back when a decode needs them (`prefix.make_room`), so cells beyond the slots' are added
        # only for the part of its budget the slots cannot hold: llama.cpp clears every cell at load,
        # so each one is resident. Loaded for none, a cache keeps prefixes only in prefix_cells.
        slot_cells = self.max_length * slots
        self.cells = slot_cells + max(0, prefix_tokens - slot_cells) + prefix_cells
        self.spare_cells = self.cells if prefix_tokens else prefix_cells
        self.weight_bytes = lib.llama_model_size(self._model)
        self.parameters = lib.llama_model_n_params(self._model)
        description = buffer_text(lambda buf, size: lib.llama_model_desc(self._model, buf, size))
        self.architecture, _, rest = description.partition(" ")
        self.dtype = rest.partition(" ")[2] or rest  # "F16", "Q4_K - Medium" ...
        self.tree_tolerance = 1e-4 if self.dtype.upper() == "F32" else 3e-2
        self.stop_token_ids = frozenset(i for i in range(self.vocab_size) if lib.llama_vocab_is_eog(self._vocab, i))
        self.hidden_size = lib.llama_model_n_embd(self._model)
        self.layer_count = lib.llama_model_n_layer(self._model)
        self._keep_states = False
        self.state_layers: tuple[int, ...] | None = None  # states kept at these layers' inputs (else the final norm's)
        self.threads = threads or len(os.sched_getaffinity(0))
        self._head, self.output_layer_note = self._open_head(output_layer, gpu_layers)
        # the final norm's rows, for specdec's output layer and for a draft head (None: not built)
        self._capture = (cpu_head.NormCapture(lib, self.hidden_size, BATCH)
                         if cpu_head.capture_unavailable() is None else None)
        self._context = self._new_context(lib, self.threads)
        self._memory = lib.llama_get_memory(self._context)
        self._batch = lib.llama_batch_init(BATCH, 0, MAX_SEQUENCE_IDS)
        self._free_ids = list(range(MAX_SEQUENCE_IDS - 1, -1, -1))  # a stack: low ids first
        # specdec's output layer computes a decode's logits when it returns at least this many rows (1: every
        # decode; 2: verifies, llama.cpp's a one-row forward's, "split"; None: never)
        self._head_rows: int | None = 1 if self._head is not None else None
        self._whole: tuple[cpu_head.CpuHead | None, int | None] | None = None  # the output layer before `narrow_output`
        self._narrow: tuple[np.ndarray, cpu_head.CpuHead] | None = None  # the last narrowed one, kept for the next
        if self._head is not None:
            self._check_head(output_layer)
        if batch_invariant:
            self._check_batch_invariance()

    def _check_batch_invariance(self) -> None:
        """Asked for batch-invariant forwards: 12 tokens fed one at a time and all at once must
        give bitwise the same logits, or the model is refused (a runtime whose kernels still
        depend on the batch shape would make greedy speculation leave plain greedy text)."""
        probe = [(7 * i + 3) % self.vocab_size for i in range(12)]
        one, batched = self.sequence(), self.sequence()
        try:
            alone = torch.cat([one.forward([token]) for token in probe])
            together = batched.forward(probe)
        finally:
            one.release()
            batched.release()
        if not torch.equal(alone, together):
            difference = float((alone - together).abs().max())
            raise SpecDecError(f"{self.path}: llama.cpp's logits still move with the batch shape (by up to "
                               f"{difference:.3g}) with repacked weights and tiled matmuls off; a build without "
                               "llamafile's kernels fixes it for F16 and F32 weights: "
                               'CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" pip install --force-reinstall --no-cache-dir '
                               f"--no-deps llama-cpp-python=={self.llama_cpp.__version__}")

    @property
    def output_layer(self) -> str:
        """Who computes the logits: "specdec" (cpu_head), "llama.cpp", or "split" (llama.cpp's for a
        one-row forward, specdec's for more)."""
        return {1: "specdec", 2: "split", None: "llama.cpp"}[self._head_rows]

    def output_layer_for(self, rows: int) -> str:
        """Who computes the logits of a forward that returns this many rows: "specdec" or "llama.cpp"."""
        return "specdec" if self._uses_head(rows) else "llama.cpp"

    def _uses_head(self, rows: int) -> bool:
        return self._head_rows is not None and rows >= self._head_rows

    def _open_head(self, mode: str, gpu_layers: int) -> tuple[cpu_head.CpuHead | None, str]:
        """specdec's output layer unless told otherwise or it cannot run here (then why, or raise if asked for it)."""
        if mode == "llama.cpp":
            return None, "asked for (output_layer llama.cpp)"
        reason = cpu_head.unavailable() or ("layers are offloaded to a GPU" if gpu_layers else None)
        if reason is None:
            try:
                return cpu_head.CpuHead(self.path, self.llama_cpp, self.hidden_size, self.vocab_size, self.threads), ""
            except ValueError as error:
                reason = str(error)
        if mode in ("specdec", "split"):
            raise SpecDecError(f"specdec's output layer cannot run {self.path}: {reason}")
        return None, reason

    def _check_head(self, mode: str) -> None:
        """specdec's logits must be llama.cpp's up to float rounding (else its graph does more after
        the final norm than one matmul). Under "auto" it computes the forwards it is no slower at,
        timed at 1 and at 8 rows: every one, or only verifies ("split": where a one-row forward is
        faster with llama.cpp's, as on Gemma's 262k rows on one core), or none. Batch-invariant
        forwards take one output layer for every shape, so never "split"."""
        probe = [i % self.vocab_size for i in range(1, 9)]
        if mode == "split" and self.batch_invariant:
            raise SpecDecError("a split output layer computes a one-row forward's logits with other kernels than a "
                               "verify's: it cannot be batch-invariant (take --output-layer specdec or llama.cpp)")

        def forward(head_rows: int | None, tokens: list[int]) -> tuple[torch.Tensor, float]:
            self._head_rows = head_rows
            sequence = self.sequence()
            try:
                sequence.forward(probe[:1])
                started = time.perf_counter()
                logits = sequence.forward(tokens)
                return logits, time.perf_counter() - started
            finally:
                sequence.release()

        theirs = forward(None, probe)[0]
        try:
            error = float((forward(1, probe)[0] - theirs).abs().max())
            tolerance = 1e-3 * max(1.0, float(theirs.abs().max()))
            problem = (f"its logits differ from llama.cpp's by {error:.3g} (> {tolerance:.3g})"
                       if not error <= tolerance else None)
        except RuntimeError as failure:  # the graph names no final norm "result_norm": the capture saw no rows
            problem = str(failure)
        head_rows = None if problem else {"auto": 1, "specdec": 1, "split": 2}[mode]
        if head_rows and mode == "auto":
            seconds = {(layer, k): min(forward(rows, probe[:k])[1] for _ in range(3))
                       for layer, rows in (("llama.cpp", None), ("specdec", 1)) for k in (1, 8)}
            head_rows, problem = head_rows_for(seconds, self.batch_invariant)
        if problem and mode in ("specdec", "split"):
            raise SpecDecError(f"specdec's output layer cannot run {self.path}: {problem}")
        self._head_rows = head_rows
        if head_rows is None:
            self._head.drop_matrix()
        self.output_layer_note = ("llama.cpp's for one-row forwards, asked for (output_layer split)" if mode == "split"
                                  else f"llama.cpp's for one-row forwards: specdec's is {problem}" if head_rows == 2
                                  else problem or "")

    def keep_states(self, on: bool = True, layers: tuple[int, ...] | None = None) -> None:
        """Leave the final norm's rows of every forward's output tokens on its sequences
        (`sequence.states`), or with `layers` those decoder layers' inputs for every token fed, copied
        out of the graph as it runs: no extra compute."""
        if on and self._capture is None:
            raise SpecDecError(f"{self.path}: reading llama.cpp's hidden states needs {cpu_head.capture_unavailable()}")
        if on and layers is not None:
            base.check_state_layers(self, layers)
        self._keep_states = bool(on)
        self.state_layers = tuple(layers) if on and layers is not None else None
        if self._capture is not None:
            self._capture.capture_layers(self.state_layers)

    def narrow_output(self, ids=None) -> bool:
        """Logits over only these target ids, in this order ([n, len(ids)]), from specdec's output layer
        over just their rows, where it can run here; None: the whole vocabulary again. Returns whether
        forwards now give the narrowed logits."""
        if ids is None:
            if self._whole is not None:
                (self._head, self._head_rows), self._whole = self._whole, None
            return False
        if self._capture is None or self.on_gpu or cpu_head.unavailable() is not None:
            return False
        ids = np.asarray(ids)
        if self._narrow is None or not np.array_equal(self._narrow[0], ids):
            try:
                self._narrow = ids, cpu_head.CpuHead(self.path, self.llama_cpp, self.hidden_size, self.vocab_size,
                                                     self.threads, rows=ids)
            except ValueError:
                return False
        self._whole = self._whole or (self._head, self._head_rows)
        self._head, self._head_rows = self._narrow[1], 1  # narrowed logits come from specdec's for every forward
        return True

    def _new_context(self, lib, threads: int):
        params = lib.llama_context_default_params()
        params.n_ctx = self.cells
        params.n_batch = params.n_ubatch = params.n_outputs_max = BATCH
        params.n_seq_max = MAX_SEQUENCE_IDS
        params.kv_unified = True  # one cell pool for all ids: a tree's branches share their prefix cells
        params.swa_full = True  # sliding-window layers keep every cell, so any cell can be taken back
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        # copies the final norm's rows out (and stops the graph there for specdec's output layer)
        if self._capture is not None:
            params.cb_eval, params.cb_eval_user_data = self._capture.callback, self._capture.user_data
        context = lib.llama_init_from_model(self._model, params)
        if not context:
            raise SpecDecError(f"llama.cpp could not create a context of {self.cells} cells for "
                               f"{self.path}{last_log()}")
        return context

    def __del__(self):
        lib = getattr(self, "llama_cpp", None)
        if lib is None:
            return
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
        if getattr(self, "_context", None):
            # a sequence finalized after its model (both in one garbage-collected cycle) finds no
            # memory left: its release is then a no-op, not a call into a freed context
            self._memory = None
            lib.llama_free(self._context)
            self._context = None

    def sequence(self) -> LlamaCppSequence:
        return LlamaCppSequence(self)

    def input_embeddings(self, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        rows = _gguf_matrix(self.path, "token_embd.weight")  # float32, read from the file
        return None if rows is None else rows.to(device, dtype)

    def output_rows(self, embeddings: torch.Tensor | None = None) -> torch.Tensor | None:
        rows = _gguf_matrix(self.path, "output.weight")
        if rows is None:  # no output matrix: the output layer ties the input embeddings
            rows = embeddings if embeddings is not None else self.input_embeddings()
        return None if rows is None else rows[: self.vocab_size]

    def describe(self) -> str:
        head = {1: ", output layer by specdec", 2: ", verifies' output layer by specdec", None: ""}[self._head_rows]
        return f"{self.path} ({self.architecture} {self.dtype}, llama.cpp{head})"

    def verify_room(self, root_position: int) -> int:
        return max(self.max_length - 1 - root_position, 0)

    def warm_up(self, rows: int = 1) -> float:
        return 0.0  # llama.cpp builds its graph for each batch as it comes

    def known_tree_refusal(self) -> str | None:
        if self.batch_invariant:
            return ("batch-invariant decoding needs each sequence's KV cells in position order "
                    "(llama.cpp's attention sums over cells in cell order), and a tree's rejected branches "
                    "leave holes that later tokens would fill out of order")
        return None

    # ---- sequence ids and decoding, for LlamaCppSequence

    def take_id(self) -> int:
        if not self._free_ids:
            raise SpecDecError(f"all {MAX_SEQUENCE_IDS} llama.cpp sequence ids of {self.path} are in use "
                               "(one per open sequence and per tree branch); use fewer tree nodes or fewer "
                               "generations at once")
        return self._free_ids.pop()

    def drop_id(self, seq_id: int, from_position: int = -1) -> None:
        """Remove the id from its cells at positions >= from_position (all of them: -1)."""
        if self._memory is None:  # the context is gone (see __del__)
            return
        if not self.llama_cpp.llama_memory_seq_rm(self._memory, seq_id, from_position, -1):
            raise SpecDecError(f"llama.cpp could not remove cells of sequence {seq_id} from position {from_position}")
        if from_position < 0:
            self._free_ids.append(seq_id)

    def copy_id(self, source: int, target: int, start: int, end: int) -> None:
        """Add `target` to the cells of `source` at positions [start, end)."""
        self.llama_cpp.llama_memory_seq_cp(self._memory, source, target, start, end)

    def forward_batch(self, feeds: list[base.Feed]) -> list[torch.Tensor]:
        """Every feed's new entries in one llama_decode (per BATCH tokens): sequences are told apart
        by their ids, so rows of any lengths, chains and trees, share the batch."""
        base.check_distinct(feeds)
        tokens, positions, ids, outputs, counts, fed, started = [], [], [], [], [], [], []
        try:
            for feed in feeds:
                if feed.sequence.owner is not self:
                    raise ValueError("a batched forward takes sequences of its own model only")
                new, new_positions, new_ids = feed.sequence.place(feed.tokens, feed.parents)
                started.append(feed.sequence)
                n = len(new)
                wanted = base.wanted_count(feed.last, n)
                tokens += new
                positions += new_positions
                ids += new_ids
                outputs += [j >= n - wanted for j in range(n)]
                counts.append(wanted)
                fed.append(n)
            logits, states = self.decode(tokens, positions, ids, outputs)
        except Exception:  # half-assigned ids or cells in an unknown state: those sequences start over, empty
            for sequence in started:
                sequence.clear()
            raise
        state_counts = fed if self.state_layers is not None else counts  # every token's, or the returned rows'
        for feed, rows in zip(feeds, torch.split(states, state_counts) if states is not None else [None] * len(feeds)):
            feed.sequence.states = rows
        return list(torch.split(logits, counts))

    def _copies_norm(self, use_head: bool) -> bool:
        """A decode copies the final norm's rows: specdec's output layer reads them, or they are the states kept."""
        return use_head or (self._keep_states and self.state_layers is None)

    def _decode_one(self, batch, use_head: bool) -> int:
        """llama_decode's status for the filled batch (its eval callback readied first)."""
        clear_log()
        if self._capture is not None:
            self._capture.begin(copy=self._copies_norm(use_head), stop=use_head)
        return self.llama_cpp.llama_decode(self._context, batch)

    def decode(self, tokens: list[int], positions: list[int], ids: list[list[int]],
               outputs: list[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One llama_decode per BATCH tokens; returns the logits [n, vocab] of the tokens flagged in
        `outputs`, in order, and their final-norm rows [n, hidden] when states are kept (else None; at
        `state_layers`, every token's inputs to them)."""
        lib, batch, rows, states = self.llama_cpp, self._batch, [], []
        use_head = self._uses_head(sum(outputs))  # one output layer for all of a forward's rows
        for start in range(0, len(tokens), BATCH):
            end = min(start + BATCH, len(tokens))
            batch.n_tokens = end - start
            for j, i in enumerate(range(start, end)):
                batch.token[j], batch.pos[j] = tokens[i], positions[i]
                batch.n_seq_id[j] = len(ids[i])
                for k, seq_id in enumerate(ids[i]):
                    batch.seq_id[j][k] = seq_id
                batch.logits[j] = outputs[i]
            status = self._decode_one(batch, use_head)
            # a full cache: kept prefixes give back their cells (n_ubatch = n_batch, so the failed
            # call placed nothing), until the decode fits or none is left
            while status == 1 and make_room(self):
                status = self._decode_one(batch, use_head)
            if status != 0:
                full = (f" (the KV cache of {self.cells} cells, shared by this model's open sequences, is full)"
                        if status == 1 else "")
                raise SpecDecError(f"llama.cpp could not decode {end - start} tokens of {self.path}{full}{last_log()}")
            n_out = sum(outputs[start:end])
            # [n_out, hidden]
            hidden = self._capture.rows(n_out) if n_out and self._copies_norm(use_head) else None
            if n_out and use_head:
                rows.append(self._head.logits(hidden))
            elif n_out:
                logits = lib.llama_get_logits(self._context)
                rows.append(torch.from_numpy(np.ctypeslib.as_array(logits, shape=(n_out, self.vocab_size)).copy()))
            if self.state_layers is not None:
                states.append(self._capture.layer_rows(end - start).clone())
            elif n_out and self._keep_states:
                states.append(hidden.clone())
        columns = self._head.vocab_size if self._head_rows is not None else self.vocab_size  # narrowed or whole
        logits = torch.cat(rows) if rows else torch.zeros(0, columns)
        if not self._keep_states:
            return logits, None
        width = self.hidden_size * len(self.state_layers or (None,))
        return logits, torch.cat(states) if states else torch.zeros(0, width)


def head_rows_for(seconds: dict[tuple[str, int], float], batch_invariant: bool) -> tuple[int | None, str | None]:
    """From a forward's seconds by (output layer, rows), at 1 and at 8 rows: the fewest rows a forward
    returns for specdec's output layer to compute them (1: every forward; 2: verifies only, llama.cpp's
    being faster at one row and batch invariance not asked for; None: none), and why not every forward."""
    slower = [k for k in (1, 8) if seconds["specdec", k] > seconds["llama.cpp", k]]
    if not slower:
        return 1, None
    why = "slower here than llama.cpp's own: " + ", ".join(
        f"{seconds['specdec', k] * 1e3:.2f} vs {seconds['llama.cpp', k] * 1e3:.2f} ms at {k} rows" for k in slower)
    return (2 if slower == [1] and not batch_invariant else None), why


def _gguf_matrix(path: str, name: str) -> torch.Tensor | None:
    """The GGUF file's tensor `name`, dequantized to float32 (None: the file has none)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensor = next((t for t in GGUFReader(path).tensors if t.name == name), None)
    if tensor is None:
        return None
    return torch.from_numpy(np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))


class LlamaCppSequence(SequenceEntries):
    """One sequence slot on a LlamaCppModel; see the module docstring for how branches work.

    Invariant (with `SequenceEntries`'): every entry's `home` branch holds its whole path; `tips[b]`
    is the deepest entry of branch b; the base branch holds the trunk (the committed text), and an
    entry's home is the base exactly when it is in the trunk."""

    states: torch.Tensor | None = None  # [rows, hidden] of the last forward, while the model keeps states

    def __init__(self, owner: LlamaCppModel):
        super().__init__(owner)
        self.base = owner.take_id()
        self._home: list[int] = []
        self._tips: dict[int, int] = {self.base: -1}

    def release(self) -> None:
        for branch in self._tips:
            self.owner.drop_id(branch)
        self._tips = {}

    def __del__(self):  # a sequence dropped without release() gives its cells back too
        if getattr(self, "_tips", None):
            self.release()

    def forward(self, tokens, parents=None, last: int | None = None) -> torch.Tensor:
        return self.owner.forward_batch([base.Feed(self, tokens, parents, last)])[0]

    def fork(self, length: int) -> LlamaCppSequence:
        """The first `length` entries' cells are shared with the new sequence (seq_cp), not copied."""
        self.check_fork(length)
        other = LlamaCppSequence(self.owner)
        if length:
            self.owner.copy_id(self.base, other.base, -1, self._positions[length - 1] + 1)
        self.share_entries(other, length)
        other._home, other._tips = [other.base] * length, {other.base: length - 1}
        return other

    def place(self, tokens, parents) -> tuple[list[int], list[int], list[list[int]]]:
        """Record new entries (checked) and give their tokens, positions and sequence ids for a decode
        (a failed decode clears the sequence)."""
        start = self.cache_len
        tokens, positions, all_parents = super().place(tokens, parents)
        if any(not 0 <= t < self.owner.vocab_size for t in tokens):
            raise ValueError(f"token ids must be in [0, {self.owner.vocab_size})")
        self.commit(tokens, positions, all_parents)
        ids: list[list[int]] = []
        try:
            for i in range(len(tokens)):
                ids.append([self._branch_for(start + i, start, ids)])
        except Exception:  # half-assigned ids: start over, empty
            self.clear()
            raise
        return tokens, positions, ids

    def clear(self) -> None:
        """Start over, empty (after a failed decode left ids or cells in an unknown state)."""
        self.release()
        self.__init__(self.owner)

    def _branch_for(self, entry: int, start: int, ids: list[list[int]]) -> int:
        """The branch of a new entry: its parent's when the parent is that branch's tip, else a new
        one holding the parent's path (cached cells by seq_cp, new ancestors by carrying its id)."""
        parent = self._parents[entry]
        home = self._home[parent] if parent >= 0 else self.base
        if parent < 0 and self._tips[self.base] != -1:
            raise ValueError("only the first entry of a sequence may have no parent")
        if self._tips[home] == parent:
            self._home.append(home)
        else:
            home = self.owner.take_id()
            ancestor = parent
            while ancestor >= start:  # new ancestors in this batch carry the branch too
                ids[ancestor - start].append(home)
                ancestor = self._parents[ancestor]
            if ancestor >= 0:
                self.owner.copy_id(self._home[ancestor], home, -1, self._positions[ancestor] + 1)
            self._home.append(home)
        self._tips[home] = entry
        return home

    def keep(self, start: int, indices) -> None:
        indices = self.kept_path(start, indices)
        if start > self._trunk:
            raise ValueError(f"the first {start} entries must be committed text (a chain) to keep a path after them")
        owner, first_position = self.owner, (self._positions[start - 1] + 1 if start else 0)
        if indices:
            last = indices[-1]
            branch, end = self._home[last], self._positions[last] + 1
            if branch == self.base:
                owner.drop_id(self.base, end)
            else:
                owner.drop_id(self.base, first_position)
                owner.copy_id(branch, self.base, first_position, end)
        else:
            owner.drop_id(self.base, first_position)
        for branch in [b for b in self._tips if b != self.base]:
            owner.drop_id(branch)
        self.keep_entries(start, indices)
        self._home = [self.base] * len(self._positions)
        self._tips = {self.base: len(self._positions) - 1}
