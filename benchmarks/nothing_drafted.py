"""Plain decoding against the default alone, where the default seldom drafts (sampled, on llama.cpp's CPU
kernels): an ABBA A/B of the two on the same prompts and seeds, the order alternating, what a generation
spends in its steps and outside them, and where each step's host time goes (the engine's phases and the
policy's and drafter's calls, timed in place).

    taskset -c 1 python benchmarks/nothing_drafted.py --suite prose extract --repeats 6
    taskset -c 1 python benchmarks/nothing_drafted.py --suite complete edit extract chat agent prose --repeats 4 --bare
    taskset -c 1 python benchmarks/nothing_drafted.py --suite agent --target $G --mode greedy
    taskset -c 1 python benchmarks/nothing_drafted.py --suite chat agent --backend transformers
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import random
import statistics
import time
from dataclasses import replace

from specdec import costs, engine, policy, profiling
from specdec.bench.runner import BenchConfig, build_strategies, sampling_for, suite_prompts
from specdec.drafters import auto

# (owner, attribute): what is timed, per step
TIMED = [(engine.Engine, "step"), (engine.Engine, "_gamma"), (engine.Engine, "_drafts"), (engine.Engine, "_advance"),
         (engine, "_verify"), (policy.CostAwarePolicy, "depth"), (policy.CostAwarePolicy, "update"),
         (costs.LiveCosts, "observe"), (auto.AutoDrafter, "propose"), (auto.AutoDrafter, "accept")]


def timing(seconds: dict, calls: collections.Counter, who: list[str], callables: list) -> None:
    """Wrap each (owner, attribute) callable: seconds and calls by (strategy, name)."""
    for owner, name in callables:
        function = getattr(owner, name)

        def timed(*args, __function=function, __name=name, **kwargs):
            started = time.perf_counter()
            try:
                return __function(*args, **kwargs)
            finally:
                seconds[who[0], __name] += time.perf_counter() - started
                calls[who[0], __name] += 1

        setattr(owner, name, functools.wraps(function)(timed))


def step_host_time(host: collections.defaultdict, who: list[str], forward_owner) -> None:
    """Wrap `Engine.step` and the models' forwards: each step's time less its forwards', by strategy."""
    step, forward, in_forwards = engine.Engine.step, forward_owner.forward_batch, [0.0]

    def timed_forward(*args, **kwargs):
        started = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            in_forwards[0] += time.perf_counter() - started

    def timed_step(*args, **kwargs):
        in_forwards[0], started = 0.0, time.perf_counter()
        results = step(*args, **kwargs)
        host[who[0]].append(time.perf_counter() - started - in_forwards[0])
        return results

    engine.Engine.step, forward_owner.forward_batch = timed_step, timed_forward


