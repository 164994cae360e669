"""The one builder: configurations (`specdec.config`) into loaded models, drafters and a decoder.

`DRAFTERS` maps a drafter kind to the function that assembles it from loaded parts; `specdec.load`,
the CLI, the server and the bench all assemble drafters through it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Callable

from specdec.config import DecoderConfig, DrafterSpec
from specdec.decoder import SpeculativeDecoder
from specdec.drafters import AutoDrafter, Drafter, History, ModelDrafter, NgramDrafter, PromptLookupDrafter
from specdec.engine import keep_target_states
from specdec.errors import SpecDecError
from specdec.katz import KatzTrigram
from specdec.runtime import CausalLM, choose_backend, load_draft, load_model


@dataclass
class Parts:
    """Loaded models a drafter is assembled from (None where the spec needs none)."""

    draft: CausalLM | None = None
    ngram: KatzTrigram | None = None


def _model_drafter(spec: DrafterSpec, parts: Parts) -> ModelDrafter:
    inner = DRAFTERS[spec.inner](replace(spec, kind=spec.inner, tree=None, inner=None), parts) if spec.inner else None
    return ModelDrafter(parts.draft, tree=spec.tree, inner=inner, inner_gamma=spec.inner_gamma)


DRAFTERS: dict[str, Callable[[DrafterSpec, Parts], Drafter | None]] = {
    "plain": lambda spec, parts: None,
    "auto": lambda spec, parts: AutoDrafter(_model_drafter(spec, parts) if parts.draft is not None else None,
                                            PromptLookupDrafter()),
    "model": _model_drafter,
    "ngram": lambda spec, parts: NgramDrafter(parts.ngram, stochastic=spec.ngram_stochastic),
    "lookup": lambda spec, parts: PromptLookupDrafter(),
}


def assemble(spec: DrafterSpec, parts: Parts) -> Drafter | None:
    """The drafter `spec` names, over models already loaded."""
    return DRAFTERS[spec.kind](spec, parts)


def with_demo_paths(config: DecoderConfig) -> DecoderConfig:
    """`config` with the demo pair's files wherever it names no target (its draft model, and its
    n-gram model where the spec drafts with one)."""
    if config.target is not None:
        return config
    from specdec.demo import demo_models, demo_ngram

    target, draft = demo_models(config.runtime.backend)
    spec = config.drafter
    if spec.uses_draft_model and spec.draft is None and spec.demo_draft:
        spec = replace(spec, draft=draft)
    if spec.uses_ngram and spec.ngram is None:
        spec = replace(spec, ngram=str(demo_ngram()))
    return replace(config, target=target, drafter=spec)


def build_decoder(config: DecoderConfig, prepare: bool = True) -> SpeculativeDecoder:
    """Load the models `config` names and assemble its decoder, its forward costs read or measured
    (unless not `prepare`: `specdec profile` measures them itself)."""
    if config.target is None:
        choose_backend("", config.runtime.backend)  # validates the name before the demo pair is looked for
    config = with_demo_paths(config)
    spec, runtime = config.drafter, config.runtime
    target = load_model(config.target, runtime, slots=config.slots, prefix_tokens=config.prefix_cache)
    parts = Parts()
    if spec.uses_draft_model and spec.draft is not None:
        parts.draft = load_draft(spec.draft, target, runtime, slots=config.slots)
    if spec.uses_ngram:
        parts.ngram = KatzTrigram.load(spec.ngram)
    if config.chat_template is not None:
        target.tokenizer.chat_template = config.chat_template
    drafter = assemble(spec, parts)
    keep_target_states(target, drafter)  # before the warm-up, as every engine will: graphs are keyed by the states
    for role, model in (("target", target), ("draft model", parts.draft)):
        if model is not None:
            warmed(model, role, config.slots)
    return SpeculativeDecoder(target, drafter, config.gamma, config.explore, history=history(config, drafter),
                              prefix_cache=config.prefix_cache, share_acceptance=config.share_acceptance,
                              prepare=prepare)


def warmed(model: CausalLM, role: str, rows: int) -> None:
    """Compile the model's forwards for batches of up to `rows` now (a GPU's static pool), not inside the
    first requests, and say how long that took."""
    seconds = model.warm_up(rows)
    if seconds:
        print(f"specdec: the {role}'s forwards compiled in {seconds:.1f} s (Inductor keeps its kernels on disk for "
              "the next process: TORCHINDUCTOR_CACHE_DIR)", file=sys.stderr)


def history(config: DecoderConfig, drafter: Drafter | None) -> History | None:
    """Earlier requests' history, for a drafter that drafts from one (None: off, or one that does not)."""
    if drafter is None or not drafter.takes_chains:
        if config.history_tokens or config.share_history:
            raise SpecDecError("--history-tokens and --share-history are for the default drafter; "
                               "this decoder runs a fixed strategy")
        return None
    if config.history_tokens == 0:
        return None
    tokens = {} if config.history_tokens is None else {"tokens": config.history_tokens}
    return History(**tokens, shared=config.share_history)
