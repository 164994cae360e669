"""`specdec generate`, `specdec profile` and `specdec ngram build`."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from specdec.cli.arguments import (add_model_arguments, add_options, add_sampling_arguments, decoder_config,
                                  sampling_params)
from specdec.config import CHAT_OPTIONS
from specdec.errors import SpecDecError
from specdec.params import Limits


GENERATE_TEMPERATURE = 0.7  # a model's own sampling at 1 reads as noise more often than people expect (llama.cpp: 0.8)


def add_parsers(commands) -> None:
    gen = commands.add_parser("generate", help="generate text from a prompt",
                              description="Stream a continuation of PROMPT, then a one-line stats summary (on stderr).")
    gen.add_argument("prompt", nargs="?", help="the prompt; - reads it from stdin (or give --prompt-file)")
    gen.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
    add_model_arguments(gen)
    add_sampling_arguments(gen, temperature=GENERATE_TEMPERATURE)
    gen.add_argument("--seed", type=int, default=None, help="repeatable sampling (default: fresh randomness)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this share of the "
                                                              "likeliest (0 = off, default)")
    gen.add_argument("--repeat-penalty", type=float, default=1.0,
                     help="divide a positive logit (multiply a negative) of a token already in the text (1 = off)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0)")
    gen.add_argument("--logit-bias", metavar="TOKEN=BIAS", action="append", default=[],
                     help="add BIAS in [-100, 100] to TOKEN's logit (a token id; repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="generate past the model's end token")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--prediction", metavar="FILE",
                     help="a file holding the text the output is expected to be (e.g. the edited file): "
                          "the default drafter proposes it")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    shape = gen.add_argument_group("structured output (one of these): the output must match it, and stays the "
                                   "target's under that constraint")
    shape = shape.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="a JSON Schema (a .json file)")
    shape.add_argument("--json-object", action="store_true", help="any JSON object")
    shape.add_argument("--regex", metavar="PATTERN", help="a regular expression the whole output matches")
    shape.add_argument("--choice", metavar="TEXT", action="append", help="one of these strings (repeatable)")
    shape.add_argument("--grammar", metavar="FILE", help="a context-free grammar: GBNF (llama.cpp's) or Lark")
    chat = gen.add_argument_group("a conversation")
    chat.add_argument("--chat", action="store_true",
                      help="send the prompt as a user's message, rendered by the model's chat template")
    chat.add_argument("--system", metavar="TEXT", help="a system message before it (implies --chat)")
    add_options(chat, CHAT_OPTIONS)
    gen.set_defaults(run=run_generate)

    ngram = commands.add_parser("ngram", help="n-gram drafter tools").add_subparsers(dest="ngram_command",
                                                                                    required=True)
    build = ngram.add_parser("build", help="build a Katz-backoff trigram over a tokenizer's ids from text files")
    build.add_argument("files", nargs="+")
    build.add_argument("--tokenizer", required=True, help="directory with the target's tokenizer files")
    build.add_argument("-o", "--output", required=True, help="output file (.safetensors)")
    build.set_defaults(run=run_ngram_build)

    prof = commands.add_parser("profile",
                               help="measure (or show the cached) forward costs the auto policy decides with",
                               description="Time one forward of k new tokens for the target (and the draft model), "
                                           "k = 1 ... 128, plus the engine's own time per iteration; "
                                           "cached per model, backend, threads and device.")
    add_model_arguments(prof)
    prof.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    prof.add_argument("--plot", metavar="FILE.png", help="also draw the cost curves")
    prof.add_argument("--json", action="store_true", help="print the profile as JSON")
    prof.add_argument("--breakdown", action="store_true",
                      help="GGUF: also time the target's forwards per kind of op (output layer, matmuls, "
                           "attention, other) at k = 1, 4, 8, 16 (specdec/runtime/op_times.py)")
    prof.set_defaults(run=run_profile)


def read_text(path: str, what: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SpecDecError(f"cannot read the {what} file {path}: {error}") from None


def prompt_of(args) -> str:
    """The prompt: the argument, stdin for `-`, or --prompt-file (one of them)."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise SpecDecError("give a prompt, - to read it from stdin, or --prompt-file FILE (one of them)")
    if args.prompt_file is not None:
        return read_text(args.prompt_file, "prompt")
    if args.prompt == "-":
        return sys.stdin.read()
    return args.prompt


def biases_of(pairs: list[str]) -> dict[int, float]:
    """--logit-bias TOKEN=BIAS flags as a dict."""
    biases = {}
    for pair in pairs:
        token, _, bias = pair.partition("=")
        try:
            biases[int(token)] = float(bias)
        except ValueError:
            raise SpecDecError(f"--logit-bias takes TOKEN=BIAS (a token id and a number), not {pair!r}") from None
    return biases


def constraint_of(args):
    """The structured-output flag as a `Constraint`, its syntax checked (before any model loads); None without one."""
    from specdec.constraints import Constraint

    if args.json_schema is not None:
        constraint = Constraint.json_schema(read_text(args.json_schema, "JSON Schema"), param="--json-schema")
    elif args.json_object:
        constraint = Constraint.json_object(param="--json-object")
    elif args.regex is not None:
        constraint = Constraint.regex(args.regex, param="--regex")
    elif args.choice:
        constraint = Constraint.choice(args.choice, param="--choice")
    elif args.grammar is not None:
        constraint = Constraint.grammar(read_text(args.grammar, "grammar"), param="--grammar")
    else:
        return None
    constraint.lark()  # raises, naming the flag, where the text is not one
    return constraint


