"""What an iteration of each strategy costs the host outside its forwards, as a GPU's host pays it: warm.

On the CPU a forward streams the model's weights through the caches, so the host's work after it runs cold: the
text of a step costs 9.5 us alone and about 90 us between two forwards of the demo target. A GPU's host waits while
the device computes and finds its caches as it left them. So each generation is run twice: once recording every
forward of the static pool (its inputs, output and time), then again with each forward replayed from the recording,
the host spinning for the recorded time without touching memory. A forward is replayed by its number in the
generation, its whole inputs checked, and a replay's text is checked against the recording's: a prompt that departs
is dropped and counted. The host's part is the iteration's time less the forwards and the prefill (whose forwards
run for real); a forward outside the graphs after the prefill (the default's draft reading the prompt lazily) runs
for real, timed apart. Aten ops per iteration (a GPU launches a kernel for most) are counted on a third run. The
default's live costs are frozen at the measured profile in every run (`LiveCosts.observe` does nothing: taking a
step in costs about 1 us), so that it decides on a replay as on the recording.

    taskset -c 1 python benchmarks/host_iteration.py --suite complete --prompts 6
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.update(SMALL="1", DEVICE="cpu")  # gpu.py's loaders, on the CPU
os.environ.setdefault("SPECDEC_FUSED", "on")  # the forward a GPU runs
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import gpu  # noqa: E402
from host_step import Counted  # noqa: E402
from specdec import AutoDrafter, ModelDrafter, PromptLookupDrafter, SpeculativeDecoder, costs  # noqa: E402
from specdec.bench.suites import suite_tasks  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.runtime import load_model, static  # noqa: E402


class NotRecorded(Exception):
    """A replay fed what the recording did not."""


class Tape:
    """The static pool's forwards in a generation's iterations, recorded and then replayed (`_Graphs.__call__`
    patched): each forward by its model, prompt and number, its whole inputs checked. A prefill's forwards run
    for real (their time is the prefill's); a forward outside the graphs after it (a draft model's catching
    up) runs for real too, timed apart (`eager_s`)."""

    def __init__(self, counted: Counted):
        self.recording, self.counted, self.in_prefill, self.inside = True, counted, False, False
        self.forwards: dict[tuple, tuple] = {}  # (model, prompt, number) -> (inputs, output, seconds)
        self.texts: dict[int, list[int]] = {}  # prompt -> the recording's tokens
        self.begin(None)
        tape, graphs_call, prefill = self, static._Graphs.__call__, Engine.prefill
        batch, eager = static.StaticHFModel.forward_batch, static.StaticHFModel.step_forward

        def call(graphs, inputs, shape, cache, states=None):
            if tape.in_prefill:
                return graphs_call(graphs, inputs, shape, cache, states)
            tape.inside = True
            try:
                return tape.forward(lambda: graphs_call(graphs, inputs, shape, cache, states), inputs, shape)
            finally:
                tape.inside = False

        def forward_batch(model, feeds):  # the model whose graphs run (a pool that grew has new ones)
            tape.model = model
            return batch(model, feeds)

        def step_forward(model, *args, **kwargs):
            if tape.in_prefill or tape.inside:
                return eager(model, *args, **kwargs)
            started, tape.counted.outside = time.perf_counter(), False
            try:
                return eager(model, *args, **kwargs)
            finally:
                tape.counted.outside, tape.eager_s = True, tape.eager_s + time.perf_counter() - started

        def uncounted_prefill(engine, *args, **kwargs):
            tape.in_prefill, tape.counted.outside = True, False
            try:
                return prefill(engine, *args, **kwargs)
            finally:
                tape.in_prefill, tape.counted.outside = False, True
        static._Graphs.__call__, static.StaticHFModel.forward_batch = call, forward_batch
        static.StaticHFModel.step_forward, Engine.prefill = step_forward, uncounted_prefill

    def begin(self, prompt) -> None:
        """A generation of this prompt starts: its forwards are numbered from 0, its times from nothing."""
        self.prompt, self.model, self.numbers, self.device_s, self.eager_s = prompt, None, {}, 0.0, 0.0

    def forward(self, run, inputs, shape):
        """The forward's output: run and recorded, or replayed while the host spins its recorded time."""
        number = self.numbers[id(self.model)] = self.numbers.get(id(self.model), -1) + 1
        key, fed = (id(self.model), self.prompt, number), (shape, inputs.numpy().tobytes())
        started = time.perf_counter()
        if self.recording:
            out = run()
            self.forwards[key] = (fed, tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone(),
                                  time.perf_counter() - started)
        elif key not in self.forwards or self.forwards[key][0] != fed:
            raise NotRecorded
        else:
            _, out, seconds = self.forwards[key]
            while time.perf_counter() - started < seconds:  # the device's time, spent touching nothing
                pass
        self.device_s += time.perf_counter() - started
        return out


