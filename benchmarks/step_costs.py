"""What the default's steps cost by what they drafted, in plain steps, and what its probes took against
their credit: plain decoding and the default interleaved (ABBA) on the same prompts and seeds.

    taskset -c 1 python benchmarks/step_costs.py --suite chat --backend transformers
    taskset -c 1 python benchmarks/step_costs.py --suite complete edit --mode greedy
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from dataclasses import replace

from specdec import engine, policy, profiling
from specdec.bench.runner import BenchConfig, build_strategies, sampling_for, suite_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="a GGUF file (default: the demo pair)")
    parser.add_argument("--suite", nargs="+", default=["chat"])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--mode", choices=["greedy", "sampled"], default="sampled")
    parser.add_argument("--backend", choices=["auto", "transformers", "llamacpp"], default="auto")
    args = parser.parse_args()
    config = BenchConfig.quick(target=args.target, suites=tuple(args.suite), limit=args.limit, max_new_tokens=96,
                               temperature=0.7, top_k=0, peers=False)
    config = replace(config, runtime=replace(config.runtime, threads=1, backend=args.backend))
    target, draft, every = build_strategies(config)
    plain, default = (next(s for s in every if s.name == name) for name in ("plain", "default (auto)"))
    prompts, sampling = suite_prompts(config, target), sampling_for(args.mode, config)
    profiling.profile(target, draft)
    for strategy in (plain, default):  # warm-up
        strategy.run(next(iter(prompts.values()))[0][0][-16:], sampling, 0)

    probed, who = [False], [""]
    steps = collections.defaultdict(list)  # strategy -> (seconds, what drafted, nodes, accepted, probed, charged)
    for name in ("probe_model", "probe_tokens"):  # a probe made this step (each asked once per step at most)
        asked = getattr(policy.CostAwarePolicy, name)

        def noted(self, *args, __asked=asked):
            made = __asked(self, *args)
            probed[0] |= bool(made)
            return made

        setattr(policy.CostAwarePolicy, name, noted)
    step = engine.Engine.step

    def timed_step(self, states, gamma_cap=None):
        state, probed[0] = states[0], False
        credit = getattr(state.gamma_policy, "credit", 0.0)
        started = time.perf_counter()
        results = step(self, states, gamma_cap)
        seconds, stats = time.perf_counter() - started, state.stats
        charged = credit - getattr(state.gamma_policy, "credit", 0.0)  # less this step's accrual: see below
        steps[who[0]].append((seconds, stats.drafters[-1] if stats.drafters else "plain", stats.tree_nodes[-1],
                              results[0].accepted, probed[0], charged))
        return results

    engine.Engine.step = timed_step
    for suite, tasks in prompts.items():
        for repeat in range(args.repeats):
            for i, (ids, reference, answer) in enumerate(tasks):
                for strategy in (plain, default) if (repeat + i) % 2 == 0 else (default, plain):
                    who[0] = strategy.name
                    strategy.run(ids, sampling, i + 100 * repeat, reference, answer)
    report(steps[plain.name], steps[default.name])


def report(plain: list[tuple], default: list[tuple]) -> None:
    unit = statistics.median(seconds for seconds, *_ in plain)
    print(f"a plain step: median {unit * 1e3:.2f} ms; the default's steps, in plain steps:")
    kinds = collections.defaultdict(list)
    for seconds, drafted, nodes, accepted, *_ in default:
        kinds[drafted, nodes].append((seconds / unit, accepted))
    for (drafted, nodes), rows in sorted(kinds.items(), key=lambda item: -len(item[1]))[:12]:
        cost, accepted = statistics.mean(c for c, _ in rows), statistics.mean(a for _, a in rows)
        print(f"  {drafted:14} {nodes:2} nodes: {len(rows):5} steps, mean {cost:.2f} (median "
              f"{statistics.median(c for c, _ in rows):.2f}), {accepted:.2f} accepted: {(1 + accepted) / cost:.2f} "
              "tokens per plain step's time")
    total, probes = sum(row[0] for row in default), [row for row in default if row[4]]
    taken = sum(seconds - unit for seconds, *_ in probes)
    # the credit falls by what a probe is charged and rises by each step's accrual: the charge is the fall
    # plus the accrual, which is the median rise over steps without a probe
    accrual = -statistics.median(row[5] for row in default if not row[4])
    charged = sum(row[5] + accrual for row in probes)
    print(f"probes: {len(probes)} steps of {len(default)}, charged {charged / total:.2%} of the default's step time, "
          f"took {taken / total:.2%} beyond a plain step each")


if __name__ == "__main__":
    main()
