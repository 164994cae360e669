"""`specdec train`: a small model from text files, or a draft distilled from a target."""

from __future__ import annotations

import sys

from specdec.cli.arguments import positive
from specdec.errors import SpecDecError
from specdec.config import BACKENDS, DistillConfig, TrainConfig


def add_parser(commands) -> None:
    tr = commands.add_parser(
        "train", help="train a small Llama-architecture model, or distil a draft from a target (GGUF or checkpoint)",
        description="Train on text/code files into a Hugging Face checkpoint directory. With --distill-from TARGET, "
                    "distil a draft for TARGET (a GGUF file or a checkpoint): the target continues windows of local "
                    "text and code, and a small draft that predicts the target's most used tokens learns its choices; "
                    "OUTPUT gets a checkpoint, draft.gguf for llama.cpp and distill.json (specdec/distill.py). "
                    "Re-running the same command resumes.")
    tr.add_argument("files", nargs="*", help="text/code files or directories (*.py, *.txt, *.md); "
                                             "with --distill-from, default: the standard library's source "
                                             "less the bench suites' files")
    tr.add_argument("-o", "--output", required=True, help="checkpoint directory to write (training state under OUTPUT)")
    tr.add_argument("--tokenizer", help="reuse this tokenizer directory instead of training a byte-level BPE")
    tr.add_argument("--distill-from", metavar="TARGET",
                    help="distil a draft for this target (.gguf file or checkpoint directory)")
    shared = ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "context", "batch_size", "steps", "lr",
              "warmup", "weight_decay", "holdout", "eval_every", "save_every", "seed")
    trained, distilled = TrainConfig(files=[], output=""), DistillConfig(target="", output="")
    for name in shared:
        value, other = getattr(trained, name), getattr(distilled, name)
        kind = float if isinstance(other, float) else int
        tr.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                        help=f"default {value} (distilling: {other})")
    for name in ("vocab_size", "seq_len"):
        tr.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(trained, name),
                        help=f"default {getattr(trained, name)} (not distilling)")
    distill = tr.add_argument_group("distilling (--distill-from)")
    for name, help_text in (("draft_vocab", "target tokens the draft predicts (the others get q = 0)"),
                            ("corpus_tokens", "corpus tokens read"), ("prompts", "corpus windows the target continues"),
                            ("short_prompts", "short windows (8-48 tokens at line starts) it continues"),
                            ("prompt_tokens", "tokens per window"), ("new_tokens", "tokens per continuation"),
                            ("temperature", "of the sampled half of the continuations"),
                            ("soft_top", "soft labels per token"),
                            ("generate_batch", "continuations decoded side by side")):
        value = getattr(distilled, name)
        distill.add_argument("--" + name.replace("_", "-"), type=type(value), default=value,
                             help=f"{help_text} (default {value})")
    distill.add_argument("--threads", type=positive,
                         help="CPU threads of the target and of training (default: torch's / llama.cpp's)")
    distill.add_argument("--backend", choices=BACKENDS, default="auto",
                         help="run the target on this backend (default: by its path)")
    distill.add_argument("--no-gguf", action="store_true", help="skip writing OUTPUT/draft.gguf")
    distill.add_argument("--head", action="store_true",
                         help="train an EAGLE-3 head (specdec/distill_eagle3.py) instead of a draft model: it reads "
                              "the target's own states at three layers; one target forward per corpus window of "
                              "--prompt-tokens, training-time test; OUTPUT gets config.json and model.safetensors "
                              "in the EAGLE-3 layout (vLLM and SGLang load it too) and eagle3.json; draft with "
                              "--draft OUTPUT. Its defaults: --prompts 2048 --prompt-tokens 256 --batch-size 4 "
                              "--steps 1200 --lr 0.001 --weight-decay 0 --draft-vocab 8192 --bf16")
    distill.add_argument("--small-head", action="store_true",
                         help="train the small head of specdec/distill_head.py instead: it reads the final norm's "
                              "state only, trained on the target's continuations; OUTPUT gets head.safetensors and "
                              "head.json. Its defaults: --batch-size 256 --steps 2000 --lr 0.001 --weight-decay 0")
    tr.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model trains")
    tr.add_argument("--bf16", action="store_const", const=True,
                    help="bfloat16 autocast for matmuls (weights stay float32; on by default for --head)")
    tr.add_argument("--save-dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="not distilling")
    tr.set_defaults(run=run_train)


def run_train(args) -> None:
    from dataclasses import fields

    from specdec.distill import distill
    from specdec.train import train

    given = {name: value for name, value in vars(args).items() if value is not None}
    if args.distill_from is None:
        if args.head or args.small_head:
            raise SpecDecError(f"{'--head' if args.head else '--small-head'} trains a draft head on a target's "
                               "states: name the target with --distill-from TARGET")
        config = TrainConfig(**{f.name: given[f.name] for f in fields(TrainConfig) if f.name in given})
        state = train(config)
        loss = state.history[-1]["heldout_loss"] if state.history else float("nan")
        print(f"wrote {config.output}: {state.step} steps, {state.tokens_seen} tokens, held-out loss {loss:.3f}",
              file=sys.stderr)
        return
    if args.tokenizer or args.save_dtype != "float32":
        raise SpecDecError("--tokenizer and --save-dtype do not apply to --distill-from: "
                           "the draft uses the target's tokens, in float32")
    if args.threads:
        torch_threads(args.threads)
    if args.head and args.small_head:
        raise SpecDecError("--head and --small-head train two kinds of head: choose one")
    if args.head or args.small_head:
        from specdec.distill_eagle3 import EAGLE3_DEFAULTS
        from specdec.distill_head import HEAD_DEFAULTS

        flag = "--head" if args.head else "--small-head"
        model_flags = [f"--{name.replace('_', '-')}"
                       for name in ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size")
                       if name in given] + (["--no-gguf"] if args.no_gguf else [])
        if model_flags:
            raise SpecDecError(f"{', '.join(model_flags)} shape a draft model; a head is as wide as its target "
                               f"(drop them, or {flag})")
        given = {**(EAGLE3_DEFAULTS if args.head else HEAD_DEFAULTS), **given, "head": args.small_head}
    config = DistillConfig(target=args.distill_from, gguf=not args.no_gguf,
                           **{f.name: given[f.name] for f in fields(DistillConfig)
                              if f.name in given and f.name not in ("target", "gguf")})
    if args.head:
        return report_eagle3(config)
    if config.head:
        return report_head(config)
    report = distill(config)
    print(f"wrote {config.output}: a draft of {report['parameters']:,} parameters predicting "
          f"{report['vocabulary']['draft']} of {report['vocabulary']['target']} tokens "
          f"({report['vocabulary']['generated_tokens_covered']:.1%} of the target's generated tokens); "
          f"held-out agreement with the target's greedy choice {report['heldout_agreement']:.3f}; "
          f"{report['total_seconds'] / 60:.1f} min, peak {report['peak_rss_mb']} MB", file=sys.stderr)


def report_head(config) -> None:
    from specdec.distill_head import distill_head

    summary = distill_head(config)
    agreement = ", ".join(f"{a:.3f}" for a in summary["heldout_agreement_by_depth"] or [])
    print(f"wrote {config.output}: a draft head of {summary['parameters']:,} parameters over "
          f"{summary['shape']['vocab']} of the target's "
          f"tokens; held-out agreement with the target's greedy choice by depth: {agreement}; "
          + stage_minutes(summary["stages"]), file=sys.stderr)


def report_eagle3(config) -> None:
    from specdec.distill_eagle3 import distill_eagle3

    summary = distill_eagle3(config)
    agreement = "/".join(f"{a:.3f}" for a in summary["heldout_agreement_by_depth"] or [])
    print(f"wrote {config.output}: an EAGLE-3 head of {summary['parameters']:,} parameters reading the target's "
          f"layers {summary['layers']}, predicting {summary['draft_vocab']} tokens; held-out agreement with the "
          f"target's greedy choice by depth: {agreement}; "
          + stage_minutes(summary["stages"]), file=sys.stderr)


def stage_minutes(stages: dict) -> str:
    """A run's stages for its closing line: "corpus 0.1 min, prefill 4.4 min, ..."."""
    return ", ".join(f"{name} {stage['seconds'] / 60:.1f} min" for name, stage in stages.items())


def torch_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)
