"""What the machine's verify curve and the draft's cost allow a chain of draft-model (or head) drafts, by
Leviathan's formula, from a `specdec bench` run's bench.json:

    python benchmarks/chain_bound.py bench-out/bench.json

Per suite and mode, for the run's chain strategy with the largest γ: the acceptance it measured by
position; the best speedup over γ = 1 … 8 of a chain accepted at those rates (a position past the
measured ones at the last rate); and of a perfect drafter (every token accepted) at the same cost per
draft token. The second bounds what any drafter of this cost can reach on this machine, however well
it guesses; the first is what this one's guesses allow. Verify costs are the profile's measured sizes,
interpolated between them.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from specdec.analysis import speedup

GAMMAS = range(1, 9)


def verify_cost(curve: dict[int, float], k: int) -> float:
    sizes = sorted(curve)
    return float(np.interp(k, sizes, [curve[s] for s in sizes]))


def conditional(by_position: list[float]) -> list[float]:
    """The bench's acceptance by position (the share of drafts whose first i + 1 tokens were all accepted)
    as rates given the ones before were accepted."""
    reached = [1.0] + by_position[:-1]
    return [a / r if r else 0.0 for a, r in zip(by_position, reached)]


def chain_tokens(rates: list[float], gamma: int) -> float:
    """Expected tokens of one iteration: 1 + Σ_i Π_{j ≤ i} α_j over the γ positions (α_j: accepted at j
    given the ones before were; past the measured ones, the last)."""
    return 1.0 + float(np.cumprod([rates[min(i, len(rates) - 1)] for i in range(gamma)]).sum())


def best(acceptance: list[float], curve: dict[int, float], draft_step: float) -> tuple[float, int]:
    """(the best speedup, its γ)."""
    return max((speedup(chain_tokens(acceptance, g), g * draft_step, verify_cost(curve, g + 1), curve[1]), g)
               for g in GAMMAS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json")
    args = parser.parse_args()
    bench = json.load(open(args.bench_json))
    curve = {int(k): v for k, v in bench["costs"]["target"].items()}
    draft_step = bench["costs"]["draft"]["1"]
    print(f"target step {curve[1] * 1e3:.1f} ms, draft step {draft_step * 1e3:.1f} ms "
          f"({draft_step / curve[1]:.2f} of a target step); a verify of 5 costs {verify_cost(curve, 5) / curve[1]:.2f} steps")
    print("| suite | mode | chain measured: tokens per verify, acceptance by position | best chain at this acceptance "
          "| a perfect drafter of this cost |")
    print("| --- | --- | --- | --- | --- |")
    for suite, figures in bench["suites"].items():
        for mode, rows in figures["summary"].items():
            chains = [name for name in rows if name.startswith("chain γ=") and name[8:].isdigit()]
            if not chains:
                continue
            row = rows[max(chains, key=lambda name: int(name[8:]))]
            acceptance = row["acceptance_by_position"]
            measured, gamma = best(conditional(acceptance), curve, draft_step)
            perfect, perfect_gamma = best([1.0], curve, draft_step)
            print(f"| {suite} | {mode} | {row['tokens_per_target_forward']:.2f}, "
                  f"{'/'.join(f'{a:.2f}' for a in acceptance)} | {measured:.2f}× (γ={gamma}) "
                  f"| {perfect:.2f}× (γ={perfect_gamma}) |")


if __name__ == "__main__":
    main()
