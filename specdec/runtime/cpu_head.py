"""The output layer of a GGUF model on llama.cpp's CPU backend, computed by specdec.

Why: a verify needs logits at every drafted position, and on llama.cpp's CPU kernels those rows
cost almost as much as separate forwards: for a small model with a large vocabulary the output
layer is most of a forward, and its cost grows with every row (per-op timing: `specdec profile
--breakdown`; figures in benchmarks/RESULTS.md).

What: llama.cpp runs its graph up to the final norm (the tensor named "result_norm"); an eval
callback in `_cpu_head.c` copies those rows out and stops the graph there, so llama.cpp never
multiplies them by the output matrix. specdec's kernel then computes the logits, reading the
matrix once for all rows (AVX-512 VNNI), so a few rows cost little more than one. It takes Q8_0
matrices and Q6_K ones (what Q4_K_M files of models whose width is a multiple of 256 store).
Whether it is faster than llama.cpp's own on this machine is measured at load (`llamacpp`'s
`_check_head`).

Exactness: the kernel quantizes each hidden row as llama.cpp does (Q8_0 rows against a Q8_0
matrix, Q8_K rows against a Q6_K one), so the integer dot products are llama.cpp's; only the
float order of the per-block sums differs. It computes every row alone, the same way in any
batch: a row's logits are bitwise the same whatever the batch shape, so plain decoding (one
row) and a verify (k rows) compute one function of the hidden states. A self-check at load
compares it with llama.cpp's own logits and refuses it if they disagree beyond rounding (an
architecture that does more after the final norm than one matmul).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import os
from pathlib import Path

import numpy as np
import torch

NORM_TENSOR = b"result_norm"  # llama.cpp's name for the final norm's output, the rows the output matrix multiplies
# ggml type (Q8_0, Q6_K) -> weights and bytes per block; the kernel's kind is the index
KINDS = {8: (32, 34), 14: (256, 210)}
Q8_0 = 8
GGUF_UINT32, GGUF_INT32, GGUF_FLOAT32 = 4, 5, 6  # enum gguf_type


class Capture(ctypes.Structure):
    """The callback's state (the struct `Capture` in _cpu_head.c, field for field): one tensor to copy,
    and the next."""


Capture._fields_ = [("get_name", ctypes.c_void_p), ("nbytes", ctypes.c_void_p), ("tensor_get", ctypes.c_void_p),
                    ("active", ctypes.c_int32), ("name", ctypes.c_char * 64),
                    ("dest", ctypes.c_void_p), ("capacity", ctypes.c_uint64), ("copied", ctypes.c_uint64),
                    ("overflow", ctypes.c_int32), ("go_on", ctypes.c_int32), ("next", ctypes.POINTER(Capture))]


@functools.cache
def _extension():
    """The compiled module, or the reason it is missing."""
    try:  # by name: a compiled extension beside this file, which a build without a C compiler lacks
        return importlib.import_module("specdec.runtime._cpu_head")
    except ImportError as error:
        return f"specdec's compiled output layer is not built ({error}; reinstall specdec with a C compiler)"


def _kernels():
    """The compiled module where its kernel runs, or the reason it cannot be used here."""
    extension = _extension()
    if not isinstance(extension, str) and not extension.vnni():
        return "this CPU has no AVX-512 VNNI (the kernel's only fast path)"
    return extension


def capture_unavailable() -> str | None:
    """Why the final norm's rows cannot be copied out of llama.cpp's graph here, or None."""
    extension = _extension()
    return extension if isinstance(extension, str) else None


def unavailable() -> str | None:
    """Why specdec's output layer cannot run on this machine and build, or None."""
    kernels = _kernels()
    return kernels if isinstance(kernels, str) else None


