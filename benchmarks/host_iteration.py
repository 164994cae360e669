"""What an iteration of each strategy costs the host outside its forwards, as a GPU's host pays it: warm.

On the CPU a forward streams the model's weights through the caches, so the host's work after it runs cold:
the text of a step costs 9.5 us alone and about 90 us between two forwards of the demo target. A GPU's host
waits while the device computes and finds its caches as it left them. So each generation is run twice: once
recording every forward of the static pool (its output and its time, keyed by the prompt and what was fed),
then again with each forward replayed from the recording, the host spinning for the recorded time without
touching memory. The host's part is the iteration's time less the spins; aten ops per iteration (a GPU launches
a kernel for most) are counted on a third run. The default's live costs are frozen at the measured profile in
every run (`LiveCosts.observe` does nothing: taking a step in costs about 1 us), so that it decides on a replay
as on the recording. Prompts whose feeds were not recorded are dropped and counted: many of a draft model's
chain, whose catching up runs outside the graphs, for real, and reads cells the replayed forwards never wrote.

    taskset -c 1 python benchmarks/host_iteration.py --suite complete --prompts 6
"""

from __future__ import annotations

import argparse
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
    """The static pool's forwards, recorded and then replayed (`_Graphs.__call__` patched)."""

    def __init__(self):
        self.recording, self.prompt, self.model, self.device_s = True, None, None, 0.0
        self.forwards: dict[tuple, tuple] = {}
        self.real, batch = static._Graphs.__call__, static.StaticHFModel.forward_batch
        tape = self

        def call(graphs, inputs, shape, cache, states=None):
            return tape.forward(graphs, inputs, shape, cache, states)

        def forward_batch(model, feeds):  # the model whose graphs run (a pool that grew has new ones)
            tape.model = model
            return batch(model, feeds)
        static._Graphs.__call__, static.StaticHFModel.forward_batch = call, forward_batch

    def forward(self, graphs, inputs, shape, cache, states):
        """The forward's output: run and recorded, or replayed; its seconds added to `device_s`."""
        rows, bucket, _ = shape
        fed = inputs.numpy()  # tokens, positions, cells [rows * bucket] each, trunks, counts [rows], the tree's bits
        n = rows * bucket
        what = (fed[: 2 * n], fed[3 * n + rows : 3 * n + 2 * rows], fed[3 * n + 2 * rows :])  # not where: cells, trunks
        key = (id(self.model), self.prompt, shape, *(part.tobytes() for part in what))
        started = time.perf_counter()
        if self.recording:
            out = self.real(graphs, inputs, shape, cache, states)
            self.forwards[key] = (tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone(),
                                  time.perf_counter() - started)
        elif key not in self.forwards:
            raise NotRecorded
        else:
            out, seconds = self.forwards[key]
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


def not_counting_prefills(counted: Counted) -> None:
    """A prefill's ops are not an iteration's (its forward is not replayed: it runs eagerly)."""
    prefill = Engine.prefill

    def uncounted(self, *args, **kwargs):
        counted.outside = False
        try:
            return prefill(self, *args, **kwargs)
        finally:
            counted.outside = True
    Engine.prefill = uncounted


def generations(tape: Tape, make, prompts: list[list[int]], new: int, counted: Counted | None = None):
    """Per prompt (host us per iteration, tokens per verify, aten ops per iteration), from a fresh decoder
    (nothing remembered from an earlier pass); None for a prompt the replay could not follow."""
    decoder = make()
    tape.prompt = -1
    try:
        decoder.generate(prompts[0], max_new_tokens=8, temperature=0)  # warm
    except NotRecorded:
        pass  # a policy that decides by time may not follow its recorded warm-up: the prompts may still be
    rows = []
    for tape.prompt, prompt in enumerate(prompts):
        tape.device_s = 0.0
        if counted is not None:
            counted.ops.clear()
        started = time.perf_counter()
        try:
            if counted is not None:
                with counted:
                    result = decoder.generate(prompt, max_new_tokens=new, temperature=0)
            else:
                result = decoder.generate(prompt, max_new_tokens=new, temperature=0)
        except NotRecorded:
            rows.append(None)
            continue
        host = time.perf_counter() - started - result.stats.prefill_seconds - tape.device_s
        iterations = result.stats.iterations
        rows.append((host / iterations * 1e6, len(result.tokens) / result.stats.target_forwards,
                     sum(counted.ops.values()) / iterations if counted is not None else None))
    if decoder.prefixes is not None:  # its kept rows back to the pool: the next decoder's would grow it
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
    tape, counted = Tape(), Counted()
    not_counting_prefills(counted)
    target = gpu.load(gpu.DEMO / "target", "graphs", "float32").target
    draft = load_model(gpu.DEMO / "draft", device="cpu", dtype="float32", compile="graphs")
    prompts = [gpu._ids(target.tokenizer, task) for task, _ in zip(suite_tasks(args.suite), range(args.prompts))]
    print(f"the demo pair, `{args.suite}`, {len(prompts)} prompts x {args.new} tokens, greedy; host us per iteration "
          f"outside the forwards (median over prompts; one line per replay)\n")
    print("| strategy | cold (forwards run) | warm (forwards replayed) | tokens per verify | aten ops per iteration "
          "| prompts followed |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, make in strategies(target, draft).items():
        tape.recording, tape.forwards = True, {}
        cold = generations(tape, make, prompts, args.new)
        tape.recording = False
        warm = [generations(tape, make, prompts, args.new) for _ in range(args.replays)]
        ops = generations(tape, make, prompts, args.new, counted)
        followed = [row for rows in warm for row in rows if row is not None]
        launches = [row[2] for row in ops if row is not None]
        print(f"| {name} | {statistics.median(row[0] for row in cold):.0f} | "
              + " / ".join(f"{statistics.median(row[0] for row in rows if row):.0f}" for rows in warm if any(rows))
              + f" | {statistics.median(row[1] for row in followed):.2f} | "
              + (f"{statistics.median(launches):.0f}" if launches else "-")
              + f" | {len(followed)} of {len(prompts) * args.replays} |", flush=True)


if __name__ == "__main__":
    main()
