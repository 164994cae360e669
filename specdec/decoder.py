"""A decoder: a target model and a drafter, generating text (whole or streamed) through the engine."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence

from specdec import costs, profiling
from specdec.config import GAMMA, PREFIX_TOKENS, check_gamma
from specdec.constraints import Constraint, Forced, Grammars
from specdec.drafters import Drafter
from specdec.drafters.history import History
from specdec.drafters.prediction import Prediction
from specdec.engine import DecodeState, Engine, StepResult, TokenLogprob
from specdec.errors import SpecDecError
from specdec.penalties import Penalties
from specdec.policy import (AUTO_MAX_DEPTH, MAX_DEPTH, BatchDepth, CostAwareDepth, CostAwarePolicy, DraftPolicy,
                            FixedGamma, SharedAcceptance)
from specdec.runtime import CausalLM
from specdec.runtime.prefix import PrefixCache
from specdec.sampling import RandomStreams
from specdec.scopes import PerScope, Scope, check_scope, owner
from specdec.stops import StopStrings
from specdec.text import GrowingText, check_text
from specdec.tools import ToolFormat, format_of
from specdec.types import GenerationStats
from specdec.params import Limits, SamplingParams, request_options


@dataclass
class GenerationResult:
    text: str
    # generated ids, prompt and stop excluded; they decode to a prefix of `text`: all of it, unless a stop
    # string begins inside a token, whose characters before the stop are then in `text` but the token is not
    tokens: list[int]
    finish_reason: str  # "length", "stop" (EOS or a stop string)
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for
    prediction: Prediction | None = field(default=None, repr=False)  # the prediction it was drafted from, if any

    def prediction_usage(self) -> tuple[int, int] | None:
        """(accepted, rejected) prediction tokens, OpenAI's meaning (see `Prediction.usage`); None without one.
        Costs an alignment of the prediction's tokens with the output's: computed when asked."""
        return self.prediction.usage(self.tokens) if self.prediction is not None else None

    def to_dict(self) -> dict:
        out = {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
               "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": lp.top} for lp in self.logprobs]
        if self.prediction is not None:
            out["prediction_tokens"] = dict(zip(("accepted", "rejected"), self.prediction_usage()))
        return out


class Stream:
    """Iterate for text deltas; afterwards `.result` holds the whole GenerationResult."""

    def __init__(self, deltas: Iterator[str]):
        self._deltas = deltas
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._deltas


class SpeculativeDecoder:
    """A target model plus an optional drafter; with no drafter it decodes plainly (γ = 0).

    gamma: draft length per iteration (a tree's depth), or "auto": chosen every iteration from
    measured forward costs and the acceptance so far (`specdec.policy`); an `AutoDrafter` is
    always shaped by the cost-aware policy, at most `gamma` deep when that is a number.
    explore: the auto drafter's policy tries prompt lookup on a probe schedule when its estimate
    does not pay (False: lookup only when it pays by the estimate).
    history: earlier generations' prompts and outputs, drafted from by the auto drafter (suffix
    decoding; a `History`, or True for one with the default budget, or None); per tenant, as
    each request says (`request(tenant=...)`).
    prefix_cache: finished generations' caches kept (a `PrefixCache`, or its budget in tokens, for
    the cache every decoder on this target shares; 0 or None: none), so a request starts from the
    longest prefix it shares with them: a conversation's next turn does not compute the earlier
    ones again. On llama.cpp kept prefixes take KV cells the slots leave free and give them back
    when a decode needs them; `load_model(prefix_tokens=...)` (which `load` passes) adds cells only
    for what the slots cannot hold. Off on a batch-invariant target (as trees are: both would put
    KV cells out of position order).
    share_acceptance: a server's: what each scope's earlier generations learnt of each source's
    acceptance starts its new ones (the default drafter's policy). prepare: read or measure the
    forward costs now (False: call `prepare()` before the first request).
    """

    def __init__(self, target: CausalLM, drafter: Drafter | None = None, gamma: int | str = GAMMA, explore: bool = True,
                 history: History | bool | None = True, prefix_cache: PrefixCache | int | None = PREFIX_TOKENS,
                 share_acceptance: bool = False, prepare: bool = True):
        check_gamma(gamma)
        if drafter is not None:
            drafter.fit(target)
        self.target, self.drafter, self.gamma, self.explore = target, drafter, gamma, explore
        takes_chains = drafter is not None and drafter.takes_chains
        if history is True:
            history = History() if takes_chains else None
        if history is not None and not takes_chains:
            raise SpecDecError("a history is drafted from by the default (auto) drafter; this decoder has "
                               + _drafter_name(drafter))
        self.history: History | None = history or None
        if target.batch_invariant:
            # a fork's new tokens could take freed cells below the shared ones: out of position order
            prefix_cache = None
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            prefix_cache = PrefixCache.of(target, prefix_cache) if prefix_cache else None
        self.prefixes = prefix_cache if prefix_cache is not None and prefix_cache.budget else None
        # a server's: what each scope's earlier requests saw, for its new ones (a policy shaped node by node learns it)
        self.shared_acceptance = PerScope(SharedAcceptance) if share_acceptance and self.shapes_by_nodes else None
        self._busy = False  # one generation at a time: the caches belong to it
        self._profile: costs.LiveCosts | None = None
        self.grammars = Grammars(target.tokenizer, target.vocab_size, target.stop_token_ids)  # compiled when first used
        if prepare:
            self.prepare()

    @property
    def draft_model(self) -> CausalLM | None:
        return self.drafter.draft_model if self.drafter is not None else None

    @property
    def shapes_by_nodes(self) -> bool:
        """Whether a `CostAwarePolicy` shapes every iteration's draft node by node (the default drafter)."""
        return self.drafter is not None and self.drafter.shaped_by_nodes

    @property
    def uses_profile(self) -> bool:
        """Whether decoding needs measured forward costs (any cost-aware choice)."""
        return self.shapes_by_nodes or (self.drafter is not None and self.gamma == "auto")

    def prepare(self) -> None:
        """Read (or measure, with a notice, once per model and machine) the forward costs the policy
        decides with, if it needs them: done when the decoder is made, so no request waits for it."""
        if not self.uses_profile or self._profile is not None:
            return
        why = profiling.why_measure(self.target, self.draft_model)
        if why is not None:
            print("specdec: timing the models' forwards for the auto policy (once per model and machine"
                  + (", again: the last were measured beside other work" if why != "none kept" else "")
                  + "; `specdec profile` shows them)", file=sys.stderr)
        if not self.profile().trusted:
            print(distrust(self.profile()), file=sys.stderr)

    def profile(self) -> costs.LiveCosts:
        """The models' forward costs on this machine: cached on disk, measured on first use, then
        corrected by what this decoder's steps pay (`costs.LiveCosts`, shared by its generations)."""
        if self._profile is None:
            self._profile = costs.LiveCosts.of(profiling.profile(self.target, self.draft_model))
        return self._profile

    def _costs(self) -> costs.LiveCosts:
        """The profile `prepare` read: never measured inside a request."""
        if self._profile is None:
            raise SpecDecError("this decoder was made with prepare=False: call its prepare() before the first request")
        return self._profile

    def policy(self, scope: Scope = None, chains: tuple = (), sampled: bool = False,
               keyed: bool = False) -> DraftPolicy:
        """A fresh draft policy for one generation of `scope` (it starts from what that scope's
        earlier generations saw, on a server) that drafts from the drafter's sources and `chains`,
        and samples or not, by position (`keyed`) or not."""
        if self.drafter is None:
            return FixedGamma(0)
        if self.shapes_by_nodes:
            shared = self.shared_acceptance[owner(scope)] if self.shared_acceptance is not None else None
            return CostAwarePolicy(self._costs(), AUTO_MAX_DEPTH if self.gamma == "auto" else self.gamma,
                                   explore=self.explore, shared=shared,
                                   sources=self.drafter.sources + tuple(chain.kind for chain in chains),
                                   sampled=sampled, keyed=keyed)
        if self.gamma == "auto":
            self._costs()  # read when made
            return self.depth_policy(CostAwareDepth, MAX_DEPTH)
        return FixedGamma(self.gamma)

    def depth_policy(self, kind: type[BatchDepth], max_gamma: int) -> BatchDepth:
        """A depth policy (`BatchDepth` or a subclass) for this decoder's drafter, with measured costs
        (a server's batch-wide cap reads them when it starts, even where its rows' depth is fixed)."""
        tree = self.drafter.tree
        return kind(self.profile(), max_gamma, models_draft=self.draft_model is not None,
                    width=tree.width if tree else 1)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def generate(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                 limits: Limits | None = None, **options) -> GenerationResult:
        """Options as for `request`. Returns text, tokens and stats."""
        return self.run(self.request(prompt, sampling, limits, **options))

    def run(self, generation: Generation) -> GenerationResult:
        """Run a generation made by `request` to its end."""
        stream = Stream(self._deltas(generation))
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, limits: Limits | None = None,
               **options) -> Stream:
        """Text deltas as they are committed; options as for `request`."""
        return Stream(self._deltas(self.request(prompt, sampling, limits, **options)))

    def request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                limits: Limits | None = None, *, prediction: str | None = None, tenant: Hashable = None,
                scope: Scope = None, constraint: Constraint | None = None, **shorthand) -> Generation:
        """A checked generation, not started: run it with `stream`, or in a batch with an `Engine`.
        sampling: how tokens are chosen (`SamplingParams`: temperature 0 is greedy; the default
        samples at temperature 1); limits: when it ends and what it reports (`Limits`: at most 128
        tokens by default, stop strings, logprobs under the target's raw distribution). shorthand:
        the fields of either as keywords (`temperature=0, max_new_tokens=64`), over the values given.
        prediction: the text the output is expected to be (OpenAI's Predicted Outputs), drafted from
        by the default drafter; it changes the speed, never the output. scope: who may reuse what
        this generation leaves (its kept cache, its history; `specdec.scopes`), and whose it may
        reuse; tenant: whose history, within the scope, it drafts from and joins (see `History`).
        Both any hashable. constraint: what the output must match (`Constraint`: a JSON Schema, any
        JSON object, a regular expression, a choice, a grammar); every drafter stays lossless under it,
        and the default drafts the text it forces.

        A seed (`SamplingParams.seed`) makes sampling repeatable. Under the default drafter, or
        with none, a seeded sampled generation draws its i-th token as argmax(p / E_i), with noise
        E_i fixed by (seed, i), and drafts point masses only, a draft model's ranked by the same
        noise, verified by that draw (`verify.verify_tree_coupled`): its text is plain decoding's
        with the same seed, whatever was drafted, so neither what the decoder learnt before (its
        history, the costs its steps paid) nor the batch it runs in changes it, except where a
        runtime's numerics move with the batch (llama.cpp; bfloat16 on a GPU: docs/backends.md)
        and nudge a draw that lay on a boundary. A fixed drafter (a draft model's chain or tree, an
        n-gram) keeps Chen's rejection sampling of drawn drafts: its seeded text repeats when its
        drafting does, i.e. with a numeric gamma. `Generation.drawn` runs a seeded request the
        unseeded way."""
        sampling, limits = request_options(sampling, limits, shorthand)
        prompt_ids = self.prompt_ids(prompt)
        check_scope(tenant, "tenant")
        check_scope(scope, "scope")
        chains = self._chains(prediction, prompt_ids, tenant, scope)
        matcher = self.grammars.matcher(constraint) if constraint is not None else None
        if matcher is not None and self.drafter is not None and self.drafter.takes_chains:
            chains += (Forced(matcher),)
        shapers = ((Penalties(sampling, prompt_ids, self.target.vocab_size),) if sampling.penalised else ()) + (
            (matcher,) if matcher is not None else ())
        stop_tokens = self._stop_tokens(limits, constraint)
        keyed_draws = self.drafter is None or self.drafter.keyed_draws
        keyed = sampling.seed is not None and not sampling.greedy and keyed_draws
        policy = self.policy(scope, chains, sampled=not sampling.greedy, keyed=keyed)
        state = DecodeState(prompt_ids, sampling, limits.max_new_tokens, policy,
                            RandomStreams(sampling.seed, keyed), GenerationStats(prompt_tokens=len(prompt_ids)),
                            stop_tokens, logprobs=limits.logprobs, chains=chains, scope=scope, shapers=shapers)
        return Generation(state, TextAssembler(self.tokenizer, prompt_ids, list(limits.stop)))

    def _stop_tokens(self, limits: Limits, constraint: Constraint | None) -> frozenset[int]:
        """The tokens that end this generation: the model's end tokens (unless `ignore_eos`) and the request's."""
        outside = [t for t in limits.stop_token_ids if t >= self.target.vocab_size]
        if outside:
            raise SpecDecError(f"stop token id {outside[0]} is outside the vocabulary of {self.target.vocab_size}",
                               param="stop_token_ids")
        if limits.ignore_eos and constraint is not None:
            raise SpecDecError("ignore_eos with a structured output: the output ends where its grammar does",
                               param="ignore_eos")
        return (frozenset() if limits.ignore_eos else self.stop_token_ids) | frozenset(limits.stop_token_ids)

    def _chains(self, prediction: str | None, prompt_ids: list[int], tenant: Hashable, scope: Scope) -> tuple:
        """The request's own chain sources: its prediction, its view of the history."""
        if prediction is not None:
            if not isinstance(prediction, str):
                raise SpecDecError(f"a prediction must be text, got {type(prediction).__name__}")
            if self.drafter is None or not self.drafter.takes_chains:
                raise SpecDecError("a prediction is drafted by the default (auto) drafter; this decoder has "
                                   + _drafter_name(self.drafter), param="prediction")
        try:
            chains = (Prediction(prediction, self.tokenizer, prompt_ids),) if prediction else ()
        except SpecDecError as error:
            raise SpecDecError(str(error), param="prediction") from None
        if self.history is not None:
            chains += (self.history.view(tenant, scope),)
        return chains

    def engine(self) -> Engine:
        return Engine(self.target, self.drafter, self.prefixes)

    def prompt_ids(self, prompt) -> list[int]:
        """Token ids of a prompt (text or ids), checked: not empty, in the vocabulary, shorter than the context."""
        if isinstance(prompt, str):
            if not prompt:
                raise SpecDecError("the prompt is empty")
            check_text(prompt, "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = [int(i) for i in prompt]
            if any(not 0 <= i < self.target.vocab_size for i in ids):
                raise SpecDecError(f"prompt token ids must be in [0, {self.target.vocab_size})")
        if not ids:
            raise SpecDecError("the prompt is empty" if not len(prompt)
                               else "the prompt encodes to no tokens (the tokenizer knows none of its characters)")
        # only the target's context limits the prompt: a draft model with a shorter one stops drafting
        limit = self.target.max_length
        if len(ids) >= limit:
            raise SpecDecError(f"the prompt has {len(ids)} tokens; the context holds {limit}, "
                               "leaving no room to generate")
        return ids

    def chat_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of a conversation (`{"role", "content"}` dicts; an assistant's may carry `tool_calls`,
        a tool's answer `tool_call_id`) rendered by the tokenizer's chat template with the assistant's turn
        opened, checked as `prompt_ids` checks a prompt. `tools`: functions the model may call, in OpenAI's
        shape (`specdec.tools.ToolUse.for_template`), for a template that renders them."""
        for message in messages:
            check_text(message.get("content") or "", "messages' content", param="messages")
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise SpecDecError("this model's tokenizer has no chat template: give one (`--chat-template FILE`, or "
                               "set `decoder.tokenizer.chat_template`), or send the prompt as text (/v1/completions)",
                               param="messages")
        if tools and self.tool_format is None:
            raise SpecDecError("this model's chat template does not render tools: give one that does "
                               "(`--chat-template FILE`)", param="tools")
        try:
            ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                     **({"tools": list(tools)} if tools else {}))
        except Exception as error:  # a template may reject a conversation (e.g. roles out of order)
            raise SpecDecError(f"the chat template rejected these messages: {error}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return self.prompt_ids(list(ids))

    @property
    def tool_format(self) -> ToolFormat | None:
        """How this model writes a tool call, as its chat template teaches it (None: it renders no tools)."""
        return format_of(getattr(self.tokenizer, "chat_template", None))

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.target.stop_token_ids

    def _deltas(self, generation: Generation) -> Iterator[str]:
        if self._busy:
            raise SpecDecError("this decoder is already generating; finish the other stream first")
        self._busy = True
        generation.started = time.perf_counter()
        steps = self.engine().run(generation.state)
        try:
            for step in steps:
                delta = generation.add(step)
                if delta:
                    yield delta
                if generation.done:
                    break
            return generation.result()
        finally:
            steps.close()  # gives the slots back
            self._busy = False


def distrust(profile: costs.Profile) -> str:
    """What a profile measured beside other work is worth, for the user."""
    return (f"specdec: the forward costs were measured while other work ran on this machine (their forwards waited "
            f"{profile.contention:.0%} of the time for a core): decoding corrects them as it goes, and they are "
            "measured again once the machine is quiet")


class Generation:
    """One request: its decoding state and its text so far. `add` each step's result until `done`."""

    def __init__(self, state: DecodeState, text: TextAssembler):
        self.state, self.text = state, text
        self.started = 0.0

    def drawn(self, seed: int) -> Generation:
        """Draw as an unseeded request does (drafts drawn from the draft model, rejection sampling),
        from generators seeded by `seed`: repeatable samples of that path, for the tools that
        measure it (the losslessness check, the benchmark). Returns itself."""
        self.state.streams = RandomStreams(seed)
        return self

    def open(self, engine: Engine, prefill: bool = True) -> None:
        """Start on `engine` (which must `close` the state when the generation ends), the prompt
        prefilled, or (prefill False) left for `engine.prefill` to feed in chunks."""
        self.started = time.perf_counter()
        if prefill:
            engine.open(self.state)
        else:
            engine.start(self.state)

    @property
    def done(self) -> bool:
        return self.text.finish_reason is not None or self.state.finish_reason is not None

    def add(self, step: StepResult) -> str:
        """The text delta this step's tokens make visible ('' when none)."""
        return self.text.add(step)

    def result(self) -> GenerationResult:
        stats = self.state.stats
        stats.generated_tokens = len(self.text.tokens)
        stats.total_seconds = time.perf_counter() - self.started
        return GenerationResult(text=self.text.text, tokens=self.text.tokens,
                                finish_reason=self.text.finish_reason or self.state.finish_reason or "length",
                                stats=stats, logprobs=self.text.logprobs if self.state.logprobs is not None else None,
                                prediction=next((c for c in self.state.chains if isinstance(c, Prediction)), None))


class TextAssembler:
    """Committed tokens to text deltas: a stop string cuts the text (and the tokens) where it
    begins; a half-decoded character or a possible start of a stop string is held back."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.decode_text = GrowingText(tokenizer, prompt_ids).text  # of the tokens, or a prefix of them
        self.stops = StopStrings(stop)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token, when the generation records them
        self.text = ""
        self.emitted = 0  # characters of text already given out
        self.finish_reason: str | None = None
        self._settled = 0

    def settled(self) -> int:
        """How many tokens have had all their text given out: a stop string can no longer cut them
        (text that could begin one is held back)."""
        while (self._settled < len(self.tokens)
               and len(self.decode_text(self.tokens[: self._settled + 1])) <= self.emitted):
            self._settled += 1
        return min(self._settled, len(self.tokens))

    def add(self, step: StepResult) -> str:
        """The text delta this step's tokens make visible: no half-decoded character at the end, and
        nothing that could still begin a stop string, until the generation ends."""
        self.tokens += step.tokens
        self.logprobs += step.logprobs or []
        text = self.decode_text(self.tokens)
        whole = text.rstrip("\ufffd")  # a character still missing bytes is not text yet
        cut, held = self.stops.scan(whole)
        if cut is not None:
            text, self.finish_reason = text[:cut], "stop"
            self.tokens = _tokens_within(self.decode_text, self.tokens, text)
            del self.logprobs[len(self.tokens):]
        elif step.finish_reason:
            self.finish_reason = step.finish_reason
        self.text = text
        safe = len(text) if self.finish_reason else len(whole) - held
        delta = text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta


def _tokens_within(decode_text, tokens: list[int], text: str) -> list[int]:
    """The longest prefix of tokens whose text is a prefix of `text` (the text before a stop string).
    A prefix's text grows with it (but for a character still missing bytes, a few replacement
    characters): bisect to the longest prefix whose text is not longer than `text` allows, then
    walk back, so a long stop string costs a few decodes, not one per token it spans."""
    low, high = 0, len(tokens)
    while low < high:
        middle = (low + high + 1) // 2
        if len(decode_text(tokens[:middle])) <= len(text) + 4:
            low = middle
        else:
            high = middle - 1
    n = low
    while n and not text.startswith(decode_text(tokens[:n])):
        n -= 1
    return tokens[:n]


def _drafter_name(drafter: Drafter | None) -> str:
    return drafter.name if drafter is not None else "no drafter"
