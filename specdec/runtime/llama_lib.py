"""llama.cpp's library and a GGUF file's weights in it: the bindings and their log, where the weights
go (plain CPU buffers where AMX ones would crash, no repacking or tiled matmuls when batch
invariance is asked for), and the tokenizer stored in the file. `llamacpp.LlamaCppModel` runs them."""

from __future__ import annotations

import collections
import ctypes
import functools
import os
from pathlib import Path

from specdec.config import missing_model
from specdec.errors import SpecDecError


def bindings():
    """The llama_cpp module, its backend started and its log captured (once)."""
    try:
        import llama_cpp
    except ImportError as error:  # the package compiles llama.cpp at install; a user may have skipped it
        raise SpecDecError("GGUF models run on llama.cpp: pip install llama-cpp-python (see the README)") from error
    _start(llama_cpp)
    return llama_cpp


_log: collections.deque[str] = collections.deque(maxlen=20)  # llama.cpp's last warnings and errors
_callback = None


def _start(llama_cpp) -> None:
    """Initialise the backend once and route llama.cpp's log into `_log` (not the terminal)."""
    global _callback
    if _callback is not None:
        return

    def record(level, text, _user_data):
        if level >= 3 and text:  # GGML_LOG_LEVEL_WARN and above
            _log.append(text.decode("utf-8", "replace").strip())

    _callback = llama_cpp.llama_log_callback(record)
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()


def clear_log() -> None:
    """Forget llama.cpp's log so far (before a call whose failure `last_log` should explain)."""
    _log.clear()


def last_log() -> str:
    """": " and llama.cpp's last warning or error since `clear_log`, or "" (for error messages)."""
    lines = [line for line in _log if line]
    return f": {lines[-1]}" if lines else ""


def buffer_text(fill, size: int = 256) -> str:
    """A string from a llama.cpp function that writes into a buffer and returns its length."""
    buffer = ctypes.create_string_buffer(size)
    length = fill(buffer, size)
    if length >= size:
        return buffer_text(fill, length + 1)
    return buffer.raw[: max(length, 0)].decode("utf-8", "replace")


def check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise missing_model(path) if not path.exists() else SpecDecError(
            f"{path} is a directory, not a GGUF file (a checkpoint directory runs on transformers)")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise SpecDecError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")


class _BufferOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]  # llama_model_tensor_buft_override


class _CpuOnly:
    """A tensor-buffer override list putting every weight (pattern ".*") in ggml's plain CPU buffer."""

    def __init__(self):
        self.overrides = None

    def load(self, lib_dir: Path) -> bool:
        cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
        cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
        cpu.ggml_cpu_has_amx_int8.restype = ctypes.c_int
        if not cpu.ggml_cpu_has_amx_int8():
            return False
        self.overrides = (_BufferOverride * 2)(_BufferOverride(b".*", cpu.ggml_backend_cpu_buffer_type()),
                                               _BufferOverride(None, None))
        return True


_CPU_ONLY = _CpuOnly()


def untiled_matmuls() -> None:
    """ggml's tiled K-quant matmuls (taken from 8 rows up) sum in another order than its one-row
    kernel; ggml reads the switch once per process, at its first matmul, so a batch-invariant
    model turns them off for the whole process (its invariance is then checked by measurement)."""
    os.environ["GGML_CPU_TILED_MM"] = "0"


@functools.cache
def _amx_buffers() -> bool:
    """Whether this llama.cpp build would put quantized weights in AMX buffers."""
    import llama_cpp

    try:
        return _CPU_ONLY.load(Path(llama_cpp.__file__).parent / "lib")
    except (OSError, AttributeError):  # another build layout, or no CPU backend library: nothing to avoid
        return False


class Weights:
    """A llama_model, freed when the last holder (the model, its tokenizer) lets go."""

    def __init__(self, lib, path: Path, gpu_layers: int, batch_invariant: bool = False):
        self.lib = lib
        params = lib.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        if batch_invariant:
            params.use_extra_bufts = False  # repacked weights take another kernel for batches than for one row
        if gpu_layers == 0 and _amx_buffers():
            # every weight in the plain CPU buffer: the AMX kernels of llama.cpp as built by
            # llama-cpp-python 0.3.36 crash on multi-token forwards of quantized (Q8_0) weights
            # on CPUs with AMX, and every verify is a multi-token forward
            params.use_extra_bufts = False
            params.tensor_buft_overrides = ctypes.cast(_CPU_ONLY.overrides, ctypes.c_void_p)
        clear_log()
        self.model = lib.llama_model_load_from_file(os.fsencode(path), params)
        if not self.model:
            raise SpecDecError(f"llama.cpp could not load {path}{last_log()}")
        self.vocab = lib.llama_model_get_vocab(self.model)

    def __del__(self):
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)


