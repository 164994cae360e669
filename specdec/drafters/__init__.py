"""Drafters behind one protocol: a draft model (chain, tree, staged), prompt lookup, the Katz trigram."""

from specdec.drafters.base import Drafter
from specdec.drafters.model import ModelDrafter, TreeShape
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "PromptLookupDrafter", "TreeShape"]
