"""The default with live costs against the same default with the measured profile only, in one
interleaved `specdec bench` run (plain and prompt lookup γ=8 beside them).

    python benchmarks/live_costs_ab.py --out ab-demo --suite complete edit extract agent
    python benchmarks/live_costs_ab.py --out ab-gemma --target $G --suite edit agent chat
"""

from __future__ import annotations

import argparse

from specdec.decoder import SpeculativeDecoder
from specdec.bench import runner
from specdec.bench.report import write_report
from specdec.bench.runner import BenchConfig, run_bench, specdec_strategy
from specdec.drafters import AutoDrafter, ModelDrafter, PromptLookupDrafter
from specdec.runtime import RuntimeConfig


def strategies(build):
    def built(config):
        target, draft, every = build(config)

        def default(name: str, live: bool):
            decoder = SpeculativeDecoder(target, AutoDrafter(ModelDrafter(draft) if draft is not None else None, PromptLookupDrafter()),
                                         history=None)
            if not live:
                decoder.profile().observe = lambda tokens, seconds: None
            return specdec_strategy(name, "auto", decoder, config.max_new_tokens)

        plain, lookup = (next(s for s in every if s.name == name) for name in ("plain", f"prompt lookup γ={config.lookup_gamma}"))
        return target, draft, [plain, default("default, measured profile only", False), default("default, live costs", True), lookup]

    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default=None)
    parser.add_argument("--suite", nargs="+", default=["complete", "edit", "extract", "agent"])
    parser.add_argument("--mode", default="greedy", choices=["greedy", "sampled"])
    args = parser.parse_args()
    runner.build_strategies = strategies(runner.build_strategies)
    config = BenchConfig.quick(target=args.target, suites=tuple(args.suite), limit=8, rounds=2, max_new_tokens=128, modes=(args.mode,),
                               runtime=RuntimeConfig(threads=1), peers=False, temperature=0.7)
    write_report(run_bench(config), args.out)


if __name__ == "__main__":
    main()
