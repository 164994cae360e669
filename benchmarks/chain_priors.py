"""How often a looked-up chain is right, at every position of plain generations: the evidence for the
default's chain priors (`policy.CHAIN_PRIORS`, `SAMPLED_PRIORS`). At each generated position the
continuation the default would look up (`lookup_match`, as `AutoDrafter` searches it), split into
"copy" and "lookup" by how far its match runs back; its first token is a trial, each next one a trial
given the one before was right. Sampled, a point mass is accepted with the target's probability of
it, which a sampled token equal to it estimates without bias. These are all positions; a speculative
step starts where the last one stopped (often just after a rejection), where a copy holds less
often: the policy's own trials read lower (RESULTS.md, "Sampled lookup priced as it is accepted").
With --model, the draft model's nodes instead (`policy.model_prior`): at every generated position, a
drawn node's chance of acceptance, sum(min(p, q)) exactly (greedy: whether the argmaxes agree), by the
draft's confidence (q's top probability).

    taskset -c 1 python benchmarks/chain_priors.py --mode sampled --seeds 4
    taskset -c 1 python benchmarks/chain_priors.py --mode greedy --target $G
    taskset -c 1 python benchmarks/chain_priors.py --mode sampled --seeds 2 --model --backend transformers
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import replace

from specdec.bench.runner import BenchConfig, build_strategies, sampling_for, suite_prompts
from specdec.drafters.auto import copying
from specdec.drafters.prompt_lookup import lookup_match
from specdec.sampling import probs_from_logits

CHAIN = 8  # tokens looked up per position


def trials(prompt: list[int], generated: list[int]):
    """(kind, first or next, right) for every chain token the generated text reached."""
    for start in range(len(generated)):
        chain, matched = lookup_match(prompt + generated[:start], CHAIN)
        kind = "copy" if copying(matched, start) else f"lookup, match {min(matched, 3)}"
        for position, token in enumerate(chain[: len(generated) - start]):
            right = generated[start + position] == token
            yield kind, "next" if position else "first", right
            if not right:
                break


def model_trials(target, draft, tokens: list[int], start: int, sampling):
    """(confidence, chance of acceptance) of a draft-model node at every position from `start` on."""
    import torch

    logits = []
    for model in (target, draft):
        sequence = model.sequence()
        logits.append(sequence.forward(tokens)[start - 1:-1].float())
        sequence.release()
    if sampling.temperature == 0:
        p, q = (torch.softmax(x, -1) for x in logits)
        accepted = (p.argmax(-1) == q.argmax(-1)).float()
    else:
        p, q = (probs_from_logits(x, sampling) for x in logits)
        accepted = torch.minimum(p, q).sum(-1)
    return zip(q.max(-1).values.tolist(), accepted.tolist())


def print_model_table(acceptance: dict, mode: str) -> None:
    print(f"| {mode}: draft confidence | positions | chance of acceptance |\n|---|---|---|")
    for bin_ in sorted(acceptance):
        total, count = acceptance[bin_]
        print(f"| {bin_ / 10:.1f}–{(bin_ + 1) / 10:.1f} | {count} | {total / count:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="a GGUF file or checkpoint (default: the demo pair)")
    parser.add_argument("--suite", nargs="+", default=["complete", "edit", "extract", "chat", "agent", "prose"])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=4, help="sampled generations per prompt")
    parser.add_argument("--mode", choices=["greedy", "sampled"], default="sampled")
    parser.add_argument("--model", action="store_true", help="the draft model's nodes by confidence, not chains")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    config = BenchConfig.quick(target=args.target, suites=tuple(args.suite), limit=args.limit, max_new_tokens=96,
                               temperature=0.7, top_k=0, peers=False)
    config = replace(config, runtime=replace(config.runtime, threads=1, backend=args.backend))
    target, draft, strategies = build_strategies(config)
    plain = next(s for s in strategies if s.name == "plain")
    prompts, sampling = suite_prompts(config, target), sampling_for(args.mode, config)
    counts = collections.Counter()  # (suite, kind, "first"/"next", "trials"/"right") -> count
    acceptance = collections.defaultdict(lambda: [0.0, 0])  # confidence bin -> (summed chance, positions)
    for suite, tasks in prompts.items():
        for seed in range(args.seeds if args.mode == "sampled" else 1):
            for i, (ids, reference, answer) in enumerate(tasks):
                generated = plain.run(ids, sampling, 100 * seed + i, reference, answer).tokens
                if args.model:
                    for confidence, chance in model_trials(target, draft, list(ids) + generated, len(ids), sampling):
                        cell = acceptance[min(9, int(confidence * 10))]
                        cell[0], cell[1] = cell[0] + chance, cell[1] + 1
                    continue
                for kind, position, right in trials(list(ids), generated):
                    counts[suite, kind, position, "trials"] += 1
                    counts[suite, kind, position, "right"] += right
    if args.model:
        return print_model_table(acceptance, args.mode)

    def rate(suites, kind: str, position: str) -> str:
        right, total = (sum(counts[suite, kind, position, what] for suite in suites) for what in ("right", "trials"))
        return f"{right / max(total, 1):.2f} ({total})"

    print(f"| {args.mode} | first | next | by suite (first) |\n|---|---|---|---|")
    for kind in sorted({key[1] for key in counts}):
        by_suite = ", ".join(f"{suite} {rate([suite], kind, 'first')}" for suite in prompts)
        print(f"| {kind} | {rate(prompts, kind, 'first')} | {rate(prompts, kind, 'next')} | {by_suite} |")


if __name__ == "__main__":
    main()
