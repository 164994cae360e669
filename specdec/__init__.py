"""specdec: lossless speculative decoding for local Hugging Face checkpoints.

    import specdec
    # self-tuning by default; gamma=4 for a fixed chain
    decoder = specdec.load("path/to/target", draft="path/to/draft")
    result = decoder.generate("def fibonacci(n):", max_new_tokens=64, temperature=0)
    print(result.text, result.stats.acceptance_rate)
    for delta in decoder.stream("def fibonacci(n):"):
        print(delta, end="", flush=True)
"""

from importlib import import_module

__version__ = "0.1.0"

# what `import specdec` offers, and the module each comes from: imported on first use (PEP 562), so
# that the command line (`specdec.cli`) answers --help or a bad value before torch is imported
_EXPORTS = {
    "specdec.api": ["load", "SpeculativeDecoder", "GenerationResult", "Stream"],
    "specdec.runtime": ["load_model", "CausalLM"],
    "specdec.types": ["GenerationStats"],
    "specdec.params": ["SamplingParams", "Limits"],
    "specdec.errors": ["SpecDecError"],
    "specdec.constraints": ["Constraint"],
    "specdec.drafters": ["AutoDrafter", "Drafter", "History", "ModelDrafter", "NgramDrafter", "PromptLookupDrafter",
                         "TreeShape"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:  # a submodule (`specdec.runtime`), as an eager package would have it
        try:
            return import_module(f"specdec.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"specdec.{name}":
                raise
            raise AttributeError(f"module 'specdec' has no attribute {name!r}") from None
    value = getattr(import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # the next lookup finds it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
