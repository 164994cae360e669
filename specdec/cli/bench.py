"""`specdec bench`: every strategy and the peers on the same models, interleaved."""

from __future__ import annotations

import sys

from specdec.cli.arguments import add_model_paths, add_runtime_arguments, config_options
from specdec.config import Options, runtime_config
from specdec.errors import SpecDecError


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark strategies and Hugging Face peers on the same models",
                                description="Run plain decoding, chains at several γ, adaptive γ, token trees, "
                                            "staged drafting, prompt lookup, n-gram and Hugging Face "
                                            "generate() (plain, assisted, prompt lookup) prompt by prompt; "
                                            "write JSON, Markdown and PNG plots.")
    add_model_paths(bench)
    bench.add_argument("--suite", nargs="+", default=None, metavar="NAME",
                       help="workload suites: complete (HumanEval, the default), edit, extract, chat, agent, prose, "
                            "or all")
    bench.add_argument("--prompts",
                       help="a prompts file instead of the suites "
                            "(.jsonl with a \"prompt\" field, or one prompt per line)")
    bench.add_argument("--limit", type=int, help="use the first N prompts of each suite (default: all)")
    bench.add_argument("--rounds", type=int, default=None,
                       help="run every prompt this many times, in interleaved rounds (default 1)")
    bench.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (--quick: 64)")
    bench.add_argument("--mode", choices=["greedy", "sampled", "both"], default="both", help="default both")
    bench.add_argument("--temperature", type=float, default=0.8, help="sampled mode (default 0.8)")
    bench.add_argument("--top-k", type=int, default=20, help="sampled mode (default 20)")
    bench.add_argument("--gammas", default=None,
                       help="fixed γ values for the chain strategies (default 1,2,3,4; --quick: 2)")
    bench.add_argument("--trees", default=None,
                       help="NODESxDEPTH of the token-tree strategies; '' for none "
                            "(default 3x2,4x3,8x4; --quick: none)")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke check in a few minutes: 5 prompts, 64 new tokens, plain, the default policy, "
                            "one chain, prompt lookup, peers")
    bench.add_argument("--tree-width", type=int, default=2,
                       help="children per node and nodes expanded per level (default 2)")
    bench.add_argument("--staged-gamma", type=int, default=3, help="depth of the staged strategies (default 3)")
    bench.add_argument("--staged-tree", type=int, default=4, help="nodes of the staged-tree strategies (default 4)")
    bench.add_argument("--no-peers", action="store_true", help="skip Hugging Face generate()")
    bench.add_argument("--seed", type=int, default=0, help="sampled mode's base seed (default 0)")
    add_runtime_arguments(bench)  # checkpoints run on the CPU unless --device says otherwise
    bench.add_argument("--out", default="bench-out", help="output folder (bench.json, bench.md, *.png)")
    bench.set_defaults(run=run_bench_command)


def run_bench_command(args) -> None:
    from specdec.bench import BenchConfig, run_bench
    from specdec.bench.report import markdown, write_report
    from specdec.bench.suites import SUITES

    suites = tuple(SUITES) if args.suite == ["all"] else tuple(args.suite) if args.suite else None
    paths = {name: getattr(args, name, None) for name in ("target", "draft", "ngram")}
    given = dict(**paths, prompts=args.prompts, limit=args.limit, suites=suites, rounds=args.rounds,
                 max_new_tokens=args.max_new_tokens,
                 modes=("greedy", "sampled") if args.mode == "both" else (args.mode,),
                 temperature=args.temperature, top_k=args.top_k, tree_width=args.tree_width,
                 staged_gamma=args.staged_gamma, staged_tree=args.staged_tree, peers=not args.no_peers, seed=args.seed,
                 runtime=runtime_config(Options(config_options(args))),
                 gammas=_numbers(args.gammas, "--gammas") if args.gammas is not None else None,
                 trees=_trees(args.trees) if args.trees is not None else None)
    config = (BenchConfig.quick(**given) if args.quick
              else BenchConfig(**{k: v for k, v in given.items() if v is not None}))
    numbers = [*config.gammas, *(n for t in config.trees for n in t), config.tree_width, config.staged_gamma,
               config.staged_tree, config.max_new_tokens]
    if any(n < 1 for n in numbers):
        raise SpecDecError("γ values, tree sizes and --max-new-tokens must be >= 1")
    data = run_bench(config)
    paths = write_report(data, args.out)
    print(markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    if data["interrupted"]:
        print("specdec bench: interrupted: the report covers the prompts every strategy finished", file=sys.stderr)
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
