"""The options the subcommands share, declared once, and argv into configurations.

Options that become a configuration (`specdec.config`) default to *not given* (argparse.SUPPRESS):
the configuration's own field holds the default, and `decoder_config` / `serve_config` read only
what the user gave, exactly as Ray Serve's builder reads its key=value options.
"""

from __future__ import annotations

import argparse
from typing import Callable

from specdec import config
from specdec.config import DecoderConfig, Options
from specdec.runtime import BACKENDS, COMPILE_CHOICES, OUTPUT_LAYERS, RuntimeConfig

GIVEN = argparse.SUPPRESS  # an option left out is absent from the namespace: the configuration's default applies
CONFIG_OPTIONS = {"target", *config.RUNTIME_OPTIONS, *config.DRAFTER_OPTIONS, *config.SERVE_OPTIONS}


def argument_type(parse: Callable) -> Callable:
    """A `specdec.config` parser as an argparse type (its ValueError becomes a usage error)."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


gamma_type, positive = argument_type(config.parse_gamma), argument_type(config.parse_positive)


def config_options(args: argparse.Namespace) -> dict:
    """The options of `args` that make a configuration, as given."""
    return {name: value for name, value in vars(args).items() if name in CONFIG_OPTIONS}


def decoder_config(args: argparse.Namespace, **defaults) -> DecoderConfig:
    options = Options(config_options(args))
    decoder = config.decoder_config(options, **defaults)
    options.finish()
    return decoder


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """How the models run: `RuntimeConfig`."""
    defaults = RuntimeConfig()
    group = parser.add_argument_group("how the models run")
    group.add_argument("--backend", choices=BACKENDS, default=GIVEN,
                       help="auto (default): a .gguf file runs on llama.cpp, a checkpoint directory on transformers")
    group.add_argument("--device", default=GIVEN,
                       help="checkpoints: cpu, cuda, cuda:1 ... (default: cuda if available)")
    group.add_argument("--dtype", default=GIVEN,
                       help="checkpoints: float32 (CPU default), bfloat16 (CUDA default), float16")
    group.add_argument("--attn-implementation", default=GIVEN, metavar="NAME",
                       help="checkpoints: eager, sdpa, flex_attention ... "
                            "(default: what transformers picks for the model)")
    group.add_argument("--threads", type=positive, default=GIVEN,
                       help="CPU threads (default: every core this process may use)")
    group.add_argument("--gpu-layers", type=int, default=GIVEN, metavar="N",
                       help="GGUF: layers to offload to the GPU where llama.cpp was built with one "
                            "(-1 = all; default 0)")
    group.add_argument("--context", type=positive, default=GIVEN, metavar="TOKENS",
                       help="GGUF: KV cache cells; a checkpoint with --compile on: a static slot's length "
                            "(default: the trained context, at most 4096)")
    group.add_argument("--compile", choices=COMPILE_CHOICES, default=GIVEN,
                       help=f"checkpoints: auto (default {defaults.compile!r}: on for a GPU, off on the CPU), "
                            "on (a static KV pool, a CUDA graph per forward shape), "
                            "off (growing caches, eager kernels), or how the pool's forwards run: graphs (= on), "
                            "inductor (torch.compile's kernels too), aot_eager, static (the pool, nothing compiled)")
    group.add_argument("--tokenizer", default=GIVEN, metavar="DIR",
                       help="GGUF: a Hugging Face tokenizer directory to use instead of the file's own")
    group.add_argument("--output-layer", choices=OUTPUT_LAYERS, default=GIVEN,
                       help="GGUF on the CPU: who computes the logits from the final norm. "
                            "auto (default): specdec's kernel where it runs (a Q8_0 or Q6_K output matrix, "
                            "AVX-512 VNNI), agrees with llama.cpp and is faster; else llama.cpp")
    group.add_argument("--batch-invariant", action="store_true", default=GIVEN,
                       help="GGUF: kernels that give a token the same logits in a batch of any size "
                            "(checked at load), so greedy speculation equals plain greedy decoding exactly; "
                            "see docs/backends.md for what it costs")


def add_model_paths(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=GIVEN,
                        help="target: a checkpoint directory or a .gguf file "
                             "(default: the demo pair, drafting with its draft model)")
    parser.add_argument("--draft", default=GIVEN,
                        help="draft model: a checkpoint directory or a .gguf file (same tokenizer as the target)")
    parser.add_argument("--ngram", default=GIVEN,
                        help="n-gram model file from `specdec ngram build` "
                             "(a drafter, or with --staged the draft model's drafter)")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Models, drafter and how they run (`DecoderConfig`): shared by generate, verify, profile and serve."""
    add_model_paths(parser)
    group = parser.add_argument_group("drafting")
    group.add_argument("--prompt-lookup", action="store_true", default=GIVEN,
                       help="draft by matching the context's last tokens earlier in the context")
    group.add_argument("--ngram-top1", action="store_true", default=GIVEN,
                       help="with --ngram: propose the top token instead of sampling")
    group.add_argument("--plain", action="store_true", default=GIVEN,
                       help="decode without any drafter (plain autoregressive decoding, the baseline)")
    group.add_argument("--no-explore", action="store_true", default=GIVEN,
                       help="the default policy drafts prompt lookup only when its estimate pays, without probing it")
    group.add_argument("--gamma", type=gamma_type, default=GIVEN,
                       help="draft tokens per iteration, or 'auto' (default): chosen every iteration from measured "
                            "forward costs and the acceptance so far; with no other drafter flags, prompt lookup and "
                            "the draft model share one tree")
    group.add_argument("--tree", type=positive, default=GIVEN, metavar="NODES",
                       help="draft token trees of up to NODES nodes with the draft model")
    group.add_argument("--depth", type=gamma_type, default=GIVEN,
                       help="with --tree: tree depth, or 'auto' (default: --gamma)")
    group.add_argument("--tree-width", type=positive, default=GIVEN,
                       help="with --tree: children per node and nodes expanded per level "
                            f"(default {config.TREE_WIDTH})")
    group.add_argument("--tree-children", choices=["sampled", "top"], default=GIVEN,
                       help="with --tree at temperature > 0: draw children from the draft, or take its most likely "
                            f"tokens (default {config.TREE_CHILDREN})")
    group.add_argument("--staged", action="store_true", default=GIVEN,
                       help="the draft model drafts with --ngram or --prompt-lookup as its own drafter (draft²)")
    group.add_argument("--inner-gamma", type=positive, default=GIVEN,
                       help="with --staged: draft² tokens per draft-model forward (default 4)")
    add_runtime_arguments(parser)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
