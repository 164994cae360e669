"""The Python API's front door: `load` a target and a drafter, then generate text or stream it.

    decoder = specdec.load("path/to/target", draft="path/to/draft")
    print(decoder.generate("def fibonacci(n):", max_new_tokens=64, temperature=0).text)

`load` is a thin wrapper: its keywords become a `DecoderConfig` (`specdec.config`), which the one
builder (`specdec.build`) turns into a `SpeculativeDecoder` (`specdec.decoder`).
"""

from __future__ import annotations

from dataclasses import replace

from specdec.build import build_decoder
from specdec.config import GAMMA, PREFIX_TOKENS, DecoderConfig, DrafterSpec, RuntimeConfig, TreeShape
from specdec.decoder import Generation, GenerationResult, SpeculativeDecoder, Stream, TextAssembler

__all__ = ["load", "SpeculativeDecoder", "GenerationResult", "Generation", "Stream", "TextAssembler"]


def load(
    target: str | None = None,
    draft: str | None = None,
    *,
    ngram: str | None = None,
    prompt_lookup: bool = False,
    tree: int | TreeShape | None = None,
    staged: bool = False,
    plain: bool = False,
    gamma: int | str = GAMMA,
    explore: bool = True,
    prefix_cache: int | None = PREFIX_TOKENS,
    slots: int = 1,
    share_acceptance: bool = False,
    runtime: RuntimeConfig | None = None,
    **runtime_options,
) -> SpeculativeDecoder:
    """Load a target and a drafter.

    The default (gamma "auto", no n-gram, tree or staging): the `AutoDrafter`, prompt lookup and
    the draft model (when there is one) in one tree shaped every iteration by the cost-aware policy.
    With a fixed gamma, one drafter: a draft model, an n-gram file or prompt lookup, or none.
    `plain`: no drafter at all. `tree` (a node budget or a TreeShape) makes the draft model draft
    token trees `gamma` deep. `staged` makes the draft model draft with the n-gram model or prompt
    lookup as its own drafter (draft², Spector & Ré). With no target, the demo pair shipped with
    specdec (`specdec.demo`). `explore`, `prefix_cache` (tokens kept between generations),
    `share_acceptance` (a server's): see `SpeculativeDecoder`; `slots`: generations that may run at
    once. How the models run: a `RuntimeConfig`, or its fields as keywords (backend, device, dtype,
    threads, ...), which apply to both models (`batch_invariant` to the target only). Refused:
    drafter combinations that mean nothing, and trees on a model that cannot score them exactly.
    Extra drafter options: `inner_gamma` (draft² tokens per draft-model forward) and `ngram_stochastic`.
    """
    drafter_options = {k: runtime_options.pop(k) for k in ("inner_gamma", "ngram_stochastic") if k in runtime_options}
    if tree is not None and not isinstance(tree, TreeShape):
        tree = TreeShape(nodes=tree)  # validates the budget
    spec = DrafterSpec.choose(target_given=target is not None, draft=draft, ngram=ngram, prompt_lookup=prompt_lookup,
                              tree=tree, staged=staged, gamma=gamma, plain=plain, **drafter_options)
    config = DecoderConfig(target=target, drafter=spec, runtime=replace(runtime or RuntimeConfig(), **runtime_options),
                           gamma=gamma, explore=explore, prefix_cache=prefix_cache or 0, slots=slots,
                           share_acceptance=share_acceptance)
    return build_decoder(config)
