"""Where a llama.cpp forward's time goes, per kind of op (`specdec profile --breakdown`).

A second context on the model's weights runs with an eval callback that asks for every node, so
ggml's scheduler computes the graph one node at a time and the callback sees each node finish:
the time between two finished nodes is the second node's (its compute, and the callback's own
microseconds: the categories add up to more than the whole forward, which a third context times
with no callback). Forwards of k new tokens after a cached prefix, each size run `repeats` times
after one more (llama.cpp then reuses the graph, as decoding does); the median is kept.

Categories, from the nodes' ggml op and llama.cpp's tensor names:
  output layer          the output matrix's product (result_output)
  feed-forward matmuls  products named ffn_*
  attention matmuls     the other products (q/k/v/output projections, kq, kqv)
  attention             flash attention, softmax
  other ops             norms, activations, rope, embedding rows, copies
When specdec computes the output layer (cpu_head), its kernel's time for the same rows is given
beside llama.cpp's, and the logits copy llama.cpp makes for every output row (vocab x 4 bytes).
"""

from __future__ import annotations

import ctypes
import statistics
import time

import numpy as np
import torch

CATEGORIES = ("output layer", "feed-forward matmuls", "attention matmuls", "attention", "other ops")


def category(op: str, name: str) -> str:
    if op == "MUL_MAT":
        if name.startswith("result_output"):
            return "output layer"
        return "feed-forward matmuls" if name.startswith("ffn") else "attention matmuls"
    if op in ("FLASH_ATTN_EXT", "SOFT_MAX"):
        return "attention"
    return "other ops"


def breakdown(model, sizes=(1, 4, 8, 16), repeats: int = 5, prefix: int = 64) -> dict[int, dict[str, float]]:
    """Seconds per category of one forward of k tokens (all rows' logits), per k in `sizes`; with
    "forward" (the whole forward timed without the callback) and, where specdec computes the
    output layer, "output layer (specdec)" and "logits copy"."""
    from specdec.runtime import cpu_head

    lib = model.llama_cpp
    library = cpu_head._ggml_base(lib)
    get_name, op_desc = library.ggml_get_name, library.ggml_op_desc
    get_name.restype = op_desc.restype = ctypes.c_char_p
    get_name.argtypes = op_desc.argtypes = [ctypes.c_void_p]
    state = {"on": False, "last": 0.0, "spent": dict.fromkeys(CATEGORIES, 0.0)}

    @lib.ggml_backend_sched_eval_callback
    def timed(tensor, ask, _user_data):
        if not state["on"]:
            return False
        if ask:
            return True
        now = time.perf_counter()
        kind = category(op_desc(tensor).decode(), get_name(tensor).decode())
        state["spent"][kind] += now - state["last"]
        state["last"] = time.perf_counter()
        return True

    sizes = [k for k in sizes if prefix + k <= model.max_length]
    timed_context, plain_context = (_Context(model, prefix + max(sizes), timed),
                                    _Context(model, prefix + max(sizes), None))
    result = {}
    for k in sizes:
        tokens = [(7 * i + 3) % model.vocab_size for i in range(k)]
        runs = []
        for _ in range(repeats + 1):
            state["spent"] = dict.fromkeys(CATEGORIES, 0.0)
            state["on"], state["last"] = True, time.perf_counter()
            timed_context.forward(tokens, prefix)
            state["on"] = False
            runs.append(dict(state["spent"]))
        row = {kind: statistics.median(run[kind] for run in runs[1:]) for kind in CATEGORIES}
        row["forward"] = statistics.median([plain_context.forward(tokens, prefix) for _ in range(repeats + 1)][1:])
        if model.output_layer_for(k) == "specdec":
            row["output layer (specdec)"] = _kernel_seconds(model, k, repeats)
            row["logits copy"] = _copy_seconds(model.vocab_size, k, repeats)
        result[k] = row
    return result


class _Context:
    """A llama.cpp context of one sequence on the model's weights, holding a cached prefix."""

    def __init__(self, model, cells: int, callback):
        lib = self.lib = model.llama_cpp
        params = lib.llama_context_default_params()
        params.n_ctx = cells
        params.n_batch = params.n_ubatch = cells
        params.n_threads = params.n_threads_batch = model.threads
        params.no_perf = True
        if callback is not None:
            params.cb_eval = callback
        self.context = lib.llama_init_from_model(model._model, params)
        if not self.context:
            raise RuntimeError("llama.cpp could not create a context for the breakdown")
        self.batch = lib.llama_batch_init(cells, 0, 1)
        self.memory = lib.llama_get_memory(self.context)
        self.vocab_size, self.cached = model.vocab_size, 0

    def forward(self, tokens: list[int], prefix: int) -> float:
        """Seconds of a forward of `tokens` (logits for every one) after `prefix` cached tokens."""
        if self.cached != prefix:
            self.lib.llama_memory_seq_rm(self.memory, 0, 0, -1)
            self._decode([i % self.vocab_size for i in range(prefix)], 0)
            self.cached = prefix
        self.lib.llama_memory_seq_rm(self.memory, 0, prefix, -1)
        return self._decode(tokens, prefix)

    def _decode(self, tokens: list[int], start: int) -> float:
        batch = self.batch
        batch.n_tokens = len(tokens)
        for j, token in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.seq_id[j][0], batch.logits[j] = (
                token, start + j, 1, 0, True)
        started = time.perf_counter()
        if self.lib.llama_decode(self.context, batch) != 0:
            raise RuntimeError("llama.cpp could not decode the breakdown's forward")
        return time.perf_counter() - started

    def __del__(self):
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.context)


def _kernel_seconds(model, rows: int, repeats: int) -> float:
    """specdec's output layer on `rows` hidden rows (their values do not change its time)."""
    head, hidden = model._head, torch.randn(rows, model._head.width)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        head.logits(hidden)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def _copy_seconds(vocab: int, rows: int, repeats: int) -> float:
    """llama.cpp's copy of `rows` logits rows out of its graph, which it makes even when specdec
    stops the graph before them (about the same bytes as this copy)."""
    source, target, times = np.ones((rows, vocab), np.float32), np.empty((rows, vocab), np.float32), []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def format_breakdown(result: dict[int, dict[str, float]]) -> str:
    """A markdown table: milliseconds per category, one column per k."""
    sizes = sorted(result)
    kinds = [kind for kind in (*CATEGORIES, "forward", "output layer (specdec)", "logits copy")
             if kind in result[sizes[0]]]
    lines = ["| ms per forward | " + " | ".join(f"k = {k}" for k in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for kind in kinds:
        label = {"forward": "whole forward, untimed ops (llama.cpp's logits)"}.get(kind, kind)
        lines.append(f"| {label} | " + " | ".join(f"{result[k][kind] * 1e3:.2f}" for k in sizes) + " |")
    if "output layer (specdec)" in result[sizes[0]]:
        ours = [result[k]["forward"] - result[k]["output layer"] + result[k]["output layer (specdec)"] for k in sizes]
        lines.append("| forward with specdec's output layer (estimate) | "
                     + " | ".join(f"{t * 1e3:.2f}" for t in ours) + " |")
    return "\n".join(lines)
