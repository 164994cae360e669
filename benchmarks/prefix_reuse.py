"""Prefix reuse on conversations: time to first token per turn, and decoding speed, with and
without the prefix cache (the same loaded models and drafter, conversations interleaved).

Each conversation asks for one standard-library function after another (the chat suite's
material: "Show me a Python function called `name`."); the model's greedy replies stay in the
conversation, so turn k's prompt holds every earlier turn.

    python benchmarks/prefix_reuse.py                          # the demo pair, 8 conversations x 5 turns, 1 thread
    python benchmarks/prefix_reuse.py --target $G --conversations 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdec import SpeculativeDecoder, load
from specdec.bench.runner import machine_description, quartiles
from specdec.bench.suites import _functions


def conversations(count: int, turns: int) -> list[list[str]]:
    names = (node.name for _, node in _functions())
    return [[f"Show me a Python function called `{next(names)}`." for _ in range(turns)] for _ in range(count)]


def talk(decoder: SpeculativeDecoder, asks: list[str], reply_tokens: int) -> list[dict]:
    """One conversation, turn by turn: per turn, seconds to the first text, decoding tokens/s,
    prompt tokens, cached tokens and the reply's token ids."""
    text, turns = "", []
    for ask in asks:
        text += f"User: {ask}\n\nAssistant: "
        started, first = time.perf_counter(), None
        stream = decoder.stream(text, max_new_tokens=reply_tokens, temperature=0)
        for _ in stream:
            first = first or time.perf_counter()
        stats = stream.result.stats
        turns.append({"ttft": (first or time.perf_counter()) - started, "prompt": stats.prompt_tokens, "cached": stats.cached_tokens,
                      "tokens_per_second": stats.generated_tokens / max(1e-9, stats.total_seconds - stats.prefill_seconds),
                      "tokens": stream.result.tokens})
        text += stream.result.text + "\n\n"
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--reply-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    reusing = load(args.target, draft=args.draft, threads=args.threads, prefix_cache=8192)
    reusing.history = None
    fresh = SpeculativeDecoder(reusing.target, reusing.drafter, history=None, prefix_cache=0)
    talk(reusing, ["Show me a Python function called `warm_up`."], 8)  # profile and first-touch costs, not recorded
    reusing.prefixes.clear()
    runs = {"reuse": [], "fresh": []}
    for asks in conversations(args.conversations, args.turns):
        for name, decoder in (("reuse", reusing), ("fresh", fresh)):
            runs[name].append(talk(decoder, asks, args.reply_tokens))
        reusing.prefixes.clear()  # each conversation starts cold
    print(f"{args.conversations} conversations x {args.turns} turns, {args.reply_tokens}-token greedy replies, {args.threads} thread(s), "
          f"{reusing.target.describe()}; {machine_description()['cpu']}")
    same = all(a["tokens"] == b["tokens"] for ra, rb in zip(runs["reuse"], runs["fresh"]) for a, b in zip(ra, rb))
    print("| turn | prompt tokens (median) | cached (median) | time to first token, reuse / fresh (median, IQR) | decode tokens/s, reuse / fresh |")
    print("| --- | --- | --- | --- | --- |")
    for turn in range(args.turns):
        pairs = [(a[turn], b[turn]) for a, b in zip(runs["reuse"], runs["fresh"])]
        ttft = [a["ttft"] / b["ttft"] for a, b in pairs]
        speed = [a["tokens_per_second"] / b["tokens_per_second"] for a, b in pairs]
        spread = quartiles(ttft)
        print(f"| {turn + 1} | {statistics.median(a['prompt'] for a, _ in pairs):.0f} | {statistics.median(a['cached'] for a, _ in pairs):.0f} | "
              f"{statistics.median(ttft):.2f}× ({spread[0]:.2f}–{spread[1]:.2f}) "
              f"[{1e3 * statistics.median(a['ttft'] for a, _ in pairs):.0f} / {1e3 * statistics.median(b['ttft'] for _, b in pairs):.0f} ms] | "
              f"{statistics.median(speed):.2f}× |")
    print("greedy replies identical with and without reuse:", same)


if __name__ == "__main__":
    main()
