"""Drafters behind one protocol: a draft model (chain, tree, staged), prompt lookup, the Katz trigram,
and the default that combines a draft model, prompt lookup, a prediction and the history of earlier
requests under the cost-aware policy."""

from specdec.drafters.auto import AutoDrafter
from specdec.drafters.base import Drafter
from specdec.drafters.history import History
from specdec.drafters.model import ModelDrafter, TreeShape
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["AutoDrafter", "Drafter", "History", "ModelDrafter", "NgramDrafter", "PromptLookupDrafter", "TreeShape"]