@functools.cache
def _ggml_base(llama_cpp_module) -> ctypes.CDLL:
    """llama.cpp's ggml base library (tensors, the scheduler, GGUF files), as llama-cpp-python ships it."""
    library = ctypes.CDLL(str(Path(llama_cpp_module.__file__).parent / "lib" / "libggml-base.so"))
    library.gguf_init_from_file.restype = ctypes.c_void_p
    library.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInit]
    for name, result, arguments in (("gguf_find_tensor", ctypes.c_int64, [ctypes.c_char_p]),
                                    ("gguf_find_key", ctypes.c_int64, [ctypes.c_char_p]),
                                    ("gguf_get_tensor_offset", ctypes.c_size_t, [ctypes.c_int64]),
                                    ("gguf_get_tensor_size", ctypes.c_size_t, [ctypes.c_int64]),
                                    ("gguf_get_tensor_type", ctypes.c_int, [ctypes.c_int64]),
                                    ("gguf_get_data_offset", ctypes.c_size_t, []),
                                    ("gguf_get_kv_type", ctypes.c_int, [ctypes.c_int64]),
                                    ("gguf_get_val_f32", ctypes.c_float, [ctypes.c_int64]),
                                    ("gguf_get_val_str", ctypes.c_char_p, [ctypes.c_int64]),
                                    ("gguf_get_val_u32", ctypes.c_uint32, [ctypes.c_int64]),
                                    ("gguf_get_arr_type", ctypes.c_int, [ctypes.c_int64]),
                                    ("gguf_get_arr_n", ctypes.c_size_t, [ctypes.c_int64]),
                                    ("gguf_get_arr_data", ctypes.c_void_p, [ctypes.c_int64]), ("gguf_free", None, [])):
        function = getattr(library, name)
        function.restype, function.argtypes = result, [ctypes.c_void_p, *arguments]
    return library


class _GgufInit(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]  # struct gguf_init_params


@contextlib.contextmanager
def open_gguf(library: ctypes.CDLL, path: Path):
    """llama.cpp's reader of a GGUF file's metadata and tensor index (no tensor data is read: fast
    on any size of file), freed on exit. Raises ValueError when it cannot open the file."""
    gguf = library.gguf_init_from_file(os.fsencode(path), _GgufInit(True, None))
    if not gguf:
        raise ValueError("llama.cpp's GGUF reader could not open the file")
    try:
        yield gguf
    finally:
        library.gguf_free(gguf)


def _ggml_functions(library: ctypes.CDLL) -> tuple[int, int, int]:
    """Addresses of ggml_get_name, ggml_nbytes and ggml_backend_tensor_get, for the callback."""
    return tuple(ctypes.cast(getattr(library, name), ctypes.c_void_p).value
                 for name in ("ggml_get_name", "ggml_nbytes", "ggml_backend_tensor_get"))


