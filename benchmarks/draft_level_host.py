"""A draft level's host work outside its forward, at Gemma's sizes: a pruned draft predicting 8192
of a 262,144-token vocabulary (`runtime.pruned.PrunedVocab`) over a stand-in model whose forward
returns fixed random logits at no cost, so what is timed is everything around the forward: the
wrapper, the sampling transform, choosing children, the Draft, the engine's check of it, and the
verifier's walk. Prints one JSON line: medians over many runs, in milliseconds.

    taskset -c 1 python benchmarks/draft_level_host.py
    taskset -c 1 env PYTHONPATH=OLD_CHECKOUT python benchmarks/draft_level_host.py   # before

Per level: (a proposal's time - its forwards' time) / its draft forwards. Uses only what both
sides of the change have (the verifier is given `columns` only where the Draft carries them).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from specdec.drafters import ModelDrafter, TreeShape
from specdec.drafters.base import DraftRequest
from specdec.engine import _checked
from specdec.runtime.pruned import PrunedVocab, VocabMap
from specdec.runtime.vocab import tokenizer_fingerprint
from specdec.params import SamplingParams
from specdec.verify import verify_tree

TARGET_VOCAB, DRAFT_VOCAB = 262_144, 8192
PROMPT = list(range(1000, 1032))
DEPTH, RUNS, WARMUP = 4, 300, 30


class StandInTokenizer:
    def __init__(self, size: int):
        self.size = size

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.size)}

    def __len__(self) -> int:
        return self.size


class StandInModel:
    """The draft model's protocol, its forward a slice of fixed logits ([rows, DRAFT_VOCAB + 1]:
    the predicted tokens, then the unknown id). `forward_seconds` adds up the time spent inside."""

    path, backend, max_length, stop_token_ids = "stand-in", "stand-in", 4096, frozenset()
    vocab_size = DRAFT_VOCAB + 1

    def __init__(self):
        self.logits = torch.randn(64, self.vocab_size, generator=torch.Generator().manual_seed(0)) * 2.5
        self.forward_seconds, self.forwards = 0.0, 0

    def describe(self) -> str:
        return self.path

    def sequence(self):
        return StandInSequence(self)

    def verify_room(self, root_position: int) -> int:
        return self.max_length - 1 - root_position

    def forward_batch(self, feeds):
        return [feed.sequence.forward(feed.tokens, feed.parents, feed.last) for feed in feeds]


class StandInSequence:
    def __init__(self, owner: StandInModel):
        self.owner, self.cache_len = owner, 0

    def forward(self, tokens, parents=None, last=None):
        started = time.perf_counter()
        count = len(tokens)
        self.cache_len += count
        rows = self.owner.logits[: count if last is None else min(last, count)]
        self.owner.forward_seconds += time.perf_counter() - started
        self.owner.forwards += 1
        return rows

    def keep(self, start, indices):
        self.cache_len = start + len(indices)

    def truncate(self, length):
        self.cache_len = length

    def release(self):
        pass


def measure(model: StandInModel, drafter: ModelDrafter, sampling: SamplingParams) -> dict:
    """Medians per run: host ms per draft level, and per proposal the engine's check and the verifier's walk."""
    generator = torch.Generator().manual_seed(1)
    target_probs = torch.softmax(torch.randn(DEPTH * 3 + 1, TARGET_VOCAB, generator=torch.Generator().manual_seed(2)), -1)
    levels, checks, walks = [], [], []
    for run in range(WARMUP + RUNS):
        slot = drafter.open(PROMPT)
        drafter.prefill(slot)
        model.forward_seconds, model.forwards = 0.0, 0
        started = time.perf_counter()
        draft, = drafter.propose([DraftRequest(slot, PROMPT, DEPTH, sampling, generator)])
        took = time.perf_counter() - started
        per_level = (took - model.forward_seconds) / model.forwards
        started = time.perf_counter()
        draft = _checked(draft, DEPTH, TARGET_VOCAB, sampling)
        checked = time.perf_counter() - started
        columns = {"columns": draft.columns} if getattr(draft, "columns", None) is not None else {}
        started = time.perf_counter()
        if not sampling.greedy:
            verify_tree(draft.tokens, draft.parents, draft.probs, target_probs[: len(draft) + 1], generator, generator, **columns)
        walked = time.perf_counter() - started
        drafter.close(slot)
        if run >= WARMUP:
            levels.append(per_level)
            checks.append(checked)
            walks.append(walked)
    milliseconds = lambda values: round(statistics.median(values) * 1e3, 4)
    return {"level_ms": milliseconds(levels), "check_ms": milliseconds(checks), "verify_walk_ms": milliseconds(walks)}


def main() -> None:
    torch.set_num_threads(1)
    ids = torch.randperm(TARGET_VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].tolist()
    tokenizer = StandInTokenizer(TARGET_VOCAB)
    vocab_map = VocabMap(tuple(ids), TARGET_VOCAB, tokenizer_fingerprint(tokenizer, spaces_as_written=True))
    model = StandInModel()
    draft = PrunedVocab(model, vocab_map, tokenizer)
    cases = {
        "chain T0": (ModelDrafter(draft), SamplingParams(temperature=0)),
        "chain T0.7": (ModelDrafter(draft), SamplingParams(temperature=0.7)),
        "tree w3 T0": (ModelDrafter(draft, tree=TreeShape(nodes=12, width=3)), SamplingParams(temperature=0)),
        "tree w3 T0.7": (ModelDrafter(draft, tree=TreeShape(nodes=12, width=3)), SamplingParams(temperature=0.7)),
    }
    report = {"target_vocab": TARGET_VOCAB, "draft_vocab": DRAFT_VOCAB, "depth": DEPTH, "runs": RUNS, "threads": torch.get_num_threads()}
    report.update({name: measure(model, drafter, sampling) for name, (drafter, sampling) in cases.items()})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
