"""How often a draft head agrees with its target's greedy choice on a bench suite, offline.

The target continues each prompt greedily (llama.cpp or transformers, keeping its final-norm states);
the head is then fed the target's true states and tokens: depth 1 reads the target's state, depth 2
the head's own guess (with the true token), as when it drafts a chain. Prints one JSON line.

    python benchmarks/head_agreement.py TARGET HEAD_DIR --suite complete --prompts 4 --tokens 64
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from specdec.bench.suites import suite_tasks
from specdec.runtime import load_draft, load_model


def continuation(target, ids: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """The target's greedy tokens after `ids` and the state [tokens + 1, hidden] that drew each (and the next)."""
    sequence = target.sequence()
    try:
        logits = sequence.forward(ids, last=1)
        states, out = [sequence.states[0]], []
        for _ in range(tokens):
            out.append(int(logits[0].argmax()))
            logits = sequence.forward([out[-1]])
            states.append(sequence.states[0])
    finally:
        sequence.release()
    return out, torch.stack(states).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("head")
    parser.add_argument("--suite", default="complete")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    target = load_model(args.target, threads=args.threads)
    target.keep_states()
    draft = load_draft(args.head, target)
    head, columns = draft.inner, draft.columns
    depth1 = both = positions = 0
    for task in itertools.islice(suite_tasks(args.suite), args.prompts):
        prompt = task.prompt_for(target.tokenizer)
        out, states = continuation(target, target.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt, args.tokens)
        ids, truth = torch.tensor(draft.draft_tokens(out)), torch.tensor(out)
        with torch.inference_mode():
            first = head.net.guess(states[:-2], ids[:-1]).float()  # (state that drew out[i], out[i]) -> out[i + 1]
            second = head.net.guess(first[:-1], ids[1:-1]).float()  # its own guess, out[i + 1] -> out[i + 2]
            right1 = columns[head.score(first).argmax(-1)] == truth[1:]
            right2 = columns[head.score(second).argmax(-1)] == truth[2:]
        depth1, both, positions = depth1 + int(right1.sum()), both + int((right1[:-1] & right2).sum()), positions + len(right1)
    print(json.dumps({"suite": args.suite, "prompts": args.prompts, "positions": positions,
                      "depth1": round(depth1 / positions, 4), "depths1and2": round(both / positions, 4)}))


if __name__ == "__main__":
    main()