class NormCapture:
    """The final norm's rows of each decode, copied out of llama.cpp's graph by an eval callback
    (`specdec_capture` in _cpu_head.c, handed to the context at its creation) into `hidden`: the
    rows specdec's output layer multiplies, and the states a draft head reads. Any CPU, any build
    of llama.cpp (the callback reads the tensor from whichever backend computed it)."""

    def __init__(self, llama_cpp_module, width: int, rows: int):
        extension = _extension()
        if isinstance(extension, str):
            raise ValueError(extension)
        self.width, self.max_rows = width, rows
        self.functions = _ggml_functions(_ggml_base(llama_cpp_module))
        self.hidden, self.capture = self._buffer(NORM_TENSOR)  # [rows, width]: every output row of one decode
        self.layers: list[tuple[torch.Tensor, Capture]] = []  # the decoder layers' inputs (`capture_layers`)
        self.callback = ctypes.cast(extension.capture_address(), llama_cpp_module.ggml_backend_sched_eval_callback)
        self.user_data = ctypes.cast(ctypes.pointer(self.capture), ctypes.c_void_p)

    def _buffer(self, name: bytes) -> tuple[torch.Tensor, Capture]:
        name_of, nbytes, tensor_get = self.functions
        rows = torch.empty(self.max_rows, self.width, dtype=torch.float32)
        return rows, Capture(get_name=name_of, nbytes=nbytes, tensor_get=tensor_get, active=0, name=name,
                             dest=rows.data_ptr(), capacity=rows.numel() * 4, copied=0, go_on=1)

    def capture_layers(self, layers) -> None:
        """From now on also copy the inputs of these decoder layers (llama.cpp's `l_out` of the layer
        before: every token's row, whichever rows output logits); none: stop."""
        self.layers = [self._buffer(f"l_out-{layer - 1}".encode()) for layer in layers or ()]
        for (_, capture), (_, after) in zip([(None, self.capture)] + self.layers, self.layers + [(None, None)]):
            capture.next = ctypes.pointer(after) if after is not None else None

    def begin(self, copy: bool, stop: bool) -> None:
        """Before a decode: copy the final norm's rows (or not), and stop the graph after them (specdec
        computes the logits) or let llama.cpp finish it; the layers' inputs are copied whenever asked for."""
        self.capture.active, self.capture.go_on = int(copy), int(not stop)
        for capture in [self.capture] + [capture for _, capture in self.layers]:
            capture.copied = capture.overflow = 0
        for _, capture in self.layers:
            capture.active = 1

    def rows(self, count: int) -> torch.Tensor:
        """The `count` final-norm rows the last decode copied, [count, width] (a view: copy to keep)."""
        return _copied(self.hidden, self.capture, count, "final-norm")

    def layer_rows(self, count: int) -> torch.Tensor:
        """[count, layers * width]: the last decode's `count` tokens' inputs to every captured layer."""
        return torch.cat([_copied(rows, capture, count, capture.name.decode()) for rows, capture in self.layers], 1)


def _copied(rows: torch.Tensor, capture: Capture, count: int, what: str) -> torch.Tensor:
    width = rows.shape[1]
    if capture.overflow or capture.copied != count * width * 4:
        raise RuntimeError(f"llama.cpp's graph gave {capture.copied // (4 * width)} {what} rows, {count} expected")
    return rows[:count]


