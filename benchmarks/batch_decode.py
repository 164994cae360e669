"""In-process batched decoding, without the HTTP server: decode-phase tokens/s for B rows stepped together.

    python benchmarks/batch_decode.py --rows 1 4 16 --backend llamacpp transformers

The demo pair, plain decoding (draft depth 0 for every step, as the server's measured policy
chooses on this CPU) and the depth the server would pick (`--depth measured`). Each row is a
HumanEval prompt, greedy, `--tokens` new tokens; prefill is timed apart. Prints one line per setting
with the machine's load average.
"""

from __future__ import annotations

import argparse
import os
import time

import specdec
from specdec.bench.prompts import humaneval_prompts
from specdec.server.service import batch_depth


def decode_rate(decoder, depth, rows: int, tokens: int) -> tuple[float, float]:
    """(decode tokens/s, prefill seconds) for `rows` generations stepped together."""
    engine = decoder.engine()
    generations = [decoder.request(prompt, max_new_tokens=tokens, temperature=0) for prompt in humaneval_prompts()[:rows]]
    started = time.perf_counter()
    for generation in generations:
        generation.open(engine)
    prefilled = time.perf_counter()
    running = list(generations)
    while running:
        cap = depth.depth(len(running)) if depth is not None else 0
        for generation, result in zip(running, engine.step([g.state for g in running], cap)):
            generation.add(result)
            if depth is not None:
                depth.observe(result.drafted, result.accepted)
        for generation in [g for g in running if g.done]:
            engine.close(generation.state)
        running = [g for g in running if not g.done]
    seconds = time.perf_counter() - prefilled
    return sum(len(g.text.tokens) for g in generations) / seconds, prefilled - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--backend", nargs="+", default=["llamacpp", "transformers"])
    parser.add_argument("--depth", nargs="+", choices=["plain", "measured"], default=["plain", "measured"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for backend in args.backend:
        decoder = specdec.load(backend="auto" if backend == "llamacpp" else backend, threads=args.threads, slots=max(args.rows))
        for rows in args.rows:
            for mode in args.depth:
                depth = batch_depth(decoder) if mode == "measured" else None
                decode_rate(decoder, depth, rows, 8)  # warm-up
                rate, prefill = decode_rate(decoder, depth, rows, args.tokens)
                print(f"{backend:12s} rows {rows:3d} {mode:8s} decode {rate:6.0f} tok/s  prefill {prefill:5.2f} s  load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
