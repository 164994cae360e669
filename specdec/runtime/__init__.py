"""Models behind one protocol (`base.CausalLM`): Hugging Face transformers or llama.cpp."""

from __future__ import annotations

import os
from dataclasses import replace

from specdec.errors import SpecDecError
from specdec.runtime.base import CachedSequence, CausalLM, require_trees
from specdec.config import BACKENDS, COMPILE_CHOICES, OUTPUT_LAYERS, RuntimeConfig
from specdec.runtime.vocab import check_same_vocabulary, tokenizer_fingerprint

__all__ = ["CausalLM", "CachedSequence", "RuntimeConfig", "BACKENDS", "OUTPUT_LAYERS", "COMPILE_CHOICES", "load_model", "load_draft",
           "choose_backend", "require_trees", "check_same_vocabulary", "tokenizer_fingerprint"]


def choose_backend(path: str | os.PathLike, backend: str = "auto") -> str:
    """"auto": a .gguf file runs on llama.cpp, anything else (a checkpoint directory) on transformers."""
    if backend not in BACKENDS:
        raise SpecDecError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return "llamacpp" if str(path).lower().endswith(".gguf") else "transformers"


def load_model(path: str | os.PathLike, config: RuntimeConfig | None = None, *, slots: int = 1, prefix_cells: int = 0,
               **options) -> CausalLM:
    """Load a model on the backend its path (or `config.backend`) selects. `config` (or its fields
    as keywords, which override it): see `RuntimeConfig`. slots: how many sequences of the full
    context must fit at once (llama.cpp sizes its shared KV cache by it, the static pool its rows;
    growing transformers caches need no size). prefix_cells (llama.cpp): KV cells beyond the slots'
    for prefixes kept between generations (`specdec.runtime.prefix.PrefixCache`)."""
    config = replace(config or RuntimeConfig(), **options)
    if isinstance(prefix_cells, bool) or not isinstance(prefix_cells, int) or prefix_cells < 0:
        raise SpecDecError(f"prefix cells must be a number >= 0, got {prefix_cells!r}")
    if choose_backend(path, config.backend) == "llamacpp":
        return _load_gguf(path, config, slots, prefix_cells)
    return _load_checkpoint(path, config, slots)


def _load_gguf(path, config: RuntimeConfig, slots: int, prefix_cells: int) -> CausalLM:
    ignored = [name for name in ("device", "dtype", "attn_implementation") if getattr(config, name)]
    if ignored:
        raise SpecDecError(f"{', '.join(ignored)} apply to transformers checkpoints; a GGUF file fixes its types "
                           "(use gpu_layers to offload to a GPU)")
    if compile_backend(config.compile, "cpu") is not None:
        raise SpecDecError("compile applies to transformers checkpoints; llama.cpp runs its own graphs")
    from specdec.runtime.llamacpp import LlamaCppModel

    tokenizer = _load_tokenizer(config.tokenizer) if config.tokenizer is not None else None
    return LlamaCppModel(path, threads=config.threads, gpu_layers=config.gpu_layers or 0, context=config.context, tokenizer=tokenizer,
                         slots=slots, prefix_cells=prefix_cells, output_layer=config.output_layer, batch_invariant=config.batch_invariant)


def _load_checkpoint(path, config: RuntimeConfig, slots: int) -> CausalLM:
    if config.gpu_layers is not None or config.tokenizer is not None or config.output_layer != "auto" or config.batch_invariant:
        raise SpecDecError("gpu_layers, tokenizer, output_layer and batch_invariant apply to GGUF files on llama.cpp; "
                           "a checkpoint directory has its own tokenizer (use device to choose a GPU)")
    from specdec.runtime.checkpoints import default_device, load_model as load_hf

    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    return load_hf(path, device=config.device, dtype=config.dtype, attn_implementation=config.attn_implementation,
                   compile_backend=compile_backend(config.compile, config.device or default_device()), context=config.context,
                   required=config.compile != "auto", rows=slots + 1)  # the batch and one kept prefix; the pool grows past that


def compile_backend(compile: str, device: str) -> str | None:
    """The torch.compile backend for static slots, or None for the eager path (see load_model)."""
    if compile not in COMPILE_CHOICES:
        raise SpecDecError(f"unknown compile setting {compile!r}; choose one of {', '.join(COMPILE_CHOICES)}")
    cuda = str(device).startswith("cuda")
    if compile == "auto":
        return "graphs" if cuda else None
    if compile == "on":  # graphs of the eager kernels on a GPU: seconds to capture, where Inductor takes minutes
        return "graphs" if cuda else "inductor"
    return None if compile == "off" else compile


def load_draft(path: str | os.PathLike, target: CausalLM, config: RuntimeConfig | None = None, *, slots: int = 1, **options) -> CausalLM:
    """A draft model for `target` (as `load_model` loads it). A distilled draft that predicts only
    part of the target's vocabulary is wrapped to speak the target's ids (`runtime.pruned`)."""
    from specdec.runtime import head
    from specdec.runtime.pruned import PrunedVocab, VocabMap

    if head.is_head(path):  # a draft head on the target's states
        net, vocab_map = head.load_head(path, head.inference_dtype())
        return PrunedVocab(head.HeadModel(net, vocab_map, target, str(path)), vocab_map, target.tokenizer)
    model = load_model(path, config, slots=slots, **options)
    vocab_map = VocabMap.of(path)
    return model if vocab_map is None else PrunedVocab(model, vocab_map, target.tokenizer)


def _load_tokenizer(directory: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as error:
        raise SpecDecError(f"could not load a tokenizer from {directory}: {' '.join(str(error).split())}") from error
