"""What the default's steps cost by what they drafted, in plain steps, and what its probes took against
their credit: plain decoding and the default interleaved (ABBA) on the same prompts and seeds.

    taskset -c 1 python benchmarks/step_costs.py --suite chat --backend transformers
    taskset -c 1 python benchmarks/step_costs.py --suite complete edit --mode greedy
"""

from __future__ import annotations

import collections
import statistics
import time

from nothing_drafted import a_b_arguments, a_b_pairs, plain_and_default
from specdec import engine, policy


def main() -> None:
    args = a_b_arguments(__doc__.splitlines()[0], ["chat"], 4).parse_args()
    _, plain, default, prompts, sampling = plain_and_default(args)

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
    for _ in a_b_pairs(prompts, sampling, plain, default, args.repeats, who):
        pass
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
