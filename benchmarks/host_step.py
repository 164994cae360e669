"""What a plain step costs the host outside its forward on the static pool: what a GPU's host does between two
replays while the device waits (benchmarks/RESULTS.md, "A step's host work"). Measured on the CPU with the GPU
check's rehearsal model (benchmarks/gpu.py's 8B shape, small): the aten ops dispatched per plain iteration with
the captured forward excluded (a dispatch mode counting them), the host time outside that forward, and what
assembling the text costs a step after 1,000 generated tokens. To compare two checkouts, alternate between them:

    taskset -c 1 python benchmarks/host_step.py
    git worktree add ../before <commit> && taskset -c 1 python benchmarks/host_step.py --checkout ../before
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.update(SMALL="1", DEVICE="cpu")  # gpu.py's rehearsal model, on the CPU
# the checkout measured: its gpu.py puts its own root first on the path
CHECKOUT = Path(sys.argv[sys.argv.index("--checkout") + 1]) if "--checkout" in sys.argv else Path(__file__).parents[1]
sys.path.insert(0, str(CHECKOUT.resolve() / "benchmarks"))
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import gpu  # noqa: E402
from specdec.api import SpeculativeDecoder, TextAssembler  # noqa: E402
from specdec.engine import StepResult  # noqa: E402
from specdec.runtime import static  # noqa: E402


class Counted(TorchDispatchMode):
    """aten ops by name, outside the captured forward (`outside` False while it runs)."""

    def __init__(self):
        super().__init__()
        self.ops, self.outside = collections.Counter(), True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.outside:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def excluding_the_forward(counted: Counted, seconds: list[float]):
    """Patch the graphs' runner: the forward they capture is neither counted nor timed as the host's."""
    record = static._Graphs.__call__

    def call(self, *args, **kwargs):
        forward = self.forward

        def captured(*inputs, **options):
            counted.outside, started = False, time.perf_counter()
            try:
                return forward(*inputs, **options)
            finally:
                counted.outside = True
                seconds[0] += time.perf_counter() - started
        self.forward = captured
        try:
            return record(self, *args, **kwargs)
        finally:
            self.forward = forward
    static._Graphs.__call__ = call


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = gpu.shaped_8b()
    pool = static.StaticHFModel(model, tokenizer, "8B-shaped, small", context=1024, backend="graphs", fused=True)
    pool.warm_up(tokens=(1,))
    plain, prompt = SpeculativeDecoder(pool, None), gpu.fresh_prompts(8192, (64,))[0]
    counted, inside = Counted(), [0.0]
    excluding_the_forward(counted, inside)

    def generation(new: int) -> tuple[float, int]:
        """(host seconds outside the forward and prefill, iterations) of one plain generation."""
        inside[0] = 0.0
        started = time.perf_counter()
        result = plain.generate(prompt, max_new_tokens=new, temperature=0)
        elapsed = time.perf_counter() - started
        return elapsed - result.stats.prefill_seconds - inside[0], result.stats.target_forwards

    generation(8)
    with counted:
        counted.ops.clear()
        generation(1)
        short = sum(counted.ops.values())
        counted.ops.clear()
        _, iterations = generation(33)
    per_step = (sum(counted.ops.values()) - short) / (iterations - 1)
    print(f"{specdec_root()}: aten ops per plain iteration outside the forward: {per_step:.1f}")
    for name, count in counted.ops.most_common(12):
        print(f"  {name}: {count / iterations:.2f}")
    host = [seconds / steps * 1e6 for seconds, steps in (generation(64) for _ in range(30))]
    low, _, high = statistics.quantiles(host, n=4)
    print(f"host us per plain iteration outside the forward: median {statistics.median(host):.1f} "
          f"(IQR {low:.1f}-{high:.1f}, 30 generations of 64 tokens)")
    print(f"the text's us per step after 1,000 tokens: {text_cost(tokenizer):.1f} (median of 5 x 250 steps)")


def text_cost(tokenizer) -> float:
    """Median µs of `TextAssembler.add` of one token, over steps 750-999 of a 1,000-token text."""
    ids = tokenizer.encode(Path(__file__).read_text() * 8, add_special_tokens=False)[:1010]
    times = []
    for _ in range(5):
        text = TextAssembler(tokenizer, ids[:10], ["</answer>"])
        for n in range(10, 1010):
            started = time.perf_counter()
            text.add(StepResult([ids[n]]))
            if n >= 760:
                times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def specdec_root() -> str:
    return str(Path(static.__file__).parents[2])


if __name__ == "__main__":
    main()
