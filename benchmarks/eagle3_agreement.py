"""Offline agreement of a draft head with its target on the bench suites' prompts: the target's states at
every position observed (as after a prefill), how often the head's most likely next token is the target's.

    python benchmarks/eagle3_agreement.py --target $G --draft gemma-eagle3 --suite complete prose --limit 3

Depth 1 only (each position's first draft token, the text before it given); the bench's tokens per verify
measure the deeper ones as drafting meets them.
"""

from __future__ import annotations

import argparse

import torch

import specdec
from specdec.bench.suites import suite_tasks
from specdec.runtime import load_draft


def agreement(target, draft, ids: list[int]) -> tuple[int, int]:
    """(positions where the head's argmax is the target's, positions) over one text."""
    target.keep_states(layers=draft.state_layers)
    sequence = target.sequence()
    try:
        logits = sequence.forward(ids)
        states = sequence.states
    finally:
        sequence.release()
        target.keep_states(False)
    head = draft.sequence()
    head.observe(0, states)
    guesses = draft.columns[head.forward(ids).argmax(-1)]
    head.release()
    return int((guesses[1:] == logits.argmax(-1)[1:]).sum()), len(ids) - 1  # entry 0 reads no state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True, help="an EAGLE-3 head directory")
    parser.add_argument("--suite", nargs="+", default=["complete", "prose"])
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200, help="of each prompt")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = specdec.load_model(args.target, threads=args.threads)
    draft = load_draft(args.draft, target)
    for suite in args.suite:
        hits = total = 0
        for _, task in zip(range(args.limit), suite_tasks(suite)):
            agreed, positions = agreement(target, draft, target.tokenizer.encode(task.text)[: args.max_tokens])
            hits, total = hits + agreed, total + positions
        print(f"{suite}: depth-1 agreement {hits / total:.3f} over {total} positions")


if __name__ == "__main__":
    main()
