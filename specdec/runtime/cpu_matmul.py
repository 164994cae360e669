"""Faster linear layers for the few-token forwards of decoding on a CPU, where the machine says so.

With PyTorch's CPU BLAS, `x @ W.T` for an x of 2-16 rows can be far slower than the same product
computed as `(W @ x.T).T`, or far faster: it depends on the CPU and the BLAS build (one machine
favours each form by several times where another favours the other). Speculative decoding lives on
such forwards, so each layer shape's products are timed once per process, per row-count bucket,
and a CPU model's linear layers take the faster form for each. Longer inputs (prefill) keep F.linear.
"""

from __future__ import annotations

import functools
import time
import types

import torch

SMALL_BATCH_ROWS = 16
BUCKETS = (2, 4, 8, 16)  # rows 2-3 take bucket 2's choice, 4-7 bucket 4's, and so on
MARGIN = 0.9  # the transposed form must be at least 10% faster to be used


def _transposed(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t()


def _bucket(rows: int) -> int:
    return max(b for b in BUCKETS if b <= rows)


@functools.cache
def transposed_wins(out_features: int, in_features: int, dtype: torch.dtype, threads: int) -> frozenset[int]:
    """The row-count buckets where (W @ x.T).T beats F.linear for this shape on this machine
    (the low quartile of interleaved repeats)."""
    weight = torch.randn(out_features, in_features, dtype=dtype)
    wins = set()
    for rows in BUCKETS:
        x = torch.randn(rows, in_features, dtype=dtype)
        linear, transposed = [], []
        for _ in range(24):
            for form, times in ((lambda: torch.nn.functional.linear(x, weight), linear),
                                (lambda: _transposed(weight, x), transposed)):
                started = time.perf_counter()
                form()
                times.append(time.perf_counter() - started)
        if sorted(transposed)[6] < MARGIN * sorted(linear)[6]:
            wins.add(rows)
    return frozenset(wins)


def _small_batch_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows < 2 or rows > SMALL_BATCH_ROWS or _bucket(rows) not in self.transposed_rows:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    out = _transposed(self.weight, x.reshape(rows, x.shape[-1]))  # [rows, out_features]
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def use_small_batch_matmul(model: torch.nn.Module) -> None:
    """Patch the nn.Linear layers of a CPU model in place where the transposed product is faster
    on this machine (same weights, same results up to float rounding)."""
    threads = torch.get_num_threads()
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            out_features, in_features = module.weight.shape
            wins = transposed_wins(out_features, in_features, module.weight.dtype, threads)
            if wins:
                module.transposed_rows = wins
                module.forward = types.MethodType(_small_batch_linear, module)