def run_generate(args) -> None:
    prompt = prompt_of(args)
    prediction = read_text(args.prediction, "prediction") if args.prediction is not None else None
    constraint = constraint_of(args)
    sampling = sampling_params(args, seed=args.seed, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
                               presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                               logit_bias=biases_of(args.logit_bias))
    limits = Limits(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    config = decoder_config(args, prefix_cache=0)
    from specdec.build import build_decoder  # torch and the backends: only once the arguments are checked

    decoder = build_decoder(config)
    if args.chat or args.system is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt = decoder.chat_ids([*system, {"role": "user", "content": prompt}])
    stream = decoder.stream(prompt, sampling, limits, prediction=prediction or None, constraint=constraint)
    if args.json:
        for _ in stream:
            pass
        print(json.dumps(stream.result.to_dict()))
        return
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    if not stream.result.text.endswith("\n"):  # the stats line starts a line of its own
        sys.stdout.write("\n")
        sys.stdout.flush()
    print(format_stats(stream.result.stats, decoder), file=sys.stderr)


def run_profile(args) -> None:
    config = decoder_config(args, prefix_cache=0)
    from specdec import profiling
    from specdec.build import build_decoder

    decoder = build_decoder(config, prepare=False)  # measured here, once
    profile = profiling.profile(decoder.target, decoder.draft_model, refresh=args.refresh)
    if args.json:
        print(json.dumps(profile.to_json()))
    else:
        print(format_profile(profile, decoder, profiling.cache_dir()))
    if args.plot:
        print(f"wrote {plot_profile(profile, args.plot)}", file=sys.stderr)
    if args.breakdown:
        if not decoder.target.times_ops:
            raise SpecDecError("--breakdown times llama.cpp's ops: it takes a GGUF target")
        from specdec.runtime.op_times import breakdown, format_breakdown

        note = decoder.target.output_layer_note
        print(f"\nwhere the target's forward goes (output layer: {decoder.target.output_layer}"
              f"{f'; {note}' if note else ''}):\n")
        print(format_breakdown(breakdown(decoder.target)))


def format_profile(profile, decoder, cache) -> str:
    """The cost curves as a table: milliseconds and the ratio to a one-token forward."""
    load = f", load {profile.load:.2f}" if profile.load is not None else ""
    load += f", {profile.contention:.0%} of the time waiting for a core" + ("" if profile.trusted else
                                                                          " (beside other work: not trusted)")
    lines = [f"target: {decoder.target.describe()}"
             + (f" · draft: {decoder.draft_model.describe()}" if decoder.draft_model else ""),
             f"measured {profile.measured} in {profile.rounds} rounds{load} · cache: {cache}", "",
             "| k | target ms | × k=1 | draft ms |", "|---|---|---|---|"]
    for k, seconds in sorted(profile.target.items()):
        draft = profile.draft.get(k) if profile.draft else None
        lines.append(f"| {k} | {seconds * 1e3:.2f} | {seconds / profile.target[min(profile.target)]:.2f} | "
                     + (f"{draft * 1e3:.2f}" if draft is not None else "–") + " |")
    lines += ["", f"engine time per iteration outside the target's forward: {profile.step_overhead * 1e3:.2f} ms"]
    if profile.draft:
        lines.append(f"time per draft level outside the draft model's forward: {profile.level_overhead * 1e3:.2f} ms")
    return "\n".join(lines)


def plot_profile(profile, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in (("target", profile.target), ("draft", profile.draft)):
        if curve:
            ax.plot(sorted(curve), [curve[k] * 1e3 for k in sorted(curve)], marker="o", label=name)
    ax.set(xscale="log", xlabel="new tokens per forward (k)", ylabel="ms per forward", title="forward cost t(k)")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as error:
        raise SpecDecError(f"could not write {path}: {error}") from None
    finally:
        plt.close(fig)
    return path


def format_stats(stats, decoder) -> str:
    parts = [f"{stats.generated_tokens} tokens", f"{stats.total_seconds:.2f} s",
             f"{stats.tokens_per_second or 0:.1f} tok/s"]
    parts.append(f"{stats.target_forwards} target forwards")
    if decoder.drafter is not None:
        rate = stats.acceptance_rate
        parts += [
            f"drafter {decoder.drafter.name}, "
            + (f"depth {decoder.gamma}" if decoder.drafter.tree else f"gamma {decoder.gamma}"),
            f"{stats.draft_forwards} draft forwards",
            f"acceptance {rate:.1%}" if rate is not None else "acceptance n/a",
        ]
    if stats.tree_nodes and ((decoder.drafter is not None and decoder.drafter.tree) or stats.drafters):
        parts.append(f"{sum(stats.tree_nodes) / len(stats.tree_nodes):.1f} draft nodes/iteration")
    if stats.drafters and decoder.gamma == "auto":
        counts = collections.Counter(stats.drafters)
        parts.append("drafted by " + ", ".join(
            f"{name} {count / len(stats.drafters):.0%}" for name, count in counts.most_common()))
    if stats.source_trials:
        parts.append("accepted by source " + ", ".join(
            f"{source} {accepted}/{tried}" for source, (tried, accepted) in sorted(stats.source_trials.items())))
    parts.append(f"{stats.tokens_per_target_forward or 0:.2f} tokens/target forward")
    return "[specdec] " + " · ".join(parts)


def run_ngram_build(args) -> None:
    from transformers import AutoTokenizer

    from specdec.katz import build_from_files
    from specdec.runtime import tokenizer_fingerprint

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True, trust_remote_code=False)
    except Exception as error:
        raise SpecDecError(f"could not load a tokenizer from {args.tokenizer}: {error}") from error
    model = build_from_files(args.files, tokenizer, fingerprint=tokenizer_fingerprint(tokenizer))
    model.save(args.output)
    print(f"wrote {args.output} (vocabulary {model.vocab_size})", file=sys.stderr)
