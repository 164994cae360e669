"""Loading a local Hugging Face checkpoint: onto growing caches (`hf.HFModel`) or, where the model
allows it, onto the static pool (`static.StaticHFModel`). Above both, so that neither imports the other's loader."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdec.config import missing_model
from specdec.errors import SpecDecError
from specdec.runtime.cpu_matmul import use_small_batch_matmul
from specdec.runtime.hf import HFModel
from specdec.runtime.static import StaticHFModel, static_refusal

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> str:
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as error:
        raise SpecDecError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from error
    if kind == "cuda" and not torch.cuda.is_available():
        raise SpecDecError(f"device {device!r} was asked for but this torch build sees no CUDA device")
    if kind not in ("cpu", "cuda"):
        raise SpecDecError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """float32 on CPU unless asked; bfloat16 on CUDA unless asked."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SpecDecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str | os.PathLike, device: str | None = None, dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None, compile_backend: str | None = None, context: int | None = None,
    required: bool = False, rows: int = 2,
) -> HFModel:
    """Load a local checkpoint directory (config.json, *.safetensors, tokenizer files) or a GGUF
    file, whose weights transformers dequantizes (it needs the `gguf` package).

    Never downloads, never runs remote code, never unpickles: `.bin` weights are refused.
    attn_implementation: "eager", "sdpa", "flex_attention" ... (default: what transformers picks).
    compile_backend: run on a static pool whose forwards run this way (`static.COMPILE_BACKENDS`;
    None: growing caches, eager kernels); a model the pool cannot take then keeps the eager path and
    says why, unless `required`. context: a row's length; rows: sequences the pool holds before it
    grows (a server's batch, and a kept prefix).
    """
    path = Path(path).expanduser()
    device = check_device(device or default_device())
    if context is not None and compile_backend is None:
        raise SpecDecError("context applies to GGUF files on llama.cpp and to static slots (compile on); "
                           "a transformers cache with compile off grows to the model's context")
    if path.suffix.lower() == ".gguf":
        _check_gguf_file(path)
    else:
        _check_checkpoint_dir(path)
    model, tokenizer = _read_checkpoint(path, resolve_dtype(dtype, device), attn_implementation)
    if torch.device(device).type == "cpu":
        use_small_batch_matmul(model)
    model = model.to(device)
    if compile_backend is None:
        return HFModel(model, tokenizer, str(path))
    refusal = static_refusal(model.config)
    if refusal and not required:  # today's path, and why
        print(f"specdec: {path} runs without a static cache: {refusal}", file=sys.stderr)
        return HFModel(model, tokenizer, str(path))
    return StaticHFModel(model, tokenizer, str(path), context=context, backend=compile_backend, rows=rows)


def _read_checkpoint(path: Path, torch_dtype: torch.dtype, attn_implementation: str | None):
    """The transformers model (on the CPU) and tokenizer of a checked directory or GGUF file."""
    gguf = path.suffix.lower() == ".gguf"
    source = dict(gguf_file=path.name) if gguf else dict(use_safetensors=True)
    directory = path.parent if gguf else path
    with no_progress_bars():  # a bar per load of a local file says nothing
        return _from_pretrained(path, directory, source, gguf, torch_dtype, attn_implementation)


@contextmanager
def no_progress_bars():
    """transformers' progress bars off, as they were after."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()


def _from_pretrained(path: Path, directory: Path, source: dict, gguf: bool, torch_dtype: torch.dtype,
                     attn_implementation: str | None):
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False, **source)
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False,
                                                  **({"gguf_file": path.name} if gguf else {}))
        model, info = AutoModelForCausalLM.from_pretrained(
            directory,
            config=config,
            dtype=torch_dtype,
            **source,
            local_files_only=True,
            trust_remote_code=False,
            output_loading_info=True,
            **({"attn_implementation": attn_implementation} if attn_implementation else {}),
            # grouped-matmul expert kernels (MoE) take no float64: the reference loop does
            **({"experts_implementation": "eager"} if torch_dtype == torch.float64 else {}),
        )
    except Exception as error:  # a corrupt or incomplete checkpoint: say which and why
        message = " ".join(str(error).split())  # one line, whatever the library printed
        raise SpecDecError(f"could not load the model in {path}: {type(error).__name__}: {message}") from error
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would fill them with random values and only log it
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise SpecDecError(f"{path}: the safetensors files lack weights {', '.join(missing[:3])}{more}")
    return model, tokenizer


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise missing_model(path)
    try:
        import gguf  # noqa: F401 (transformers reads GGUF files with it)
    except ImportError:
        raise SpecDecError("transformers reads a GGUF file with the `gguf` package: pip install gguf "
                           "(or run the file on llama.cpp, the default backend for .gguf)") from None


def _check_checkpoint_dir(path: Path) -> None:
    if not path.is_dir():
        raise missing_model(path) if not path.exists() else SpecDecError(
            f"{path} is a file, not a checkpoint directory (a .gguf file runs on llama.cpp)")
    if not (path / "config.json").is_file():
        raise SpecDecError(f"{path} has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise SpecDecError(f"{path / 'config.json'} is not valid JSON: {error}") from error
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (f" (found {', '.join(pickled)}: pickled weights are never loaded; convert them to safetensors)"
                if pickled else "")
        raise SpecDecError(f"{path} has no .safetensors weights{hint}")
    if not any((path / name).is_file()
               for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
        raise SpecDecError(f"{path} has no tokenizer files (tokenizer.json or tokenizer_config.json)")
