"""What each decoding step costs, step by step, on one task: plain decoding, and the default where
nothing pays but probes: lookup alone (its probes), and the draft model probed on the schedule
without the probes' credit (8, 16, 32, ... iterations). Shows the steps' warm-up after the
prefill, what a probe costs, and the slower plain steps after it.

    python benchmarks/step_times.py                     # the demo pair (GGUF), the first extract task
    python benchmarks/step_times.py --target T.gguf --draft D.gguf --suite agent
"""

from __future__ import annotations

import argparse
import statistics
import time

import specdec
from specdec import costs
from specdec.demo import demo_gguf
from specdec.bench.suites import suite_tasks
from specdec.drafters import AutoDrafter, ModelDrafter, PromptLookupDrafter
from specdec.engine import Engine
from specdec.policy import CostAwarePolicy

# a profile under which nothing but a probe ever pays: every step is plain but the probes'
NEVER_PAYS = costs.Profile(target={1: 1.0, 2: 100.0, 128: 12800.0}, draft={1: 100.0})


def frozen(decoder: specdec.SpeculativeDecoder) -> specdec.SpeculativeDecoder:
    decoder._profile = costs.LiveCosts.of(NEVER_PAYS)
    decoder._profile.observe = lambda tokens, seconds: None
    return decoder


def step_times(decoder: specdec.SpeculativeDecoder, ids: list[int], new: int) -> list[tuple[str, float]]:
    """(what the step drafted, seconds) per step of one generation."""
    times, step = [], Engine.step

    def timed(engine, states, gamma_cap=None):
        started = time.perf_counter()
        out = step(engine, states, gamma_cap)
        times.append((states[0].stats.drafters[-1] if states[0].stats.drafters else "none", time.perf_counter() - started))
        return out

    Engine.step = timed
    try:
        decoder.generate(ids, max_new_tokens=new, temperature=0)
    finally:
        Engine.step = step
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the demo pair's target (specdec.demo.demo_gguf)")
    parser.add_argument("--draft", help="default: the demo pair's draft")
    parser.add_argument("--suite", default="extract")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    target = specdec.load_model(args.target or demo_gguf("target"), threads=1)
    draft = specdec.load_model(args.draft or demo_gguf("draft"), threads=1)
    ids = target.tokenizer.encode(next(iter(suite_tasks(args.suite))).text)
    CostAwarePolicy._affords = lambda policy, probe, cost, spend=True: True  # the probes' own schedule: under NEVER_PAYS the credit would forbid them
    decoders = {
        "plain": specdec.SpeculativeDecoder(target),
        "default, lookup only, never pays": frozen(specdec.SpeculativeDecoder(target, AutoDrafter(None, PromptLookupDrafter()), history=None)),
        "default, draft model probed (8, 16, 32, ...)": frozen(specdec.SpeculativeDecoder(target, AutoDrafter(ModelDrafter(draft), PromptLookupDrafter()),
                                                                              history=None, explore=False)),
    }
    medians = {name: [] for name in decoders}
    for _ in range(args.repeats):  # interleaved
        for name, decoder in decoders.items():
            steps = step_times(decoder, ids, args.new)
            medians[name].append(sum(t for _, t in steps) / len(steps))
    for name, values in medians.items():
        print(f"{name}: {1e3 * statistics.median(values):.2f} ms a step (median of {args.repeats} generations)")
    steps = step_times(decoders["default, draft model probed (8, 16, 32, ...)"], ids, args.new)
    print("steps of the last (ms, * = a probe):", " ".join(f"{1e3 * t:.1f}{'*' if label != 'none' else ''}" for label, t in steps))


if __name__ == "__main__":
    main()
