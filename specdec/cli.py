"""The `specdec` command: parse, call the library, print. No logic of its own."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

from specdec import costs, losslessness
from specdec.drafters.history import DEFAULT_TOKENS
from specdec.errors import SpecDecError
from specdec.runtime import BACKENDS, COMPILE_CHOICES, OUTPUT_LAYERS


def _gamma(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        gamma = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None
    if gamma < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return gamma


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def load_decoder(args, slots: int = 1, measure: bool = True, prefix_cache: int = 0):
    """The decoder the decoding arguments describe; `slots` generations may run at once, and
    finished ones keep up to `prefix_cache` tokens for later ones to start from. With `measure`,
    forward costs the auto policy needs are timed now if they are not cached yet."""
    import specdec

    if args.tree is None and (args.depth is not None or args.tree_width != 3 or args.tree_children != "sampled"):
        raise SpecDecError("--depth, --tree-width and --tree-children shape a tree: add --tree NODES")
    if not args.staged and args.inner_gamma != 4:
        raise SpecDecError("--inner-gamma sets the draft² length of --staged drafting: add --staged")
    if args.plain and (args.draft or args.ngram or args.prompt_lookup or args.tree or args.staged):
        raise SpecDecError("--plain decodes without a drafter: drop the drafter flags")
    tree = None
    if args.tree is not None:
        tree = specdec.TreeShape(nodes=args.tree, width=args.tree_width, sampled=args.tree_children == "sampled")
    decoder = specdec.load(
        args.target, draft=args.draft, ngram=args.ngram, prompt_lookup=args.prompt_lookup,
        gamma=args.depth if args.depth is not None else args.gamma, device=args.device, dtype=args.dtype,
        ngram_stochastic=not args.ngram_top1, tree=tree, staged=args.staged, inner_gamma=args.inner_gamma,
        attn_implementation=args.attn_implementation, slots=slots, plain=args.plain, explore=not args.no_explore, prefix_cache=prefix_cache,
        **runtime_options(args),
    )
    if measure and decoder.uses_profile and not costs.cache_path(decoder.target, decoder.draft_model).is_file():
        print("specdec: timing the models' forwards for the auto policy (once per model and machine; `specdec profile` shows them)",
              file=sys.stderr)
        decoder.profile()
    return decoder


def runtime_options(args) -> dict:
    """The backend and its knobs, as `specdec.load` takes them."""
    return dict(backend=args.backend, threads=args.threads, gpu_layers=args.gpu_layers, context=args.context, tokenizer=args.tokenizer,
                output_layer=args.output_layer, batch_invariant=args.batch_invariant, compile=args.compile)


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto (default): a .gguf file runs on llama.cpp, a checkpoint directory on transformers")
    parser.add_argument("--threads", type=_positive, default=None, help="CPU threads (default: every core this process may use)")
    parser.add_argument("--gpu-layers", type=int, default=None, metavar="N",
                        help="GGUF: layers to offload to the GPU where llama.cpp was built with one (-1 = all; default 0)")
    parser.add_argument("--context", type=_positive, default=None, metavar="TOKENS",
                        help="GGUF: KV cache cells; a checkpoint with --compile on: a static slot's length "
                             "(default: the trained context, at most 4096)")
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="checkpoints: auto (default; on for a GPU, off on the CPU), on (a static KV pool, a CUDA graph per "
                             "forward shape), off (growing caches, eager kernels), or how the pool's forwards run: graphs (= on), "
                             "inductor (torch.compile's kernels too), aot_eager, static (the pool, nothing compiled)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="GGUF: a Hugging Face tokenizer directory to use instead of the file's own")
    parser.add_argument("--output-layer", choices=OUTPUT_LAYERS, default="auto",
                        help="GGUF on the CPU: who computes the logits from the final norm. auto (default): specdec's kernel where "
                             "it runs (a Q8_0 or Q6_K output matrix, AVX-512 VNNI), agrees with llama.cpp and is faster; else llama.cpp")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="GGUF: kernels that give a token the same logits in a batch of any size (checked at load), so greedy "
                             "speculation equals plain greedy decoding exactly; see the README for what it costs")


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Models, drafter and sampling: shared by `generate` and `verify`."""
    add_model_arguments(parser)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Models and drafter: shared by `generate`, `verify` and `serve`."""
    parser.add_argument("--target", help="target: a checkpoint directory or a .gguf file (default: the demo pair, drafting with its draft model)")
    parser.add_argument("--draft", help="draft model: a checkpoint directory or a .gguf file (same tokenizer as the target)")
    parser.add_argument("--ngram", help="n-gram model file from `specdec ngram build` (a drafter, or with --staged the draft model's drafter)")
    parser.add_argument("--prompt-lookup", action="store_true", help="draft by matching the context's last tokens earlier in the context")
    parser.add_argument("--ngram-top1", action="store_true", help="with --ngram: propose the top token instead of sampling")
    parser.add_argument("--plain", action="store_true", help="decode without any drafter (plain autoregressive decoding, the baseline)")
    parser.add_argument("--no-explore", action="store_true",
                        help="the default policy drafts prompt lookup only when its estimate pays, without probing it")
    parser.add_argument("--gamma", type=_gamma, default="auto",
                        help="draft tokens per iteration, or 'auto' (default): chosen every iteration from measured forward costs and "
                             "the acceptance so far; with no other drafter flags, prompt lookup and the draft model share one tree")
    parser.add_argument("--tree", type=_positive, metavar="NODES", help="draft token trees of up to NODES nodes with the draft model")
    parser.add_argument("--depth", type=_gamma, help="with --tree: tree depth, or 'auto' (default: --gamma)")
    parser.add_argument("--tree-width", type=_positive, default=3, help="with --tree: children per node and nodes expanded per level (default 3)")
    parser.add_argument("--tree-children", choices=["sampled", "top"], default="sampled",
                        help="with --tree at temperature > 0: draw children from the draft, or take its most likely tokens (default sampled)")
    parser.add_argument("--staged", action="store_true", help="the draft model drafts with --ngram or --prompt-lookup as its own drafter (draft²)")
    parser.add_argument("--inner-gamma", type=_positive, default=4, help="with --staged: draft² tokens per draft-model forward (default 4)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (CUDA default), float16")
    parser.add_argument("--attn-implementation", default=None, metavar="NAME",
                        help="eager, sdpa, flex_attention ... (default: what transformers picks for the model)")
    add_runtime_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for local Hugging Face checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt", description="Stream a continuation of PROMPT, then a one-line stats summary (on stderr).")
    gen.add_argument("prompt")
    add_decoding_arguments(gen)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--prediction", metavar="FILE",
                     help="a file holding the text the output is expected to be (e.g. the edited file): the default drafter proposes it")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(run=run_generate)

    ngram = commands.add_parser("ngram", help="n-gram drafter tools").add_subparsers(dest="ngram_command", required=True)
    build = ngram.add_parser("build", help="build a Katz-backoff trigram over a tokenizer's ids from text files")
    build.add_argument("files", nargs="+")
    build.add_argument("--tokenizer", required=True, help="directory with the target's tokenizer files")
    build.add_argument("-o", "--output", required=True, help="output file (.safetensors)")
    build.set_defaults(run=run_ngram_build)

    bench = commands.add_parser("bench", help="benchmark strategies and Hugging Face peers on the same models",
                                description="Run plain decoding, chains at several γ, adaptive γ, token trees, staged drafting, prompt lookup, n-gram and Hugging Face "
                                            "generate() (plain, assisted, prompt lookup) prompt by prompt; write JSON, Markdown and PNG plots.")
    bench.add_argument("--target", help="target checkpoint (default: the demo pair with its draft and n-gram)")
    bench.add_argument("--draft", help="draft checkpoint for the chain strategies and HF assisted generation")
    bench.add_argument("--ngram", help="n-gram file for the n-gram strategy")
    bench.add_argument("--suite", nargs="+", default=None, metavar="NAME",
                       help="workload suites: complete (HumanEval, the default), edit, extract, chat, agent, prose, or all")
    bench.add_argument("--prompts", help="a prompts file instead of the suites (.jsonl with a \"prompt\" field, or one prompt per line)")
    bench.add_argument("--limit", type=int, help="use the first N prompts of each suite")
    bench.add_argument("--rounds", type=int, default=None, help="run every prompt this many times, in interleaved rounds (default 1)")
    bench.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (--quick: 64)")
    bench.add_argument("--mode", choices=["greedy", "sampled", "both"], default="both")
    bench.add_argument("--temperature", type=float, default=0.8, help="sampled mode (default 0.8)")
    bench.add_argument("--top-k", type=int, default=20, help="sampled mode (default 20)")
    bench.add_argument("--gammas", default=None, help="fixed γ values for the chain strategies (default 1,2,3,4; --quick: 2)")
    bench.add_argument("--trees", default=None, help="NODESxDEPTH of the token-tree strategies; '' for none (default 3x2,4x3,8x4; --quick: none)")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke check in a few minutes: 5 prompts, 64 new tokens, plain, the default policy, one chain, prompt lookup, peers")
    bench.add_argument("--tree-width", type=int, default=2, help="children per node and nodes expanded per level (default 2)")
    bench.add_argument("--staged-gamma", type=int, default=3, help="depth of the staged strategies (default 3)")
    bench.add_argument("--staged-tree", type=int, default=4, help="nodes of the staged-tree strategies (default 4)")
    bench.add_argument("--no-peers", action="store_true", help="skip Hugging Face generate()")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--device", default=None, help="transformers: cpu (default), cuda, cuda:N")
    bench.add_argument("--dtype", default=None)
    add_runtime_arguments(bench)
    bench.add_argument("--out", default="bench-out", help="output folder (bench.json, bench.md, *.png)")
    bench.set_defaults(run=run_bench_command)

    tr = commands.add_parser("train", help="train a small Llama-architecture model, or distil a draft from a target (GGUF or checkpoint)",
                             description="Train on text/code files into a Hugging Face checkpoint directory. With --distill-from TARGET, "
                                         "distil a draft for TARGET (a GGUF file or a checkpoint): the target continues windows of local "
                                         "text and code, and a small draft that predicts the target's most used tokens learns its choices; "
                                         "OUTPUT gets a checkpoint, draft.gguf for llama.cpp and distill.json (specdec/distill.py). "
                                         "Re-running the same command resumes.")
    tr.add_argument("files", nargs="*", help="text/code files or directories (*.py, *.txt, *.md); "
                                             "with --distill-from, default: the standard library's source less the bench suites' files")
    tr.add_argument("-o", "--output", required=True, help="checkpoint directory to write (training state under OUTPUT)")
    tr.add_argument("--tokenizer", help="reuse this tokenizer directory instead of training a byte-level BPE")
    tr.add_argument("--distill-from", metavar="TARGET", help="distil a draft for this target (.gguf file or checkpoint directory)")
    from specdec.distill import DistillConfig
    from specdec.train import TrainConfig

    shared = ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "context", "batch_size", "steps", "lr", "warmup",
              "weight_decay", "holdout", "eval_every", "save_every", "seed")
    trained, distilled = TrainConfig(files=[], output=""), DistillConfig(target="", output="")
    for name in shared:
        value, other = getattr(trained, name), getattr(distilled, name)
        kind = float if isinstance(other, float) else int
        tr.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=f"default {value} (distilling: {other})")
    for name in ("vocab_size", "seq_len"):
        tr.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(trained, name), help=f"default {getattr(trained, name)} (not distilling)")
    distill = tr.add_argument_group("distilling (--distill-from)")
    for name, help_text in (("draft_vocab", "target tokens the draft predicts (the others get q = 0)"),
                            ("corpus_tokens", "corpus tokens read"), ("prompts", "corpus windows the target continues"),
                            ("short_prompts", "short windows (8-48 tokens at line starts) it continues"),
                            ("prompt_tokens", "tokens per window"), ("new_tokens", "tokens per continuation"),
                            ("temperature", "of the sampled half of the continuations"), ("soft_top", "soft labels per token"),
                            ("generate_batch", "continuations decoded side by side")):
        value = getattr(distilled, name)
        distill.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=f"{help_text} (default {value})")
    distill.add_argument("--threads", type=_positive, help="CPU threads of the target and of training (default: torch's / llama.cpp's)")
    distill.add_argument("--backend", choices=BACKENDS, default="auto", help="run the target on this backend (default: by its path)")
    distill.add_argument("--no-gguf", action="store_true", help="skip writing OUTPUT/draft.gguf")
    tr.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model trains")
    tr.add_argument("--bf16", action="store_true", help="bfloat16 autocast for matmuls (weights stay float32)")
    tr.add_argument("--save-dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="not distilling")
    tr.set_defaults(run=run_train)

    losslessness.add_parser(commands)  # `specdec verify`

    prof = commands.add_parser("profile", help="measure (or show the cached) forward costs the auto policy decides with",
                               description="Time one forward of k new tokens for the target (and the draft model), k = 1 ... 128, "
                                           "plus the engine's own time per iteration; cached per model, backend, threads and device.")
    add_model_arguments(prof)
    prof.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    prof.add_argument("--plot", metavar="FILE.png", help="also draw the cost curves")
    prof.add_argument("--json", action="store_true", help="print the profile as JSON")
    prof.add_argument("--breakdown", action="store_true",
                      help="GGUF: also time the target's forwards per kind of op (output layer, matmuls, attention, other) "
                           "at k = 1, 4, 8, 16 (specdec/runtime/op_times.py)")
    prof.set_defaults(run=run_profile)

    serve = commands.add_parser("serve", help="serve the models over an OpenAI-compatible HTTP API",
                                description="POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, /health, "
                                            "/metrics. Continuous batching: up to --max-batch generations advance together, one target "
                                            "forward per step; the others wait in a bounded FIFO queue.")
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", help="the model id clients send (default: the target directory's name)")
    serve.add_argument("--max-queue", type=_positive, default=64, help="requests that may wait; more get 429 (default 64)")
    serve.add_argument("--max-batch", type=_positive, default=None,
                       help=f"generations that run together (default {DEFAULT_BATCH['cpu']} on a CPU, {DEFAULT_BATCH['gpu']} on a GPU)")
    serve.add_argument("--batch-depth", choices=["measured", "fixed"], default="measured",
                       help="with a numeric --gamma: measured (default) caps the draft depth of each step for the batch size, from "
                            "measured forward costs and the acceptance so far (no drafting when it does not pay); fixed: always --gamma. "
                            "(--gamma auto, the default, sizes every row's draft for the batch itself.)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, how long running generations may finish before they end with an error (default 10)")
    serve.add_argument("--api-key", action="extend", nargs="+", default=[], metavar="KEY",
                       help="require `Authorization: Bearer KEY` on /v1 routes and /metrics; repeat for several tenants, each "
                            "with caches and histories of its own (also $SPECDEC_API_KEY; default: none, one tenant)")
    serve.add_argument("--api-key-file", metavar="FILE", help="API keys, one per line (# comments and blank lines ignored), as --api-key")
    serve.add_argument("--keys-share-caches", action="store_true",
                       help="all API keys share one scope: a request may reuse the prefix cache and history of any key's requests "
                            "(faster where tenants send the same prompts, but cached_tokens and timing then tell one key what another sent)")
    serve.add_argument("--public-metrics", action="store_true", help="/metrics needs no API key")
    serve.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                       help="browser origins allowed by CORS, e.g. http://localhost:3000 (default: none)")
    serve.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template for models without one (or to replace theirs)")
    serve.add_argument("--max-connections", type=_positive, default=256, help="open connections at most; more get 503 (default 256)")
    serve.add_argument("--history-tokens", type=int, default=None, metavar="N",
                       help="the default drafter also drafts from earlier requests' prompts and outputs, N tokens kept per tenant "
                            f"(a request's `user`; default {DEFAULT_TOKENS:,}; 0 = off)")
    serve.add_argument("--share-history", action="store_true",
                       help="every request drafts from every tenant's history (faster where tenants repeat each other, but a "
                            "request's speed then tells something of other tenants' requests)")
    serve.add_argument("--prefix-cache-tokens", type=int, default=SERVER_PREFIX_TOKENS, metavar="N",
                       help="finished requests keep up to N tokens of their caches, and a new request starts from the longest "
                            "prefix it shares with them: a conversation's next turn or a shared system prompt is not computed "
                            f"again (default {SERVER_PREFIX_TOKENS:,}; on llama.cpp that many KV cells more; 0 = off)")
    serve.add_argument("--replicas", type=_positive, default=None, metavar="N",
                       help="run N replicas as a Ray Serve application on a local Ray instance (pip install -e \".[ray]\"); "
                            "each loads the models and takes --threads cores of its own (default: the cores / N)")
    serve.add_argument("--max-replicas", type=_positive, default=None, metavar="N",
                       help="with --replicas: autoscale between --replicas and N replicas on ongoing requests")
    serve.set_defaults(run=run_serve)
    return parser


def run_generate(args) -> None:
    prediction = None
    if args.prediction is not None:
        try:
            prediction = Path(args.prediction).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise SpecDecError(f"cannot read the prediction file {args.prediction}: {error}") from None
    decoder = load_decoder(args)
    stream = decoder.stream(
        args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop, prediction=prediction or None,
    )
    if args.json:
        for _ in stream:
            pass
        print(json.dumps(stream.result.to_dict()))
        return
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(format_stats(stream.result.stats, decoder), file=sys.stderr)


def run_profile(args) -> None:
    decoder = load_decoder(args, measure=False)
    profile = costs.profile(decoder.target, decoder.draft_model, refresh=args.refresh)
    if args.json:
        print(json.dumps(profile.to_json()))
    else:
        print(format_profile(profile, decoder, costs.cache_dir()))
    if args.plot:
        print(f"wrote {plot_profile(profile, args.plot)}", file=sys.stderr)
    if args.breakdown:
        if decoder.target.backend != "llamacpp":
            raise SpecDecError("--breakdown times llama.cpp's ops: it takes a GGUF target")
        from specdec.runtime.op_times import breakdown, format_breakdown

        note = decoder.target.output_layer_note
        print(f"\nwhere the target's forward goes (output layer: {decoder.target.output_layer}{f'; {note}' if note else ''}):\n")
        print(format_breakdown(breakdown(decoder.target)))


def format_profile(profile, decoder, cache) -> str:
    """The cost curves as a table: milliseconds and the ratio to a one-token forward."""
    load = f", load {profile.load:.2f}" if profile.load is not None else ""
    lines = [f"target: {decoder.target.describe()}" + (f" · draft: {decoder.draft_model.describe()}" if decoder.draft_model else ""),
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
    parts = [f"{stats.generated_tokens} tokens", f"{stats.total_seconds:.2f} s", f"{stats.tokens_per_second or 0:.1f} tok/s"]
    parts.append(f"{stats.target_forwards} target forwards")
    if decoder.drafter is not None:
        rate = stats.acceptance_rate
        parts += [
            f"drafter {decoder.drafter.name}, " + (f"depth {decoder.gamma}" if getattr(decoder.drafter, "tree", None) else f"gamma {decoder.gamma}"),
            f"{stats.draft_forwards} draft forwards",
            f"acceptance {rate:.1%}" if rate is not None else "acceptance n/a",
        ]
    if stats.tree_nodes and (getattr(decoder.drafter, "tree", None) or stats.drafters):
        parts.append(f"{sum(stats.tree_nodes) / len(stats.tree_nodes):.1f} draft nodes/iteration")
    if stats.drafters and decoder.gamma == "auto":
        counts = collections.Counter(stats.drafters)
        parts.append("drafted by " + ", ".join(f"{name} {count / len(stats.drafters):.0%}" for name, count in counts.most_common()))
    if stats.source_trials:
        parts.append("accepted by source " + ", ".join(f"{source} {accepted}/{tried}" for source, (tried, accepted) in sorted(stats.source_trials.items())))
    parts.append(f"{stats.tokens_per_target_forward or 0:.2f} tokens/target forward")
    return "[specdec] " + " · ".join(parts)


def run_ngram_build(args) -> None:
    from transformers import AutoTokenizer

    from specdec.ngram import build_from_files
    from specdec.runtime import tokenizer_fingerprint

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True, trust_remote_code=False)
    except Exception as error:
        raise SpecDecError(f"could not load a tokenizer from {args.tokenizer}: {error}") from error
    model = build_from_files(args.files, tokenizer, fingerprint=tokenizer_fingerprint(tokenizer))
    model.save(args.output)
    print(f"wrote {args.output} (vocabulary {model.vocab_size})", file=sys.stderr)


def run_bench_command(args) -> None:
    from specdec.bench import BenchConfig, run_bench
    from specdec.bench.report import markdown, write_report
    from specdec.bench.suites import SUITES

    suites = tuple(SUITES) if args.suite == ["all"] else tuple(args.suite) if args.suite else None
    given = dict(target=args.target, draft=args.draft, ngram=args.ngram, prompts=args.prompts, limit=args.limit, suites=suites, rounds=args.rounds,
                 max_new_tokens=args.max_new_tokens, modes=("greedy", "sampled") if args.mode == "both" else (args.mode,),
                 temperature=args.temperature, top_k=args.top_k, tree_width=args.tree_width, staged_gamma=args.staged_gamma,
                 staged_tree=args.staged_tree, peers=not args.no_peers, seed=args.seed, device=args.device, dtype=args.dtype,
                 gammas=_numbers(args.gammas, "--gammas") if args.gammas is not None else None,
                 trees=_trees(args.trees) if args.trees is not None else None, **runtime_options(args))
    config = BenchConfig.quick(**given) if args.quick else BenchConfig(**{k: v for k, v in given.items() if v is not None})
    numbers = [*config.gammas, *(n for t in config.trees for n in t), config.tree_width, config.staged_gamma, config.staged_tree, config.max_new_tokens]
    if any(n < 1 for n in numbers):
        raise SpecDecError("γ values, tree sizes and --max-new-tokens must be >= 1")
    data = run_bench(config)
    paths = write_report(data, args.out)
    print(markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    if data["load"]["warning"]:
        print(f"specdec bench: warning: {data['load']['warning']}", file=sys.stderr)


def _numbers(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(g) for g in text.split(","))
    except ValueError:
        raise SpecDecError(f"{option} must be comma-separated integers, got {text!r}") from None


def _trees(text: str) -> tuple[tuple[int, int], ...]:
    try:
        trees = tuple(tuple(int(n) for n in t.split("x")) for t in text.split(",") if t)
    except ValueError:
        trees = ((0,),)
    if any(len(t) != 2 for t in trees):
        raise SpecDecError(f"--trees must be NODESxDEPTH values separated by commas, got {text!r}")
    return trees


def run_train(args) -> None:
    from dataclasses import fields

    from specdec.distill import DistillConfig, distill
    from specdec.train import TrainConfig, train

    given = {name: value for name, value in vars(args).items() if value is not None}
    if args.distill_from is None:
        config = TrainConfig(**{f.name: given[f.name] for f in fields(TrainConfig) if f.name in given})
        state = train(config)
        loss = state.history[-1]["heldout_loss"] if state.history else float("nan")
        print(f"wrote {config.output}: {state.step} steps, {state.tokens_seen} tokens, held-out loss {loss:.3f}", file=sys.stderr)
        return
    if args.tokenizer or args.save_dtype != "float32":
        raise SpecDecError("--tokenizer and --save-dtype do not apply to --distill-from: the draft uses the target's tokens, in float32")
    if args.threads:
        torch_threads(args.threads)
    config = DistillConfig(target=args.distill_from, gguf=not args.no_gguf,
                           **{f.name: given[f.name] for f in fields(DistillConfig) if f.name in given and f.name not in ("target", "gguf")})
    report = distill(config)
    print(f"wrote {config.output}: a draft of {report['parameters']:,} parameters predicting {report['vocabulary']['draft']} of "
          f"{report['vocabulary']['target']} tokens ({report['vocabulary']['generated_tokens_covered']:.1%} of the target's generated "
          f"tokens); held-out agreement with the target's greedy choice {report['heldout_agreement']:.3f}; "
          f"{report['total_seconds'] / 60:.1f} min, peak {report['peak_rss_mb']} MB", file=sys.stderr)


def torch_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)


DEFAULT_BATCH = {"cpu": 16, "gpu": 64}
SERVER_PREFIX_TOKENS = 16_384


def run_serve(args) -> None:
    if args.replicas is not None:
        try:
            from specdec.server.replicas import run_local
        except ImportError as error:
            raise SpecDecError(f"--replicas runs Ray Serve, which is not installed ({error}): pip install -e \".[ray]\"") from None
        return run_local(args)
    if args.max_replicas is not None:
        raise SpecDecError("--max-replicas autoscales Ray Serve replicas: give --replicas too")
    from specdec.server import routes, serve

    service, http = server_service(args)
    app = routes(service, **http)
    decoder = service.decoder
    print(f"specdec: serving {service.model_name!r} on http://{args.host}:{args.port}/v1 (drafter: "
          f"{decoder.drafter.name if decoder.drafter else 'none'}, up to {service.batcher.max_batch} generations at once)", file=sys.stderr)
    try:
        serve(app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout, max_connections=args.max_connections)
    except SystemExit as error:  # uvicorn logs why it could not start (a port in use, say), then exits
        if error.code:
            raise SpecDecError(f"the server could not start on {args.host}:{args.port} (see the message above)") from None


def check_serve_arguments(args) -> None:
    """What `specdec serve` refuses before it loads anything."""
    if not 0 <= args.shutdown_timeout <= 3600:
        raise SpecDecError("--shutdown-timeout must be between 0 and 3600 seconds")
    if args.prefix_cache_tokens < 0:
        raise SpecDecError("--prefix-cache-tokens must be >= 0")
    if args.history_tokens is not None and args.history_tokens < 0:
        raise SpecDecError("--history-tokens must be >= 0")
    api_keys(args)  # a key file that cannot be read fails here, before any model loads


def server_service(args, measure: bool = True):
    """The Service `specdec serve`'s arguments describe (models loaded, batch thread started), and
    the keywords of its routes (`specdec.server.routes`). With `measure`, forward costs the auto
    policy needs are timed now if they are not cached yet."""
    from specdec.server import Service

    check_serve_arguments(args)
    template = _read_template(args.chat_template) if args.chat_template else None
    # llama.cpp sizes its KV cells by the batch at load; a transformers model is on a GPU once loaded
    max_batch = args.max_batch or DEFAULT_BATCH["gpu" if args.gpu_layers else "cpu"]
    decoder = load_decoder(args, slots=max_batch, measure=measure, prefix_cache=args.prefix_cache_tokens)
    if args.max_batch is None and decoder.target.backend == "transformers" and str(decoder.target.device).startswith("cuda"):
        max_batch = DEFAULT_BATCH["gpu"]
    _check_sequence_ids(decoder, max_batch)
    if template is not None:
        decoder.tokenizer.chat_template = template
    decoder.history = _server_history(decoder, args.history_tokens, args.share_history)
    name = args.model_name or os.path.basename(os.path.normpath(decoder.target.path))
    loopback = args.host in ("127.0.0.1", "localhost", "::1")  # then only loopback Host headers: no DNS rebinding
    service = Service(decoder, name, max_queue=args.max_queue, max_batch=max_batch, depth="measure" if args.batch_depth == "measured" else None)
    return service, dict(api_keys=api_keys(args), allowed_origins=args.allowed_origins, keys_share_caches=args.keys_share_caches,
                         public_metrics=args.public_metrics, allowed_hosts=["127.0.0.1", "localhost", "::1"] if loopback else None)


def api_keys(args) -> list[str]:
    """The server's API keys: --api-key, the lines of --api-key-file, $SPECDEC_API_KEY; each a tenant."""
    keys = list(args.api_key)
    if os.environ.get("SPECDEC_API_KEY"):
        keys.append(os.environ["SPECDEC_API_KEY"])
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).expanduser().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise SpecDecError(f"cannot read the API key file {args.api_key_file}: {error}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise SpecDecError(f"the API key file {args.api_key_file} holds no key")
    if any(not (key.isascii() and key.isprintable()) or " " in key for key in keys):
        raise SpecDecError("an API key must be printable ASCII without spaces (it is sent as `Authorization: Bearer KEY`)")
    return list(dict.fromkeys(keys))


def _server_history(decoder, tokens: int | None, shared: bool):
    """The server's history of earlier requests, or None (off, or a fixed strategy, which does not draft from one)."""
    from specdec.drafters import AutoDrafter, History

    if not isinstance(decoder.drafter, AutoDrafter):
        if tokens or shared:
            raise SpecDecError("--history-tokens and --share-history are for the default drafter; this server runs a fixed strategy")
        return None
    return History(tokens if tokens is not None else DEFAULT_TOKENS, shared=shared) if tokens != 0 else None


def _check_sequence_ids(decoder, max_batch: int) -> None:
    """On llama.cpp every running generation takes a sequence id of each model, and every tree branch one more."""
    from specdec.drafters import AutoDrafter, ModelDrafter
    from specdec.runtime.llamacpp import MAX_SEQUENCE_IDS
    from specdec.runtime.prefix import MAX_KEPT

    drafter = decoder.drafter
    tree = drafter.tree if isinstance(drafter, ModelDrafter) else None
    models = [decoder.target] + ([decoder.draft_model] if decoder.draft_model else [])
    per_generation = tree.nodes + 1 if tree is not None else drafter.max_branches + 1 if isinstance(drafter, AutoDrafter) else 1
    kept = MAX_KEPT if decoder.prefixes is not None else 0  # the prefix cache's sequences, on the target
    if any(model.backend == "llamacpp" for model in models) and max_batch * per_generation + kept > MAX_SEQUENCE_IDS:
        what = f"with {tree.nodes}-node trees " if tree is not None else ""
        raise SpecDecError(f"{max_batch} generations {what}need up to {max_batch * per_generation + kept} llama.cpp sequence ids; it has "
                           f"{MAX_SEQUENCE_IDS}: use --max-batch {(MAX_SEQUENCE_IDS - kept) // per_generation} or fewer"
                           + (", or a smaller --tree" if tree is not None else ""))


def _read_template(path: str) -> str:
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as error:
        raise SpecDecError(f"could not read the chat template {path}: {error}") from None
    try:
        import jinja2.sandbox

        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise SpecDecError(f"{path} is not a valid Jinja template: {error}") from None
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except SpecDecError as error:
        print(f"specdec: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`specdec generate ... | head`): not our error
        sys.stdout = open(os.devnull, "w")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
