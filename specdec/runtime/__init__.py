"""Models behind one protocol (`base.CausalLM`): Hugging Face transformers or llama.cpp."""

from __future__ import annotations

import os

from specdec.errors import SpecDecError
from specdec.runtime.base import CausalLM, Sequence, require_trees
from specdec.runtime.vocab import check_same_vocabulary, tokenizer_fingerprint

BACKENDS = ("auto", "transformers", "llamacpp")
OUTPUT_LAYERS = ("auto", "specdec", "llama.cpp")  # who computes a GGUF model's logits on the CPU (see cpu_head)
COMPILE_CHOICES = ("auto", "on", "off", "graphs", "inductor", "aot_eager", "static")  # see load_model

__all__ = ["CausalLM", "Sequence", "BACKENDS", "OUTPUT_LAYERS", "COMPILE_CHOICES", "load_model", "load_draft", "choose_backend", "require_trees",
           "check_same_vocabulary", "tokenizer_fingerprint"]


def choose_backend(path: str | os.PathLike, backend: str = "auto") -> str:
    """"auto": a .gguf file runs on llama.cpp, anything else (a checkpoint directory) on transformers."""
    if backend not in BACKENDS:
        raise SpecDecError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return "llamacpp" if str(path).lower().endswith(".gguf") else "transformers"


def load_model(
    path: str | os.PathLike,
    backend: str = "auto",
    device: str | None = None,
    dtype: str | None = None,
    attn_implementation: str | None = None,
    threads: int | None = None,
    gpu_layers: int | None = None,
    context: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    slots: int = 1,
    prefix_cells: int = 0,
    output_layer: str = "auto",
    batch_invariant: bool = False,
    compile: str = "auto",
) -> CausalLM:
    """Load a model on the backend its path (or `backend`) selects.

    transformers: a checkpoint directory; device, dtype and attn_implementation apply.
    llamacpp: a .gguf file; gpu_layers (layers offloaded where the build has a GPU backend; -1 = all)
    and context (KV cells, default min(4096, the trained context)) apply.
    threads: CPU threads (torch's for transformers). tokenizer (llamacpp): a Hugging Face tokenizer
    directory to use instead of the one in the GGUF file. slots: how many sequences of the full
    context must fit at once (llama.cpp sizes its shared KV cache by it, static slots their pool; growing
    transformers caches need no size).
    prefix_cells (llama.cpp): KV cells beyond the slots' for prefixes kept between generations
    (`specdec.runtime.prefix.PrefixCache`). output_layer (llama.cpp on the CPU): "auto", "specdec"
    or "llama.cpp", who computes the logits from the final norm's rows (`specdec.runtime.cpu_head`).
    batch_invariant (llama.cpp): kernels that give a row the same logits in a batch of any size (no
    repacked weights, no tiled matmuls; checked at load, refused where they still differ), so
    greedy speculation equals plain greedy decoding bit for bit; costs are in the README.
    compile (transformers): "auto" (default: "on" on a GPU, "off" on the CPU), "on" (a static KV
    pool and forwards compiled per shape, `specdec.runtime.static`: "graphs" on a GPU, "inductor" on
    the CPU), "off" (growing caches, eager kernels), or how the pool's forwards run: "graphs" (CUDA
    graphs captured by hand), "inductor" (torch.compile's kernels, CUDA graphs on a GPU),
    "aot_eager" (traced by torch.compile, run eagerly), "static" (the pool, nothing compiled);
    context then caps a row of the pool (default min(4096, the trained context)).
    """
    if isinstance(prefix_cells, bool) or not isinstance(prefix_cells, int) or prefix_cells < 0:
        raise SpecDecError(f"prefix cells must be a number >= 0, got {prefix_cells!r}")
    if isinstance(threads, bool) or (threads is not None and (not isinstance(threads, int) or threads < 1)):
        raise SpecDecError(f"threads must be a positive integer, got {threads!r}")
    hf_tokenizer = _load_tokenizer(tokenizer) if tokenizer is not None else None
    if choose_backend(path, backend) == "llamacpp":
        ignored = [name for name, value in (("device", device), ("dtype", dtype), ("attn_implementation", attn_implementation)) if value]
        if ignored:
            raise SpecDecError(f"{', '.join(ignored)} apply to transformers checkpoints; a GGUF file fixes its types "
                               "(use gpu_layers to offload to a GPU)")
        from specdec.runtime.llamacpp import LlamaCppModel

        if compile_backend(compile, "cpu") is not None:
            raise SpecDecError("compile applies to transformers checkpoints; llama.cpp runs its own graphs")
        return LlamaCppModel(path, threads=threads, gpu_layers=gpu_layers or 0, context=context, tokenizer=hf_tokenizer, slots=slots,
                             prefix_cells=prefix_cells, output_layer=output_layer, batch_invariant=batch_invariant)
    if gpu_layers is not None or tokenizer is not None or output_layer != "auto" or batch_invariant:
        raise SpecDecError("gpu_layers, tokenizer, output_layer and batch_invariant apply to GGUF files on llama.cpp; "
                           "a checkpoint directory has its own tokenizer (use device to choose a GPU)")
    from specdec.runtime.hf import default_device, load_model as load_hf

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return load_hf(path, device=device, dtype=dtype, attn_implementation=attn_implementation,
                   compile_backend=compile_backend(compile, device or default_device()), context=context, required=compile != "auto",
                   rows=slots + 1)  # the batch and one kept prefix; the pool grows past that


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


def load_draft(path: str | os.PathLike, target: CausalLM, **options) -> CausalLM:
    """A draft model for `target` (options as for `load_model`). A distilled draft that predicts only
    part of the target's vocabulary is wrapped to speak the target's ids (`runtime.pruned`)."""
    from specdec.runtime.pruned import PrunedVocab, VocabMap

    model = load_model(path, **options)
    vocab_map = VocabMap.of(path)
    return model if vocab_map is None else PrunedVocab(model, vocab_map, target.tokenizer)


def _load_tokenizer(directory: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as error:
        raise SpecDecError(f"could not load a tokenizer from {directory}: {' '.join(str(error).split())}") from error
