"""specdec: lossless speculative decoding for local Hugging Face checkpoints.

    import specdec
    # self-tuning by default; gamma=4 for a fixed chain
    decoder = specdec.load("path/to/target", draft="path/to/draft")
    result = decoder.generate("def fibonacci(n):", max_new_tokens=64, temperature=0)
    print(result.text, result.stats.acceptance_rate)
    for delta in decoder.stream("def fibonacci(n):"):
        print(delta, end="", flush=True)
"""

from specdec.api import GenerationResult, SpeculativeDecoder, Stream, load
from specdec.drafters import AutoDrafter, Drafter, History, ModelDrafter, NgramDrafter, PromptLookupDrafter, TreeShape
from specdec.errors import SpecDecError
from specdec.runtime import CausalLM, load_model
from specdec.types import GenerationStats, Limits, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "load", "load_model", "SpeculativeDecoder", "GenerationResult", "GenerationStats", "Stream",
    "SamplingParams", "Limits", "SpecDecError", "CausalLM",
    "AutoDrafter", "Drafter", "History", "ModelDrafter", "NgramDrafter", "PromptLookupDrafter", "TreeShape",
]
