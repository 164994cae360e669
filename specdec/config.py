"""What to build, as data: how a model runs, a drafter spec, a decoder config and a serve config
(frozen dataclasses), every default once, and the one reader that turns a mapping of options
into them.

Every front end builds these once and hands them to one builder (`specdec.build`): the CLI from its
argv (argparse leaves out what was not given), the Ray Serve builder from its key=value options,
`specdec.load` from its keywords, the bench from its own settings. A default lives in one place:
here. This is the bottom layer: it imports nothing of specdec's but its errors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from specdec.errors import SpecDecError, check_integer

# drafter kinds (the registry's names, `specdec.build.DRAFTERS`)
DRAFTERS = ("auto", "plain", "model", "ngram", "lookup")
INNER_DRAFTERS = ("ngram", "lookup")  # what may draft for a staged draft model (draft², Spector & Ré)
GAMMA = "auto"  # draft depth per iteration: "auto" chooses it every iteration from measured costs
INNER_GAMMA = 4  # draft² tokens per draft-model forward when staged
# a token tree's children per node (and nodes expanded per level); drawn or top
TREE_WIDTH, TREE_CHILDREN = 3, "sampled"
PREFIX_TOKENS = 4096  # tokens of finished generations kept for prefix reuse: a long conversation, or a few shorter ones
SERVER_PREFIX_TOKENS = 16_384  # a server keeps more than one process's generations do
SERVER_DECODER = {"prefix_cache": SERVER_PREFIX_TOKENS, "share_acceptance": True}  # how a server's decoder differs
HISTORY_TOKENS = 200_000  # the default drafter's history, per tenant: ~0.8 MB, a search of a few hundred µs at worst
DEFAULT_BATCH = {"cpu": 16, "gpu": 64}  # a server's generations at once (`ServeConfig.batch`)
BACKENDS = ("auto", "transformers", "llamacpp")
# who computes a GGUF model's logits on the CPU (see cpu_head); "split": llama.cpp's for a one-row forward,
# specdec's for more
OUTPUT_LAYERS = ("auto", "specdec", "llama.cpp", "split")
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
    torch.compile, run eagerly), "static" (the pool, nothing compiled nor padded: each forward as it comes).
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
        for name, value, choices in (("backend", self.backend, BACKENDS),
                                     ("output layer", self.output_layer, OUTPUT_LAYERS),
                                     ("compile setting", self.compile, COMPILE_CHOICES)):
            if value not in choices:
                raise SpecDecError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
        for name, value in (("threads", self.threads), ("context", self.context)):
            if value is not None:
                check_integer(value, name)
        if self.gpu_layers is not None and (isinstance(self.gpu_layers, bool) or not isinstance(self.gpu_layers, int)):
            raise SpecDecError(f"gpu_layers must be an integer (-1 = all), got {self.gpu_layers!r}")


@dataclass(frozen=True)
class TreeShape:
    """A draft model's fixed token tree. nodes: node budget per tree; width: children per node and
    nodes expanded per level. sampled: at temperature > 0, draw children from the draft (True) or
    take its most likely tokens (False). Greedy decoding always takes the most likely tokens."""

    nodes: int
    width: int = TREE_WIDTH
    sampled: bool = TREE_CHILDREN == "sampled"

    def __post_init__(self):
        check_integer(self.nodes, "tree nodes")
        check_integer(self.width, "tree width")


@dataclass(frozen=True)
class DrafterSpec:
    """What drafts, by kind:

    "auto" (the default): prompt lookup and the draft model (when there is one), with the
    history and any prediction, in one tree shaped every iteration by the cost-aware policy.
    "plain": no drafter. "model": the draft model's chain, or its token tree (`tree`), staged with
    `inner` ("ngram" or "lookup") as its own drafter. "ngram": an n-gram model. "lookup": prompt lookup.
    draft and ngram are paths; None with no target given: the demo pair's (`specdec.demo`), its draft
    model unless `demo_draft` is False (the auto drafter asked for prompt lookup alone).
    """

    kind: str = "auto"
    draft: str | None = None
    ngram: str | None = None
    tree: TreeShape | None = None
    inner: str | None = None
    inner_gamma: int = INNER_GAMMA  # draft² tokens per draft-model forward when staged
    ngram_stochastic: bool = True  # sample n-gram drafts (False: the most likely token)
    demo_draft: bool = True

    def __post_init__(self):
        if self.kind not in DRAFTERS:
            raise SpecDecError(f"unknown drafter {self.kind!r}; choose one of {', '.join(DRAFTERS)}")
        if self.inner not in (None, *INNER_DRAFTERS):
            raise SpecDecError(f"a staged draft model drafts with one of {', '.join(INNER_DRAFTERS)}, "
                               f"not {self.inner!r}")
        if (self.tree is not None or self.inner is not None) and self.kind != "model":
            raise SpecDecError("token trees and staging shape a draft model's drafts (kind 'model')")
        check_integer(self.inner_gamma, "inner_gamma")

    @property
    def uses_draft_model(self) -> bool:
        return self.kind in ("auto", "model")

    @property
    def uses_ngram(self) -> bool:
        return self.kind == "ngram" or self.inner == "ngram"

    @classmethod
    def choose(cls, *, target_given: bool, draft: str | None = None, ngram: str | None = None,
               prompt_lookup: bool = False, tree: TreeShape | None = None, staged: bool = False,
               gamma: int | str = GAMMA, plain: bool = False, inner_gamma: int = INNER_GAMMA,
               ngram_stochastic: bool = True) -> DrafterSpec:
        """The spec the drafter flags describe (`specdec generate --draft ... --staged ...`), refusing
        combinations that mean nothing. A numeric gamma with one drafter runs that drafter; gamma
        "auto" with no n-gram, tree or staging is the auto drafter (which also looks up the prompt)."""
        if plain:
            if draft or ngram or prompt_lookup or tree or staged:
                raise SpecDecError("plain decoding takes no drafter: "
                                   "drop the draft model, n-gram, prompt lookup, tree and staging "
                                   "(--plain decodes without a drafter: drop the drafter flags)")
            return cls("plain")
        if ngram is not None and prompt_lookup:
            raise SpecDecError("choose at most one of an n-gram file and prompt lookup")
        auto = gamma == "auto" and ngram is None and tree is None and not staged
        demo_draft = not target_given and draft is None and (staged or (ngram is None and not prompt_lookup))
        has_draft = draft is not None or demo_draft
        if staged and (not has_draft or (ngram is None and not prompt_lookup and target_given)):
            raise SpecDecError("staged drafting needs a draft model and a draft² for it: "
                               "a draft model plus an n-gram file or prompt lookup")
        if not staged and draft is not None and (ngram is not None or (prompt_lookup and not auto)):
            raise SpecDecError("choose at most one drafter: a draft model, an n-gram file or prompt lookup "
                               "(or stage them)")
        if tree is not None and not has_draft:
            raise SpecDecError("token trees are drafted by a draft model; give one (--draft DIR)")
        shared = dict(draft=draft, inner_gamma=inner_gamma, ngram_stochastic=ngram_stochastic)
        if auto:
            return cls("auto", demo_draft=demo_draft, **shared)
        if has_draft:
            inner = ("lookup" if prompt_lookup else "ngram") if staged else None
            return cls("model", ngram=ngram, tree=tree, inner=inner, **shared)
        if ngram is not None:
            return cls("ngram", ngram=ngram, **shared)
        return cls("lookup" if prompt_lookup else "plain", **shared)


@dataclass(frozen=True)
class DecoderConfig:
    """A target, its drafter and how they decode (`specdec.build.build_decoder`).

    target: a checkpoint directory or a .gguf file; None: the demo pair (its GGUF files on llama.cpp
    unless the runtime's backend is "transformers"). gamma: draft length per iteration (a tree's
    depth), or "auto": chosen every iteration from measured costs. explore: the auto drafter probes
    prompt lookup when its estimate does not pay. prefix_cache: tokens of finished generations kept
    for later ones to start from (0: none). slots: generations that may run at once (a server's
    batch). history_tokens: the auto drafter's history of earlier requests, per tenant (None: the
    default; 0: off); share_history: one history for all tenants of a scope. share_acceptance:
    what earlier requests of a scope learnt of each source's acceptance starts its new ones (a
    server's). chat_template: the template's text, replacing the tokenizer's (checked when parsed).
    """

    target: str | None = None
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    gamma: int | str = GAMMA
    explore: bool = True
    prefix_cache: int = PREFIX_TOKENS
    slots: int = 1
    history_tokens: int | None = None
    share_history: bool = False
    share_acceptance: bool = False
    chat_template: str | None = None

    def __post_init__(self):
        check_gamma(self.gamma)
        check_integer(self.slots, "slots")
        check_integer(self.prefix_cache, "the prefix cache (tokens)", minimum=0)
        if self.history_tokens is not None and self.history_tokens < 0:
            raise SpecDecError("--history-tokens must be >= 0")


@dataclass(frozen=True)
class ServeConfig:
    """`specdec serve`: the decoder (a server's: more prefix cache, acceptance shared across
    requests; its history and chat template are the decoder's too), and how the server runs it
    (`specdec.server.build`).

    max_batch: generations that run together (None: `DEFAULT_BATCH` by the device, `batch`).
    batch_depth: "measured" (a numeric gamma's depth is capped per step for the batch size) or
    "fixed". api_keys: each a tenant (none: one tenant). metrics_key: the operator's key for
    /metrics (None: with API keys set, /metrics answers no one, unless public_metrics).
    replicas / max_replicas: Ray Serve replicas (None: one process, no Ray).
    """

    decoder: DecoderConfig = field(default_factory=lambda: DecoderConfig(**SERVER_DECODER))
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    max_queue: int = 64
    max_batch: int | None = None
    batch_depth: str = "measured"
    shutdown_timeout: float = 10.0
    api_keys: tuple[str, ...] = ()
    keys_share_caches: bool = False
    metrics_key: str | None = None
    public_metrics: bool = False
    allowed_origins: tuple[str, ...] = ()
    max_connections: int = 256
    replicas: int | None = None
    max_replicas: int | None = None

    def __post_init__(self):
        for name in ("max_queue", "max_connections", "max_batch", "replicas", "max_replicas"):
            if getattr(self, name) is not None:
                check_integer(getattr(self, name), name)
        if self.batch_depth not in ("measured", "fixed"):
            raise SpecDecError(f"batch depth must be 'measured' or 'fixed', got {self.batch_depth!r}")
        if not 0 <= self.shutdown_timeout <= 3600:
            raise SpecDecError("--shutdown-timeout must be between 0 and 3600 seconds")
        if self.max_replicas is not None and self.replicas is None:
            raise SpecDecError("--max-replicas autoscales Ray Serve replicas: give --replicas too")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise SpecDecError("--max-replicas must be at least --replicas")
        keys = self.api_keys + (() if self.metrics_key is None else (self.metrics_key,))
        if any(not (key.isascii() and key.isprintable()) or " " in key or not key for key in keys):
            raise SpecDecError("an API key must be printable ASCII without spaces "
                               "(it is sent as `Authorization: Bearer KEY`)")
        if self.metrics_key is not None and self.metrics_key in self.api_keys:
            raise SpecDecError("the metrics key must not be a tenant's API key: it shows every tenant's activity")
        if self.metrics_key is not None and self.public_metrics:
            raise SpecDecError("--public-metrics opens /metrics to anyone: give it or --metrics-key, not both")

    @property
    def loopback(self) -> bool:
        """Bound to loopback only: then only loopback Host headers are accepted (no DNS rebinding)."""
        return self.host in ("127.0.0.1", "localhost", "::1")

    def batch(self, on_gpu: bool) -> int:
        """The one rule for the batch: --max-batch, else `DEFAULT_BATCH` for where the target runs."""
        return self.max_batch or DEFAULT_BATCH["gpu" if on_gpu else "cpu"]


# ---------------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    files: list[str]
    output: str
    tokenizer: str | None = None  # reuse this tokenizer directory instead of training one
    vocab_size: int = 8192  # for a newly trained tokenizer
    hidden_size: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int | None = None  # default: heads
    intermediate_size: int | None = None  # default: about 8/3 * hidden, a multiple of 64
    context: int = 1024  # max_position_embeddings of the model
    seq_len: int = 256  # training window
    batch_size: int = 16
    steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    holdout: float = 0.02  # fraction of files held out
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 100
    seed: int = 0
    device: str = "cpu"
    bf16: bool = False  # autocast matmuls to bfloat16 (weights and optimizer stay float32)
    save_dtype: str = "float32"  # dtype of the final model.safetensors ("float16" for a small demo pair)
    progress: bool = True

    def check(self) -> None:
        if not self.files:
            raise SpecDecError("no training files given")
        for name in ("hidden_size", "layers", "heads", "seq_len", "batch_size", "steps", "vocab_size"):
            if getattr(self, name) < 1:
                raise SpecDecError(f"{name.replace('_', '-')} must be >= 1")
        if self.hidden_size % self.heads:
            raise SpecDecError(f"hidden size {self.hidden_size} is not divisible by {self.heads} heads")
        if self.seq_len > self.context:
            raise SpecDecError(f"seq-len {self.seq_len} exceeds the model context {self.context}")
        if not 0 < self.holdout < 1:
            raise SpecDecError("holdout must be a fraction in (0, 1)")
        if self.save_dtype not in ("float32", "float16", "bfloat16"):
            raise SpecDecError("save-dtype must be float32, float16 or bfloat16")


@dataclass
class DistillConfig:
    target: str
    output: str
    files: list[str] = field(default_factory=list)  # default: the standard library (less the suites' files)
    backend: str = "auto"
    threads: int | None = None
    device: str = "cpu"  # where the draft trains (and a checkpoint target runs)
    corpus_tokens: int = 2_000_000
    prompts: int = 2048  # corpus windows of prompt_tokens the target continues by new_tokens
    short_prompts: int = 768  # and windows of 8-48 tokens at line starts, continued to the same length
    prompt_tokens: int = 96
    new_tokens: int = 96
    temperature: float = 0.7  # for the sampled half of the continuations
    soft_top: int = 8  # soft labels kept per continuation token
    generate_batch: int = 16  # continuations decoded side by side
    draft_vocab: int = 8192
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 1
    intermediate_size: int = 768
    context: int = 4096  # the draft's positions; a longer prompt is left undrafted
    batch_size: int = 16
    steps: int = 1600
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.05
    holdout: float = 0.04  # fraction of the continuations held out for the agreement figure
    eval_every: int = 250
    save_every: int = 250
    seed: int = 0
    bf16: bool = False  # autocast the draft's matmuls to bfloat16 while training (weights stay float32)
    gguf: bool = True  # also write DIR/draft.gguf
    head: bool = False  # train the small draft head (specdec.distill_head, `--small-head`) instead of a draft model
    progress: bool = True

    def check(self) -> None:
        if self.short_prompts < 0:
            raise SpecDecError("short-prompts must be >= 0")
        for name in ("corpus_tokens", "prompts", "prompt_tokens", "new_tokens", "soft_top", "generate_batch",
                     "draft_vocab", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "batch_size",
                     "steps", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise SpecDecError(f"{name.replace('_', '-')} must be >= 1")
        if self.hidden_size % self.heads or self.heads % self.kv_heads or (self.hidden_size // self.heads) % 2:
            raise SpecDecError(f"hidden size {self.hidden_size} must split into {self.heads} heads of even width, "
                               f"and the heads into {self.kv_heads} kv heads")
        if not 0 < self.holdout < 0.5:
            raise SpecDecError("holdout must be a fraction in (0, 0.5)")
        if (self.prompts + self.short_prompts) * self.holdout < 1:
            raise SpecDecError(f"--holdout {self.holdout} of {self.prompts + self.short_prompts} prompts "
                               f"(--prompts {self.prompts}, --short-prompts {self.short_prompts}) holds none out: "
                               f"raise --holdout to at least {1 / (self.prompts + self.short_prompts):.3g}, or "
                               "give more prompts")
        if self.temperature <= 0:
            raise SpecDecError("temperature (of the sampled continuations) must be > 0")


# ---------------------------------------------------------------------------------- checks


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the Hugging Face hub names a model


def missing_model(path: str | os.PathLike, what: str = "model") -> SpecDecError:
    """The error for a model path that is not there; what looks like a hub id is told how to fetch it."""
    text = str(path)
    if HUB_ID.fullmatch(text):
        local = "models/" + text.split("/")[1]
        return SpecDecError(f"{text} is not a local file or directory. It looks like a Hugging Face hub id: specdec "
                            f"reads local files only and never downloads. Fetch it first (`huggingface-cli download "
                            f"{text} --local-dir {local}`), then pass {local}")
    return SpecDecError(f"{what} not found: {text}")


def check_verify_settings(samples, length, alpha, seed) -> None:
    """`specdec verify`'s (and `check_lossless`'s) own numbers, checked before anything loads."""
    check_integer(samples, "samples")
    check_integer(length, "length")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise SpecDecError(f"alpha must be in (0, 1), got {alpha!r}")
    check_integer(seed, "seed", minimum=0)


def check_model_paths(config: DecoderConfig) -> None:
    """The target, draft and n-gram paths a configuration names exist (checked before anything loads)."""
    spec = config.drafter
    for path, what in ((config.target, "model"), (spec.draft, "model"), (spec.ngram, "n-gram model file")):
        if path is not None and not Path(path).expanduser().exists():
            raise missing_model(path, what)



def check_gamma(gamma) -> None:
    if gamma != "auto" and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1):
        raise SpecDecError(f"gamma must be a positive integer or 'auto', got {gamma!r}")


# ------------------------------------------------------------------- options -> configurations
# Option names are `specdec serve`'s long options with underscores (--max-batch: max_batch). A
# value may come typed (argparse converted it, a YAML file held a number) or as text (`serve run
# ... key=value`); the parsers below read both, so the CLI and Ray Serve's builder share them.


def parse_gamma(value) -> int | str:
    if value == "auto":
        return value
    gamma = _integer(value)
    if gamma is None or gamma < 1:
        raise ValueError(f"expected a positive integer or 'auto', got {value!r}")
    return gamma


def parse_positive(value) -> int:
    number = _integer(value)
    if number is None or number < 1:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return number


def parse_integer(value) -> int:
    number = _integer(value)
    if number is None:
        raise ValueError(f"expected an integer, got {value!r}")
    return number


def parse_number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {value!r}") from None


def parse_flag(value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError(f"expected true or false, got {value!r}")


def parse_words(value) -> tuple[str, ...]:
    """A list of strings, or one string of words separated by spaces or commas."""
    if isinstance(value, str):
        return tuple(value.replace(",", " ").split())
    return tuple(str(v) for v in value)


def _integer(value) -> int | None:
    """`value` as an integer, or None where it is none (a flag, 2.5, "two")."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


_text = str


@dataclass(frozen=True)
class Option:
    """One option, declared once: how its value is read (`parse`: argv's text or a typed value from
    Ray's builder) and how `specdec COMMAND --help` shows it. A `parse_flag` option is a switch on the
    command line, a `parse_words` one takes several words (`repeat`: and may be given again, adding more)."""

    parse: Callable
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    repeat: bool = False


MODEL_OPTIONS: dict[str, Option] = {
    "target": Option(_text, "target: a checkpoint directory or a .gguf file "
                            "(default: the demo pair, drafting with its draft model)"),
    "draft": Option(_text, "draft model: a checkpoint directory or a .gguf file (same tokenizer as the target)"),
    "ngram": Option(_text, "n-gram model file from `specdec ngram build` "
                           "(a drafter, or with --staged the draft model's drafter)"),
}
RUNTIME_OPTIONS: dict[str, Option] = {
    "backend": Option(_text, "auto (default): a .gguf file runs on llama.cpp, a checkpoint directory on transformers",
                      choices=BACKENDS),
    "device": Option(_text, "checkpoints: cpu, cuda, cuda:1 ... (default: cuda if available)"),
    "dtype": Option(_text, "checkpoints: float32 (CPU default), bfloat16 (CUDA default), float16"),
    "attn_implementation": Option(_text, "checkpoints: eager, sdpa, flex_attention ... "
                                         "(default: what transformers picks for the model)", metavar="NAME"),
    "threads": Option(parse_positive, "CPU threads (default: every core this process may use)"),
    "gpu_layers": Option(parse_integer, "GGUF: layers to offload to the GPU where llama.cpp was built with one "
                                        "(-1 = all; default 0)", metavar="N"),
    "context": Option(parse_positive, "GGUF: KV cache cells; a checkpoint with --compile on: a static slot's length "
                                      "(default: the trained context, at most 4096)", metavar="TOKENS"),
    "compile": Option(_text, f"checkpoints: auto (default {RuntimeConfig.compile!r}: on for a GPU, off on the CPU), "
                             "on (a static KV pool, a CUDA graph per forward shape), "
                             "off (growing caches, eager kernels), or how the pool's forwards run: graphs (= on), "
                             "inductor (torch.compile's kernels too), aot_eager, static (the pool, nothing compiled)",
                      choices=COMPILE_CHOICES),
    "tokenizer": Option(_text, "GGUF: a Hugging Face tokenizer directory to use instead of the file's own",
                        metavar="DIR"),
    "output_layer": Option(_text, "GGUF on the CPU: who computes the logits from the final norm. "
                                  "auto (default): specdec's kernel where it runs (a Q8_0 or Q6_K output matrix, "
                                  "AVX-512 VNNI), agrees with llama.cpp and is faster, for the forwards it is faster "
                                  "at (split: verifies only, llama.cpp's for one-row forwards); else llama.cpp",
                           choices=OUTPUT_LAYERS),
    "batch_invariant": Option(parse_flag, "GGUF: kernels that give a token the same logits in a batch of any size "
                                          "(checked at load), so greedy speculation equals plain greedy decoding "
                                          "exactly; see docs/backends.md for what it costs"),
}
DRAFTER_OPTIONS: dict[str, Option] = {  # with MODEL_OPTIONS' draft and ngram
    "prompt_lookup": Option(parse_flag, "draft by matching the context's last tokens earlier in the context"),
    "ngram_top1": Option(parse_flag, "with --ngram: propose the top token instead of sampling"),
    "plain": Option(parse_flag, "decode without any drafter (plain autoregressive decoding, the baseline)"),
    "no_explore": Option(parse_flag, "the default policy drafts prompt lookup only when its estimate pays, "
                                     "without probing it"),
    "gamma": Option(parse_gamma, "draft tokens per iteration, or 'auto' (default): chosen every iteration from "
                                 "measured forward costs and the acceptance so far; with no other drafter flags, "
                                 "prompt lookup and the draft model share one tree"),
    "tree": Option(parse_positive, "draft token trees of up to NODES nodes with the draft model", metavar="NODES"),
    "depth": Option(parse_gamma, "with --tree: tree depth, or 'auto' (default: --gamma)"),
    "tree_width": Option(parse_positive, "with --tree: children per node and nodes expanded per level "
                                         f"(default {TREE_WIDTH})"),
    "tree_children": Option(_text, "with --tree at temperature > 0: draw children from the draft, or take its most "
                                   f"likely tokens (default {TREE_CHILDREN})", choices=("sampled", "top")),
    "staged": Option(parse_flag, "the draft model drafts with --ngram or --prompt-lookup as its own drafter (draft²)"),
    "inner_gamma": Option(parse_positive,
                          f"with --staged: draft² tokens per draft-model forward (default {INNER_GAMMA})"),
}
SERVE_OPTIONS: dict[str, Option] = {
    "host": Option(_text, f"default {ServeConfig.host}"),
    "port": Option(parse_integer, f"default {ServeConfig.port}"),
    "model_name": Option(_text, "the model id clients send (default: the target directory's name)"),
    "max_queue": Option(parse_positive, f"requests that may wait; more get 429 (default {ServeConfig.max_queue})"),
    "max_batch": Option(parse_positive, f"generations that run together (default {DEFAULT_BATCH['cpu']} on a CPU, "
                                        f"{DEFAULT_BATCH['gpu']} on a GPU)"),
    "batch_depth": Option(_text, "with a numeric --gamma: measured (default) caps the draft depth of each step for the "
                                 "batch size, from measured forward costs and the acceptance so far (no drafting when "
                                 "it does not pay); fixed: always --gamma. "
                                 "(--gamma auto, the default, sizes every row's draft for the batch itself.)",
                          choices=("measured", "fixed")),
    "shutdown_timeout": Option(parse_number, "on SIGTERM/SIGINT, how long running generations may finish before they "
                                             f"end with an error (default {ServeConfig.shutdown_timeout:g})",
                               metavar="SECONDS"),
    "api_key": Option(parse_words, "require `Authorization: Bearer KEY` on /v1 routes; repeat for several "
                                   "tenants, each with caches and histories of its own "
                                   "(also $SPECDEC_API_KEY; default: none, one tenant)", metavar="KEY", repeat=True),
    "api_key_file": Option(_text, "API keys, one per line (# comments and blank lines ignored), as --api-key",
                           metavar="FILE"),
    "keys_share_caches": Option(parse_flag, "all API keys share one scope: a request may reuse the prefix cache and "
                                            "history of any key's requests (faster where tenants send the same "
                                            "prompts, but cached_tokens and timing then tell one key what another "
                                            "sent)"),
    "metrics_key": Option(_text, "the operator's key for /metrics (`Authorization: Bearer KEY`; also "
                                 "$SPECDEC_METRICS_KEY): its counters are server-wide, so with API keys set no "
                                 "tenant's key opens it", metavar="KEY"),
    "public_metrics": Option(parse_flag, "/metrics needs no key (its counters tell anyone every tenant's activity)"),
    "allowed_origins": Option(parse_words, "browser origins allowed by CORS, e.g. http://localhost:3000 "
                                           "(default: none)", metavar="ORIGIN"),
    "max_connections": Option(parse_positive, "open connections at most; more get 503 "
                                              f"(default {ServeConfig.max_connections})"),
    "history_tokens": Option(parse_integer, "the default drafter also drafts from earlier requests' prompts and "
                                            "outputs, N tokens kept per tenant (a request's `user`; "
                                            f"default {HISTORY_TOKENS:,}; 0 = off)", metavar="N"),
    "share_history": Option(parse_flag, "every request drafts from every tenant's history (faster where tenants repeat "
                                        "each other, but a request's speed then tells something of other tenants' "
                                        "requests)"),
    "prefix_cache_tokens": Option(parse_integer, "finished requests keep up to N tokens of their caches, and a new "
                                                 "request starts from the longest prefix it shares with them: a "
                                                 "conversation's next turn or a shared system prompt is not computed "
                                                 f"again (default {SERVER_PREFIX_TOKENS:,}; on llama.cpp kept in KV "
                                                 "cells the batch leaves free, given back when it needs them, and "
                                                 "cells added only for what the batch's cannot hold; 0 = off)",
                           metavar="N"),
    "replicas": Option(parse_positive, "run N replicas as a Ray Serve application on a local Ray instance "
                                       "(pip install -e \".[ray]\"); each loads the models and takes --threads cores "
                                       "of its own (default: the cores / N)", metavar="N"),
    "max_replicas": Option(parse_positive, "with --replicas: autoscale between --replicas and N replicas on ongoing "
                                           "requests", metavar="N"),
}

# how a conversation becomes a prompt (`specdec serve`'s chat route, `specdec generate --chat`); the demo
# pair's template is read by the front ends that read options (a benchmark of the pair sends its text prompts)
DEMO_CHAT_TEMPLATE = str(Path(__file__).parent / "demo_pair" / "chat_template.jinja")
CHAT_OPTIONS: dict[str, Option] = {
    "chat_template": Option(_text, "a Jinja chat template for models without one (or to replace theirs)",
                            metavar="FILE"),
}


class Options:
    """A mapping of options being read: `take` converts the ones given (None is not given), and
    `finish` refuses any left over, so a misspelt option is an error, not a silent default."""

    def __init__(self, mapping: Mapping[str, object]):
        self.left = {str(k).replace("-", "_"): v for k, v in mapping.items() if v is not None}

    def take(self, options: Mapping[str, Option]) -> dict:
        taken = {}
        for name, option in options.items():
            if name in self.left:
                value = self.left.pop(name)
                try:
                    taken[name] = option.parse(value)
                except ValueError as error:
                    raise SpecDecError(f"--{name.replace('_', '-')}: {error}") from None
        return taken

    def finish(self) -> None:
        if self.left:
            raise SpecDecError("unknown option(s): " + ", ".join("--" + k.replace("_", "-") for k in sorted(self.left)))


def runtime_config(options: Options) -> RuntimeConfig:
    return RuntimeConfig(**options.take(RUNTIME_OPTIONS))


def decoder_config(options: Options, **defaults) -> DecoderConfig:
    """A DecoderConfig from the model, drafter and runtime options (`defaults`: DecoderConfig
    fields the front end sets, e.g. a server's larger prefix cache)."""
    given = options.take(MODEL_OPTIONS)
    target = given.pop("target", None)
    runtime = runtime_config(options)
    given.update(options.take(DRAFTER_OPTIONS))
    tree_options = {k: given.pop(k) for k in ("depth", "tree_width", "tree_children") if k in given}
    tree = None
    if "tree" in given:
        width, children = tree_options.get("tree_width", TREE_WIDTH), tree_options.get("tree_children", TREE_CHILDREN)
        if children not in ("sampled", "top"):
            raise SpecDecError(f"--tree-children is sampled or top, not {children!r}")
        tree = TreeShape(nodes=given.pop("tree"), width=width, sampled=children == "sampled")
    elif tree_options:
        raise SpecDecError("--depth, --tree-width and --tree-children shape a tree: add --tree NODES")
    if not given.get("staged") and given.get("inner_gamma", INNER_GAMMA) != INNER_GAMMA:
        raise SpecDecError("--inner-gamma sets the draft² length of --staged drafting: add --staged")
    gamma = tree_options.get("depth", given.get("gamma", GAMMA))
    spec = DrafterSpec.choose(target_given=target is not None, draft=given.get("draft"), ngram=given.get("ngram"),
                              prompt_lookup=given.get("prompt_lookup", False), tree=tree,
                              staged=given.get("staged", False), gamma=gamma, plain=given.get("plain", False),
                              inner_gamma=given.get("inner_gamma", INNER_GAMMA),
                              ngram_stochastic=not given.get("ngram_top1", False))
    template = options.take(CHAT_OPTIONS).get("chat_template")
    if template is None and target is None:  # the demo pair: its own (its checkpoints carry none)
        template = DEMO_CHAT_TEMPLATE
    if template is not None:
        defaults["chat_template"] = read_template(template)
    return DecoderConfig(target=target, drafter=spec, runtime=runtime, gamma=gamma,
                         explore=not given.get("no_explore", False), **defaults)


def serve_config(mapping: Mapping[str, object]) -> ServeConfig:
    """`specdec serve`'s options (argv parsed, or Ray Serve's builder arguments) as a ServeConfig:
    API keys gathered (--api-key, --api-key-file, $SPECDEC_API_KEY; --metrics-key,
    $SPECDEC_METRICS_KEY) and the chat template read and
    checked, so what cannot work fails here, before any model loads."""
    options = Options(mapping)
    given = options.take(SERVE_OPTIONS)
    prefix_tokens = given.pop("prefix_cache_tokens", SERVER_PREFIX_TOKENS)
    if prefix_tokens < 0:
        raise SpecDecError("--prefix-cache-tokens must be >= 0")
    server = {**SERVER_DECODER, "prefix_cache": prefix_tokens}
    server.update((name, given.pop(name)) for name in ("history_tokens", "share_history") if name in given)
    decoder = decoder_config(options, **server)
    options.finish()
    keys = api_keys(given.pop("api_key", ()), given.pop("api_key_file", None))
    metrics_key = given.pop("metrics_key", None) or os.environ.get("SPECDEC_METRICS_KEY") or None
    return ServeConfig(decoder=decoder, api_keys=keys, metrics_key=metrics_key, **given)


def api_keys(keys: tuple[str, ...], key_file: str | None) -> tuple[str, ...]:
    """The server's API keys: those given, the lines of `key_file`, $SPECDEC_API_KEY; each a tenant."""
    keys = list(keys)
    if os.environ.get("SPECDEC_API_KEY"):
        keys.append(os.environ["SPECDEC_API_KEY"])
    if key_file:
        try:
            lines = Path(key_file).expanduser().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise SpecDecError(f"cannot read the API key file {key_file}: {error}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise SpecDecError(f"the API key file {key_file} holds no key")
    return tuple(dict.fromkeys(keys))


def read_template(path: str) -> str:
    """A Jinja chat template's text, checked to parse."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SpecDecError(f"could not read the chat template {path}: {error}") from None
    import jinja2.sandbox

    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise SpecDecError(f"{path} is not a valid Jinja template: {error}") from None
    return text


def with_runtime(config: DecoderConfig, **changes) -> DecoderConfig:
    """`config` with some runtime options changed (e.g. a replica's threads)."""
    return replace(config, runtime=replace(config.runtime, **changes))


