"""How a model runs: the options both backends read, declared once."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import SpecDecError

BACKENDS = ("auto", "transformers", "llamacpp")
OUTPUT_LAYERS = ("auto", "specdec", "llama.cpp")  # who computes a GGUF model's logits on the CPU (see cpu_head)
COMPILE_CHOICES = ("auto", "on", "off", "graphs", "inductor", "aot_eager", "static")  # see RuntimeConfig.compile


@dataclass(frozen=True)
class RuntimeConfig:
    """Options for loading a model (`specdec.runtime.load_model`).

    backend: "auto" (a .gguf file runs on llama.cpp, a checkpoint directory on transformers),
    "transformers" or "llamacpp".
    transformers: device ("cpu", "cuda", "cuda:1"; default cuda when there is one), dtype,
    attn_implementation; compile: "auto" ("on" on a GPU, "off" on the CPU), "on" (a static KV pool
    and forwards run per shape, `runtime.static`: "graphs" on a GPU, "inductor" on the CPU), "off"
    (growing caches, eager kernels), or how the pool's forwards run: "graphs" (CUDA graphs captured
    by hand), "inductor" (torch.compile's kernels, CUDA graphs on a GPU), "aot_eager" (traced by
    torch.compile, run eagerly), "static" (the pool, nothing compiled).
    llama.cpp: gpu_layers (layers offloaded where the build has a GPU backend; -1 = all), tokenizer
    (a Hugging Face tokenizer directory to use instead of the file's own), output_layer ("auto",
    "specdec" or "llama.cpp": who computes the logits from the final norm's rows on the CPU,
    `runtime.cpu_head`), batch_invariant (kernels that give a row the same logits in a batch of any
    size, checked at load, so greedy speculation equals plain greedy decoding bit for bit).
    Both: threads (CPU threads; torch's for transformers), context (llama.cpp: KV cells; the static
    pool: a row's length; default min(4096, the trained context)).
    """

    backend: str = "auto"
    device: str | None = None
    dtype: str | None = None
    attn_implementation: str | None = None
    compile: str = "auto"
    threads: int | None = None
    context: int | None = None
    gpu_layers: int | None = None
    tokenizer: str | None = None
    output_layer: str = "auto"
    batch_invariant: bool = False

    def __post_init__(self):
        for name, value, choices in (("backend", self.backend, BACKENDS), ("output layer", self.output_layer, OUTPUT_LAYERS),
                                     ("compile setting", self.compile, COMPILE_CHOICES)):
            if value not in choices:
                raise SpecDecError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
        for name, value in (("threads", self.threads), ("context", self.context)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SpecDecError(f"{name} must be a positive integer, got {value!r}")
        if self.gpu_layers is not None and (isinstance(self.gpu_layers, bool) or not isinstance(self.gpu_layers, int)):
            raise SpecDecError(f"gpu_layers must be an integer (-1 = all), got {self.gpu_layers!r}")