class GGUFTokenizer:
    """The tokenizer stored in a GGUF file, through llama.cpp, with the Hugging Face methods specdec uses."""

    def __init__(self, weights: Weights):
        self._weights = weights  # keeps the llama_model alive as long as the tokenizer
        lib, model, vocab = weights.lib, weights.model, weights.vocab
        self._lib, self._vocab = lib, vocab
        self._size = lib.llama_vocab_n_tokens(vocab)
        eos = lib.llama_vocab_eos(vocab)
        bos = lib.llama_vocab_bos(vocab)
        self.eos_token_id = eos if eos >= 0 else None
        self.bos_token_id = bos if bos >= 0 else None
        template = lib.llama_model_chat_template(model, None)
        self.chat_template = template.decode("utf-8") if template else None
        self._pieces: dict[tuple[int, bool], bytes] = {}

    def __len__(self) -> int:
        return self._size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        ids = (self._lib.llama_token * capacity)()
        count = self._lib.llama_tokenize(self._vocab, data, len(data), ids, capacity, add_special_tokens, True)
        if count < 0:  # the buffer was too small: -count is the size needed
            return self._encode_into(data, -count, add_special_tokens)
        return list(ids[:count])

    def _encode_into(self, data: bytes, capacity: int, add_special_tokens: bool) -> list[int]:
        ids = (self._lib.llama_token * capacity)()
        count = self._lib.llama_tokenize(self._vocab, data, len(data), ids, capacity, add_special_tokens, True)
        return list(ids[:count])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return b"".join(self._piece(int(i), not skip_special_tokens) for i in ids).decode("utf-8", "replace")

    def _piece(self, token: int, special: bool) -> bytes:
        key = (token, special)
        if key not in self._pieces:
            if not 0 <= token < self._size:
                raise ValueError(f"token id {token} is outside the vocabulary of {self._size}")
            buffer = ctypes.create_string_buffer(64)
            length = self._lib.llama_token_to_piece(self._vocab, token, buffer, 64, 0, special)
            if length < 0:
                buffer = ctypes.create_string_buffer(-length)
                length = self._lib.llama_token_to_piece(self._vocab, token, buffer, -length, 0, special)
            self._pieces[key] = buffer.raw[:length]
        return self._pieces[key]

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes, a control token's marked by a leading 0xff (as grammar engines take them)."""
        control = self._lib.LLAMA_TOKEN_ATTR_CONTROL
        return [(b"\xff" if self._lib.llama_vocab_get_attr(self._vocab, i) & control else b"") + self._piece(i, True)
                for i in range(self._size)]

    def get_vocab(self) -> dict[str, int]:
        vocab = {}
        for i in range(self._size):
            vocab.setdefault(self._lib.llama_vocab_get_text(self._vocab, i).decode("utf-8", "replace"), i)
        return vocab

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True,
                            tools: list[dict] | None = None):
        """Render the GGUF's chat template (Jinja, sandboxed, with the names transformers gives templates)
        and tokenize it as given."""
        if not self.chat_template:
            raise SpecDecError("the model has no chat template")
        special = {name: self.decode([i], skip_special_tokens=False) if i is not None else ""
                   for name, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id))}
        text = _template(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    tools=tools, **special)
        return self.encode(text, add_special_tokens=False) if tokenize else text


@functools.lru_cache(maxsize=8)
def _template(source: str):
    """A chat template compiled as transformers compiles one: sandboxed, with loop controls, its
    `tojson` (no HTML escaping), `raise_exception` and `strftime_now`, which templates that render
    tools use."""
    import json
    from datetime import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = lambda value, indent=None, ensure_ascii=False, separators=None, sort_keys=False: (
        json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys))
    environment.globals.update(raise_exception=raise_exception,
                               strftime_now=lambda format: datetime.now().strftime(format))
    return environment.from_string(source)
