"""Models behind one protocol (`base.CausalLM`): Hugging Face transformers or llama.cpp."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable

from specdec.config import BACKENDS, COMPILE_CHOICES, OUTPUT_LAYERS, RuntimeConfig
from specdec.errors import SpecDecError, check_integer
from specdec.runtime.base import CachedSequence, CausalLM, require_trees
from specdec.runtime.vocab import check_same_vocabulary, tokenizer_fingerprint

__all__ = ["CausalLM", "CachedSequence", "RuntimeConfig", "BACKENDS", "OUTPUT_LAYERS", "COMPILE_CHOICES", "Placement",
           "load_model", "load_draft", "choose_backend", "placement", "runs_gguf", "takes_device", "require_trees",
           "check_same_vocabulary", "tokenizer_fingerprint"]


@dataclass(frozen=True)
class Placement:
    """Where a model will run, known before it loads."""

    on_gpu: bool  # its forwards will run on a GPU, in whole or in part (offloaded layers)
    fixed_slots: bool  # its KV cache is sized for every slot at load, as llama.cpp's is (a static pool grows)


def choose_backend(path: str | os.PathLike, backend: str = "auto") -> str:
    """"auto": a .gguf file runs on llama.cpp, anything else (a checkpoint directory) on transformers."""
    if backend not in BACKENDS:
        raise SpecDecError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return "llamacpp" if str(path).lower().endswith(".gguf") else "transformers"


def runs_gguf(backend: str = "auto") -> bool:
    """Whether `backend` runs a GGUF file as it is ("auto": yes); transformers dequantizes one, so the
    demo pair comes as checkpoints there and as GGUF files everywhere else."""
    return _BACKENDS[choose_backend(".gguf", backend)].native_gguf


def takes_device(path: str | os.PathLike, backend: str = "auto") -> bool:
    """Whether the model at `path` is placed by `RuntimeConfig.device` (transformers) rather than by
    offloaded layers (`RuntimeConfig.gpu_layers`, llama.cpp)."""
    return _BACKENDS[choose_backend(path, backend)].takes_device


def placement(path: str | os.PathLike | None, config: RuntimeConfig | None = None) -> Placement:
    """Where the model at `path` will run, as `config` loads it, before it loads (a server sizes its
    batch by it). None: the demo pair, whose files are GGUF files where the backend runs them (`runs_gguf`)."""
    config = config or RuntimeConfig()
    backend = _BACKENDS[choose_backend(path if path is not None else ".gguf", config.backend)]
    # offloaded layers count wherever they are asked for (a checkpoint refuses them at load)
    return Placement(on_gpu=bool(config.gpu_layers) or backend.on_gpu(config), fixed_slots=backend.fixed_slots)


def load_model(path: str | os.PathLike, config: RuntimeConfig | None = None, *, slots: int = 1, prefix_tokens: int = 0,
               prefix_cells: int = 0, **options) -> CausalLM:
    """Load a model on the backend its path (or `config.backend`) selects. `config` (or its fields
    as keywords, which override it): see `RuntimeConfig`. slots: how many sequences of the full
    context must fit at once (llama.cpp sizes its shared KV cache by it, the static pool its rows;
    growing transformers caches need no size). prefix_tokens: tokens a prefix cache will keep
    between generations (`specdec.runtime.prefix.PrefixCache`); a runtime whose KV cells are fixed
    at load (llama.cpp, unless batch invariant) keeps them in cells its slots leave free, and adds
    cells only for the part the slots cannot hold. prefix_cells (llama.cpp): KV cells added beyond
    those, as asked."""
    config = replace(config or RuntimeConfig(), **options)
    check_integer(prefix_tokens, "prefix tokens", minimum=0)
    check_integer(prefix_cells, "prefix cells", minimum=0)
    return _BACKENDS[choose_backend(path, config.backend)].load(path, config, slots, prefix_tokens, prefix_cells)


def _load_gguf(path, config: RuntimeConfig, slots: int, prefix_tokens: int, prefix_cells: int) -> CausalLM:
    ignored = [name for name in ("device", "dtype", "attn_implementation") if getattr(config, name)]
    if ignored:
        raise SpecDecError(f"{', '.join(ignored)} apply to transformers checkpoints; a GGUF file fixes its types "
                           "(use gpu_layers to offload to a GPU)")
    if compile_backend(config.compile, "cpu") is not None:
        raise SpecDecError("compile applies to transformers checkpoints; llama.cpp runs its own graphs")
    from specdec.runtime.llamacpp import LlamaCppModel

    tokenizer = _load_tokenizer(config.tokenizer) if config.tokenizer is not None else None
    return LlamaCppModel(path, threads=config.threads, gpu_layers=config.gpu_layers or 0, context=config.context,
                         tokenizer=tokenizer, slots=slots, output_layer=config.output_layer,
                         # no kept prefixes when batch invariant (their cells would be out of position order)
                         prefix_tokens=0 if config.batch_invariant else prefix_tokens, prefix_cells=prefix_cells,
                         batch_invariant=config.batch_invariant)


def _load_checkpoint(path, config: RuntimeConfig, slots: int, prefix_tokens: int, prefix_cells: int) -> CausalLM:
    """A checkpoint on transformers; kept prefixes need no room reserved (caches grow, the pool grows rows)."""
    if (config.gpu_layers is not None or config.tokenizer is not None or config.output_layer != "auto"
            or config.batch_invariant):
        raise SpecDecError("gpu_layers, tokenizer, output_layer and batch_invariant apply to GGUF files on llama.cpp; "
                           "a checkpoint directory has its own tokenizer (use device to choose a GPU)")
    from specdec.runtime.checkpoints import default_device, load_model as load_hf

    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    return load_hf(path, device=config.device, dtype=config.dtype, attn_implementation=config.attn_implementation,
                   compile_backend=compile_backend(config.compile, config.device or default_device()),
                   context=config.context, required=config.compile != "auto",
                   # the batch and one kept prefix; the pool grows past that
                   rows=slots + 1)


def _checkpoint_on_gpu(config: RuntimeConfig) -> bool:
    from specdec.runtime.checkpoints import default_device

    return str(config.device or default_device()).startswith("cuda")


@dataclass(frozen=True)
class _Backend:
    """A backend: how it loads, and what is known of its models before they load."""

    load: Callable[..., CausalLM]  # (path, config, slots, prefix tokens, prefix cells) -> the model
    native_gguf: bool  # runs a GGUF file as it is (transformers dequantizes one)
    takes_device: bool  # placed by `RuntimeConfig.device` (else by offloaded layers, `gpu_layers`)
    fixed_slots: bool  # sizes its KV cache for every slot at load
    on_gpu: Callable[[RuntimeConfig], bool]  # whether a model will run on a GPU, besides offloaded layers


_BACKENDS = {
    "llamacpp": _Backend(_load_gguf, native_gguf=True, takes_device=False, fixed_slots=True,
                         on_gpu=lambda config: False),  # only offloaded layers run on a GPU
    "transformers": _Backend(_load_checkpoint, native_gguf=False, takes_device=True, fixed_slots=False,
                             on_gpu=_checkpoint_on_gpu),
}
assert set(_BACKENDS) == set(BACKENDS) - {"auto"}, "every backend a configuration names has an entry"


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


def load_draft(path: str | os.PathLike, target: CausalLM, config: RuntimeConfig | None = None, *, slots: int = 1,
               **options) -> CausalLM:
    """A draft model for `target` (as `load_model` loads it), run beside it: a transformers draft on
    the target's device unless `config` names one (with a transformers target), and never batch
    invariant (a draft's numerics never change what is accepted). A distilled draft that predicts
    only part of the target's vocabulary is wrapped to speak the target's ids (`runtime.pruned`)."""
    from specdec.runtime import eagle3, head
    from specdec.runtime.pruned import PrunedVocab, VocabMap

    if eagle3.is_eagle3(path):  # an EAGLE-3 head, in a published layout
        return eagle3.load_eagle3(path, target)
    if head.is_head(path):  # a draft head on the target's states
        # beside a torch target on a GPU in its precision (it computes there: `HeadModel`), on the CPU as the CPU
        # multiplies best
        gpu_dtype = getattr(target, "torch_dtype", None) if target.device != "cpu" else None
        net, vocab_map = head.load_head(path, gpu_dtype or head.inference_dtype())
        return PrunedVocab(head.HeadModel(net, vocab_map, target, str(path)), vocab_map, target.tokenizer)
    config = replace(config or RuntimeConfig(), **options)
    device = config.device
    if device is None and takes_device(target.path, target.backend) and takes_device(path, config.backend):
        device = target.device
    model = load_model(path, replace(config, device=device, batch_invariant=False), slots=slots)
    vocab_map = VocabMap.of(path)
    return model if vocab_map is None else PrunedVocab(model, vocab_map, target.tokenizer)


def _load_tokenizer(directory: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as error:
        raise SpecDecError(f"could not load a tokenizer from {directory}: {' '.join(str(error).split())}") from error
