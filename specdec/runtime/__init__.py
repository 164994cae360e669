"""Models behind the project's own interface: explicit positions, masks and cache control."""

from specdec.runtime.model import CausalLM, load_model
from specdec.runtime.vocab import check_same_vocabulary, tokenizer_fingerprint

__all__ = ["CausalLM", "load_model", "check_same_vocabulary", "tokenizer_fingerprint"]