class CpuHead:
    """One GGUF file's output matrix, packed for the kernel: logits from the final norm's rows."""

    def __init__(self, path: str | Path, llama_cpp_module, width: int, vocab_size: int, threads: int, rows=None):
        """rows: only these rows of the matrix (a draft head's pruned vocabulary), in this order."""
        library = _ggml_base(llama_cpp_module)
        matrix, ggml_type, softcap = _output_matrix(library, Path(path), width, vocab_size)
        if rows is not None:
            matrix = np.ascontiguousarray(matrix.reshape(vocab_size, -1)[np.asarray(rows)]).reshape(-1)
            vocab_size = len(rows)
        self._pack(matrix, ggml_type, vocab_size, width, threads, softcap)

    @classmethod
    def of_floats(cls, matrix: torch.Tensor, threads: int = 1) -> CpuHead:
        """Any float matrix [rows, width] (width a multiple of 32), quantized to Q8_0 as llama.cpp does."""
        head = cls.__new__(cls)
        rows, width = matrix.shape
        head._pack(q8_0_blocks(matrix.detach().float().numpy()), Q8_0, rows, width, threads, 0.0)
        return head

    def _pack(self, matrix: np.ndarray, ggml_type: int, vocab_size: int, width: int, threads: int,
              softcap: float) -> None:
        kernels = _kernels()
        if isinstance(kernels, str):
            raise ValueError(kernels)
        self.kernels, self.width, self.threads, self.softcap = kernels, width, threads, softcap
        self.vocab_size = vocab_size
        self.kind, (block, _) = list(KINDS).index(ggml_type), KINDS[ggml_type]
        rows_packed = -(-vocab_size // 16) * 16
        self.weights = np.empty(rows_packed * width, np.uint8)
        self.scales = np.empty(rows_packed * (width // block), np.uint16)
        self.subscales = np.empty(rows_packed * (width // 16) if block == 256 else 0, np.int8)
        kernels.pack(self.kind, matrix, vocab_size, width, self.weights, self.scales, self.subscales)

    def drop_matrix(self) -> None:
        """When llama.cpp keeps the output layer: the packed copy goes."""
        self.weights = self.scales = self.subscales = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, width] final-norm rows -> [rows, vocab] logits."""
        rows = hidden.shape[0]
        out = torch.empty(rows, self.vocab_size, dtype=torch.float32)
        self.kernels.logits(self.kind, self.weights, self.scales, self.subscales, self.vocab_size, self.width,
                            hidden.contiguous().numpy(), rows, out.numpy(), self.threads, False)
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


def q8_0_blocks(matrix: np.ndarray) -> np.ndarray:
    """[rows, width] floats in ggml's Q8_0 layout, as a GGUF file stores them (gguf's own quantizer: per 32
    weights of a row a float16 scale, then 32 int8)."""
    from gguf import GGMLQuantizationType, quants

    if matrix.shape[1] % 32:
        raise ValueError(f"a Q8_0 matrix's rows are whole blocks of 32 weights, not {matrix.shape[1]}")
    return quants.quantize(np.ascontiguousarray(matrix, dtype=np.float32), GGMLQuantizationType.Q8_0).reshape(-1)


class QuantizedLinear(torch.nn.Module):
    """A bias-free linear layer whose weight the kernel multiplies as Q8_0 (a draft head's on the CPU: a
    level reads a quarter of float32's bytes, and these are read from memory, the target's weights having
    passed through the cache since). Rows of any leading shape; the result in the input's dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.kernel = CpuHead.of_floats(linear.weight, threads=1)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.logits(x.reshape(-1, self.in_features).float()).to(x.dtype).reshape(
            *x.shape[:-1], self.out_features)


def quantize_linears(module: torch.nn.Module) -> int:
    """Swap every bias-free linear layer of `module` whose width the kernel takes for a `QuantizedLinear`,
    where the kernel runs on this CPU; returns how many were swapped."""
    if unavailable() is not None:
        return 0
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child.bias is None and child.in_features % 32 == 0:
                setattr(parent, name, QuantizedLinear(child))
                swapped += 1
    return swapped


def _output_matrix(library: ctypes.CDLL, path: Path, width: int, vocab_size: int) -> tuple[np.ndarray, int, float]:
    """The output matrix's bytes, mapped from the file (the tied embedding matrix when there is no
    output matrix), its ggml type and the final logit softcap (0: none). Raises ValueError when it
    is not a Q8_0 or Q6_K matrix of the model's shape."""
    with open_gguf(library, path) as gguf:
        if library.gguf_find_tensor(gguf, b"output.scale") >= 0:
            raise ValueError("its output layer has a scale tensor")
        tensor = library.gguf_find_tensor(gguf, b"output.weight")
        tensor = tensor if tensor >= 0 else library.gguf_find_tensor(gguf, b"token_embd.weight")
        if tensor < 0:
            raise ValueError("no output matrix in the file")
        kind, size = library.gguf_get_tensor_type(gguf, tensor), library.gguf_get_tensor_size(gguf, tensor)
        if kind not in KINDS:
            raise ValueError(f"its output matrix is neither Q8_0 nor Q6_K (ggml type {kind}), "
                             "the types the kernel takes")
        block, block_bytes = KINDS[kind]
        if width % block or size != vocab_size * width // block * block_bytes:
            raise ValueError(f"its output matrix ({size} bytes) is not {vocab_size} x {width}")
        offset = library.gguf_get_data_offset(gguf) + library.gguf_get_tensor_offset(gguf, tensor)
        architecture = library.gguf_get_val_str(gguf, library.gguf_find_key(gguf, b"general.architecture")).decode()
        key = library.gguf_find_key(gguf, f"{architecture}.final_logit_softcapping".encode())
        softcap = (float(library.gguf_get_val_f32(gguf, key))
                   if key >= 0 and library.gguf_get_kv_type(gguf, key) == GGUF_FLOAT32 else 0.0)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(size,)), kind, softcap