def strategies(target, draft) -> dict:
    """Each strategy's maker: a fresh decoder over the one target (its graphs), remembering nothing."""
    auto = lambda *sources: SpeculativeDecoder(target, AutoDrafter(*sources), "auto")  # noqa: E731
    return {"plain": lambda: SpeculativeDecoder(target, None),
            "prompt lookup γ=4": lambda: SpeculativeDecoder(target, PromptLookupDrafter(), 4),
            "chain γ=4 (draft model)": lambda: SpeculativeDecoder(target, ModelDrafter(draft), 4),
            "default, lookup only": lambda: auto(None, PromptLookupDrafter()),
            "default": lambda: auto(ModelDrafter(draft), PromptLookupDrafter())}


def generations(tape: Tape, make, prompts: list[list[int]], new: int, counting: bool = False):
    """Per prompt (host us per iteration, eager forwards' us per iteration, tokens per verify, aten ops per
    iteration), from a fresh decoder (nothing remembered from an earlier pass); None for a prompt whose replay
    fed what was not recorded or gave another text."""
    decoder = make()
    tape.begin(-1)
    try:
        decoder.generate(prompts[0], max_new_tokens=8, temperature=0)  # warm
    except NotRecorded:
        pass
    rows = []
    for number, prompt in enumerate(prompts):
        tape.begin(number)
        tape.counted.ops.clear()
        started = time.perf_counter()
        try:
            with tape.counted if counting else contextlib.nullcontext():
                result = decoder.generate(prompt, max_new_tokens=new, temperature=0)
        except NotRecorded:
            rows.append(None)
            continue
        if tape.recording:
            tape.texts[number] = result.tokens
        elif result.tokens != tape.texts[number]:
            rows.append(None)
            continue
        host = time.perf_counter() - started - result.stats.prefill_seconds - tape.device_s - tape.eager_s
        iterations = result.stats.iterations
        rows.append((host / iterations * 1e6, tape.eager_s / iterations * 1e6,
                     len(result.tokens) / result.stats.target_forwards,
                     sum(tape.counted.ops.values()) / iterations if counting else None))
    if decoder.prefixes is not None:  # the next decoder reuses nothing of this one's (`PrefixCache.of` shares a cache)
        decoder.prefixes.clear()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="complete")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--replays", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    costs.LiveCosts.observe = costs.LiveCosts.observe_draft = lambda *args: None  # decisions that replay alike
    tape = Tape(Counted())
    target = gpu.load(gpu.DEMO / "target", "graphs", "float32").target
    draft = load_model(gpu.DEMO / "draft", device="cpu", dtype="float32", compile="graphs")
    prompts = [gpu._ids(target.tokenizer, task) for task, _ in zip(suite_tasks(args.suite), range(args.prompts))]
    print(f"the demo pair, `{args.suite}`, {len(prompts)} prompts x {args.new} tokens, greedy; host us per iteration "
          f"outside the forwards (median over prompts; one figure per replay)\n")
    print("| strategy | cold (forwards run) | warm (forwards replayed) | eager forwards, us per iteration "
          "| tokens per verify | aten ops per iteration | prompts followed |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, make in strategies(target, draft).items():
        tape.recording, tape.forwards, tape.texts = True, {}, {}
        cold = generations(tape, make, prompts, args.new)
        tape.recording = False
        warm = [generations(tape, make, prompts, args.new) for _ in range(args.replays)]
        ops = [row[3] for row in generations(tape, make, prompts, args.new, counting=True) if row is not None]
        followed = [row for rows in warm for row in rows if row is not None]
        median = lambda rows, i, form: format(statistics.median(row[i] for row in rows), form) if rows else "-"  # noqa: E731
        cells = [name, median(cold, 0, ".0f"), " / ".join(median([r for r in rows if r], 0, ".0f") for rows in warm),
                 median(followed, 1, ".0f"), median(followed, 2, ".2f"), median([(o,) for o in ops], 0, ".0f"),
                 f"{len(followed)} of {len(prompts) * args.replays}"]
        print("| " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