def a_b_arguments(description: str, suites: list[str], repeats: int) -> argparse.ArgumentParser:
    """The options of an A/B of plain decoding against the default (`plain_and_default`, `a_b_pairs`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", default=None, help="a GGUF file (default: the demo pair)")
    parser.add_argument("--suite", nargs="+", default=suites)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--mode", choices=["greedy", "sampled"], default="sampled")
    parser.add_argument("--backend", choices=["auto", "transformers", "llamacpp"], default="auto")
    return parser


def plain_and_default(args):
    """The target, the plain and default strategies over it (profiled, each run once), the suites' prompts
    and the sampling: (target, plain, default, prompts, sampling)."""
    config = BenchConfig.quick(target=args.target, suites=tuple(args.suite), limit=args.limit, max_new_tokens=96,
                               temperature=0.7, top_k=0, peers=False)
    config = replace(config, runtime=replace(config.runtime, threads=1, backend=args.backend))
    target, draft, every = build_strategies(config)
    plain, default = (next(s for s in every if s.name == name) for name in ("plain", "default (auto)"))
    prompts, sampling = suite_prompts(config, target), sampling_for(args.mode, config)
    profiling.profile(target, draft)
    for strategy in (plain, default):  # warm-up
        strategy.run(next(iter(prompts.values()))[0][0][-16:], sampling, 0)
    return target, plain, default, prompts, sampling


def a_b_pairs(prompts: dict, sampling, plain, default, repeats: int, who: list[str]):
    """Each suite's prompts `repeats` times, plain and the default on the same prompt and seed, the order
    alternating (ABBA); yields (suite, {strategy name: run}). who[0]: the strategy running."""
    for suite, tasks in prompts.items():
        for repeat in range(repeats):
            for i, (ids, reference, answer) in enumerate(tasks):
                runs = {}
                for strategy in (plain, default) if (repeat + i) % 2 == 0 else (default, plain):
                    who[0] = strategy.name
                    runs[strategy.name] = strategy.run(ids, sampling, i + 100 * repeat, reference, answer)
                yield suite, runs


def main() -> None:
    parser = a_b_arguments(__doc__.splitlines()[0], ["prose", "extract"], 6)
    parser.add_argument("--bare", action="store_true",
                        help="time the steps and the target's forwards only: no timer inside a step's host work")
    args = parser.parse_args()
    target, plain, default, prompts, sampling = plain_and_default(args)
    seconds, calls, who = collections.defaultdict(float), collections.Counter(), [""]
    forwards, host = (type(target), "forward_batch"), collections.defaultdict(list)  # prefill chunks too: see below
    timing(seconds, calls, who, [(engine.Engine, "step"), forwards] if args.bare else [*TIMED, forwards])
    step_host_time(host, who, type(target))
    for suite, pairs in itertools.groupby(a_b_pairs(prompts, sampling, plain, default, args.repeats, who),
                                          key=lambda pair: pair[0]):
        ratios, same, drafters, trials = [], 0, collections.Counter(), collections.defaultdict(lambda: [0, 0])
        for _, runs in pairs:
            for name, run in runs.items():
                seconds[name, "generation"] += run.stats.total_seconds
                seconds[name, "prefill"] += run.stats.prefill_seconds
                calls[name, "generation"] += 1
            a, b = runs[plain.name], runs[default.name]
            same += a.tokens == b.tokens
            drafters.update(b.stats.drafters)
            for source, (reached, accepted) in b.stats.source_trials.items():
                trials[source][0] += reached
                trials[source][1] += accepted
            ratios.append((a.stats.total_seconds / len(a.tokens)) / (b.stats.total_seconds / len(b.tokens)))
        medians = sorted(statistics.median(random.choices(ratios, k=len(ratios))) for _ in range(2000))
        print(f"{suite}, {args.mode}: the default against plain, median {statistics.median(ratios):.3f} (95% "
              f"interval {medians[50]:.3f}-{medians[1949]:.3f}), {len(ratios)} pairs, {same} with the same text")
        steps = sum(drafters.values())
        print("  the default's steps by drafter: "
              + ", ".join(f"{name} {n / steps:.1%}" for name, n in drafters.most_common())
              + "; accepted/reached by source: " + ", ".join(f"{source} {a}/{r}" for source, (r, a) in trials.items()))
    for strategy in (plain.name, default.name):  # what a generation spends outside its steps: setup, finishing
        count = calls[strategy, "generation"]
        print(f"{strategy}: {seconds[strategy, 'generation'] / count * 1e3:.1f} ms a generation, "
              f"{seconds[strategy, 'step'] / count * 1e3:.1f} in its steps")
    print("host time per step (us), every suite together:")
    for strategy in (plain.name, default.name):  # the steps less the models' forwards in them (not the prefill's)
        mean = (seconds[strategy, "step"] - seconds[strategy, "forward_batch"] + seconds[strategy, "prefill"]) / \
            calls[strategy, "step"]
        print(f"  {strategy}: {mean * 1e6:.1f} in all, a step's median {statistics.median(host[strategy]) * 1e6:.1f}")
    for name in sorted({name for _, name in seconds} - {"generation", "prefill"}):
        cells = [f"{strategy}: {seconds[strategy, name] / calls[strategy, 'step'] * 1e6:7.1f}"
                 for strategy in (plain.name, default.name) if calls[strategy, name]]
        print(f"  {name:10} " + "   ".join(cells))


if __name__ == "__main__":
    main()
