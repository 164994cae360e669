"""Peers: other implementations' generation loops on the very same loaded models, for `bench` to
measure beside specdec's strategies. Hugging Face generate() on a transformers model,
llama-cpp-python's generate() on a GGUF file; forwards are counted where the loop can be watched."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.errors import SpecDecError
from specdec.runtime.base import CausalLM
from specdec.runtime.pruned import PrunedVocab
from specdec.params import SamplingParams

PROMPT_LOOKUP_TOKENS = 10  # tokens the peers' prompt lookup proposes per step


@dataclass
class PeerRun:
    tokens: list[int]  # generated ids, cut before the first stop token
    seconds: float
    target_forwards: int  # counted where the peer's loop can be watched
    draft_forwards: int = 0
    prefill_seconds: float | None = None  # the prompt's share of `seconds`, where it could be timed apart


@dataclass
class Peer:
    """Another implementation's generation on the same models: run(prompt ids, sampling, seed)."""

    name: str
    uses_draft_model: bool
    run: Callable[[list[int], SamplingParams, int], PeerRun]


def peers(target: CausalLM, draft: CausalLM | None, max_new_tokens: int) -> list[Peer]:
    """The target backend's own generation loops on `target` (and `draft`, where the backend drafts
    with a model of the target's vocabulary). A pruned-vocabulary model is specdec's own: a pruned
    target runs its inner model's peers, a pruned draft is not given to them."""
    if isinstance(target, PrunedVocab):
        target, draft = target.inner, None
    loops = PEERS.get(target.peer_kind)
    if loops is None:
        raise SpecDecError(f"no peers for the {target.backend} backend")
    return loops(target, draft, max_new_tokens)


def cut_at_stop(tokens: list[int], stop_ids: frozenset[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[:i]
    return tokens


# ---- Hugging Face generate()


def hf_peers(target, draft, max_new_tokens: int) -> list[Peer]:
    """generate() on the very same model objects: plain, assisted by the draft model (one with the
    target's own vocabulary), and its prompt lookup; on a GPU also with a compiled static cache.
    Forwards are counted with hooks on the models."""
    import transformers

    transformers.logging.set_verbosity_error()  # generate() warns about flags set on purpose
    draft = draft if draft is not None and draft.peer_kind == target.peer_kind else None  # generate() takes its model
    target_forwards, draft_forwards = _ForwardCounter(target.model), _ForwardCounter(draft.model) if draft else None
    found = [Peer("HF generate", False, _hf_generate(target, max_new_tokens, target_forwards))]
    if draft is not None:
        found.append(Peer("HF assisted", True, _hf_generate(target, max_new_tokens, target_forwards, draft_forwards,
                                                            assistant_model=draft.model)))
    found.append(Peer("HF prompt lookup", False, _hf_generate(target, max_new_tokens, target_forwards,
                                                              prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)))
    if target.on_gpu:  # the strongest plain loop a transformers user has: a static cache, compiled
        found.append(Peer("HF generate, static cache, compiled", False,
                          _hf_generate(target, max_new_tokens, target_forwards, cache_implementation="static")))
    return found


def _hf_generate(target, max_new_tokens: int, target_forwards: _ForwardCounter, draft_forwards=None, **extra):
    stop_ids = target.stop_token_ids

    def run(prompt_ids: list[int], sampling: SamplingParams, seed: int) -> PeerRun:
        ids = torch.tensor([prompt_ids], device=target.device)
        options = dict(max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids),
                       eos_token_id=sorted(stop_ids) or None, pad_token_id=min(stop_ids, default=0))
        if sampling.greedy:
            options.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            options.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                           top_p=sampling.top_p)
        torch.manual_seed(seed)  # generate() draws from the global generator
        before_t, before_d = target_forwards.calls, draft_forwards.calls if draft_forwards else 0
        started = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(ids, **options, **extra)
        seconds = time.perf_counter() - started
        drafts = (draft_forwards.calls - before_d) if draft_forwards else 0
        return PeerRun(cut_at_stop(out[0, len(prompt_ids):].tolist(), stop_ids), seconds,
                       target_forwards.calls - before_t, drafts)

    return run


class _ForwardCounter:
    """Counts top-level forward calls of a Hugging Face model (for peers, whose loops we do not own)."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.calls += 1


# ---- llama-cpp-python's generate()


def llamacpp_peers(target, draft, max_new_tokens: int) -> list[Peer]:
    """llama-cpp-python's own generate() on the same file and threads: plain, and with its
    prompt-lookup draft (LlamaPromptLookupDecoding; it has no draft-model speculation, so `draft`
    goes unused). Each peer loads the file once more (mmap: the weights' pages are shared)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    # with a draft model, Llama keeps logits for n_batch rows but writes one per position: n_batch = n_ctx
    lookup = _load_llama(target, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS),
                         n_batch=target.max_length)
    plain = _load_llama(target, n_batch=target.batch_tokens)  # llama.cpp's tokens per decode, as specdec's
    return [Peer("llama-cpp-python generate", False, _llama_generate(plain, max_new_tokens, target.stop_token_ids)),
            Peer("llama-cpp-python prompt lookup", False,
                 _llama_generate(lookup, max_new_tokens, target.stop_token_ids))]


# each model's `peer_kind` -> (target, draft, max new tokens) -> the peers that run its library's own loops
PEERS: dict[str, Callable[[CausalLM, CausalLM | None, int], list[Peer]]] = {
    "transformers.generate": hf_peers, "llama_cpp.generate": llamacpp_peers}


def _load_llama(target, **extra):
    """A llama-cpp-python `Llama` on the target's file, context and threads."""
    from llama_cpp import Llama

    from specdec.runtime.llama_lib import clear_log, last_log

    clear_log()
    try:
        return Llama(model_path=target.path, n_ctx=target.max_length, n_threads=target.threads,
                     n_threads_batch=target.threads, verbose=False, **extra)
    except Exception as error:
        raise SpecDecError(f"llama-cpp-python could not load {target.path}: {error}{last_log()}") from error


def _llama_generate(llm, max_new_tokens: int, stop_ids: frozenset[int]):
    """Llama.generate() with plain temperature / top-k / top-p sampling (its other samplers off);
    decodes are counted by wrapping its context's decode."""
    counter = {"decodes": 0}
    decode = llm._ctx.decode

    def counted(batch):
        counter["decodes"] += 1
        return decode(batch)

    llm._ctx.decode = counted

    def run(prompt_ids: list[int], sampling: SamplingParams, seed: int) -> PeerRun:
        llm.reset()  # no reuse of the previous prompt's cache: every run prefills, as ours do
        llm.set_seed(seed)
        tokens = []
        started = time.perf_counter()
        llm.eval(prompt_ids[:-1])  # the prefill, as the engine's (generate() then reuses it)
        prefill_seconds = time.perf_counter() - started
        before = counter["decodes"]
        for token in llm.generate(prompt_ids, temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  min_p=0.0, typical_p=1.0, repeat_penalty=1.0):
            if token in stop_ids:
                break
            tokens.append(token)
            if len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - started
        return PeerRun(tokens, seconds, counter["decodes"] - before, prefill_seconds=prefill_seconds)

    return run
