"""How far a runtime's logits move with the batch shape, and how often greedy speculation then
leaves plain greedy text (issue 22).

Part 1, per model and configuration (each in a process of its own: ggml's switches are
process-wide): after a 40-token prefix, k tokens fed one at a time and then as one batch; the
largest |logit difference| over the k rows, and the largest |logit| for scale; then on the suites'
own text, how often a verify of 8 picks another greedy token than one row at a time (`flips`).
Part 2 (--suites): the default decoder (auto drafter, greedy) against plain greedy decoding on the
first --limit tasks of each suite, --max-new-tokens each: how many replies are token for token the
same.

    python benchmarks/batch_numerics.py --target $G [--suites edit extract complete --limit 8]
    python benchmarks/batch_numerics.py --target "$(python -c 'from specdec.demo import demo_gguf; print(demo_gguf("target"))')" --hf specdec/demo_pair/target
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

SIZES = (2, 4, 8, 16)
CONFIGS = {"llama.cpp, default": dict(output_layer="llama.cpp"),
           "llama.cpp, specdec output layer": dict(output_layer="specdec"),
           "llama.cpp, output layer split": dict(output_layer="split"),
           "llama.cpp, batch-invariant": dict(output_layer="auto", batch_invariant=True)}
FLIP_SUITES, FLIP_TASKS, FLIP_K = ("complete", "edit", "chat"), 3, 8  # `flips`: the suites' text, verifies of 8


def alone_and_together(model, prefix: list[int], tokens: list[int], k: int):
    """The logits of `tokens` after `prefix`, fed one at a time and fed k at a time."""
    import torch

    one, batched = model.sequence(), model.sequence()
    try:
        one.forward(prefix, last=1)
        batched.forward(prefix, last=1)
        return (torch.cat([one.forward([token]) for token in tokens]),
                torch.cat([batched.forward(tokens[i:i + k]) for i in range(0, len(tokens), k)]))
    finally:
        one.release()
        batched.release()


def gaps(path: str, options: dict) -> dict:
    """The largest logit difference between token-by-token and batched forwards, per k."""
    from specdec.runtime import load_model

    model = load_model(path, threads=1, **options)
    prefix = [(3 * i + 1) % model.vocab_size for i in range(40)]
    result = {"scale": 0.0}
    for k in SIZES:
        alone, together = alone_and_together(model, prefix, [(7 * i + 5) % model.vocab_size for i in range(k)], k)
        result[str(k)] = float((alone.double() - together.double()).abs().max())
        result["scale"] = max(result["scale"], float(alone.abs().max()))
    return result


def flips(path: str, options: dict) -> dict:
    """On the suites' own text (prompt and answer, after 64 tokens): how often a verify of FLIP_K
    rows picks another greedy token than one row at a time, and the largest |logit difference|."""
    from specdec.bench.suites import suite_tasks
    from specdec.runtime import load_model

    model = load_model(path, threads=1, **options)
    changed = positions = 0
    largest = 0.0
    for suite in FLIP_SUITES:
        for task in itertools.islice(suite_tasks(suite), FLIP_TASKS):
            ids = model.tokenizer.encode(task.text + task.reference)[:64 + 12 * FLIP_K]
            alone, together = alone_and_together(model, ids[:64], ids[64:], FLIP_K)
            changed += int((alone.argmax(-1) != together.argmax(-1)).sum())
            positions += len(alone)
            largest = max(largest, float((alone.double() - together.double()).abs().max()))
    return {"changed": changed, "positions": positions, "largest": largest}


def departures(path: str, options: dict, suites: list[str], limit: int, max_new_tokens: int) -> dict:
    """Per suite: (replies equal to plain greedy, replies) for the default decoder."""
    import specdec
    from specdec import SpeculativeDecoder
    from specdec.bench.suites import suite_tasks

    decoder = specdec.load(path, threads=1, **options)
    plain = SpeculativeDecoder(decoder.target, prefix_cache=None)
    counts = {}
    for suite in suites:
        same = total = 0
        for task in itertools.islice(suite_tasks(suite), limit):
            prompt = task.prompt_for(decoder.target.tokenizer)
            reference = plain.generate(prompt, max_new_tokens=max_new_tokens, temperature=0).tokens
            same += decoder.generate(prompt, max_new_tokens=max_new_tokens, temperature=0).tokens == reference
            total += 1
        counts[suite] = [same, total]
    return counts


def in_child(function: str, *arguments) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import batch_numerics; "
            f"print(json.dumps(batch_numerics.{function}(*{arguments!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a GGUF file")
    parser.add_argument("--hf", help="also the same model as a transformers checkpoint directory (float32)")
    parser.add_argument("--suites", nargs="*", default=[])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    from specdec.profiling import cpu_name

    print(f"{args.target} · {cpu_name()} · 1 thread\n")
    print("| runtime, configuration | " + " | ".join(f"max \\|Δlogit\\| k = {k}" for k in SIZES) + " | max \\|logit\\| |")
    print("|---" * (len(SIZES) + 2) + "|")
    rows = [(name, args.target, options) for name, options in CONFIGS.items()]
    if args.hf:
        rows.append(("transformers, float32", args.hf, {}))
    for name, path, options in rows:
        result = in_child("gaps", path, options)
        if "error" in result:
            print(f"| {name} | refused: {result['error']} |")
            continue
        print(f"| {name} | " + " | ".join(f"{result[str(k)]:.3g}" for k in SIZES) + f" | {result['scale']:.3g} |")
    print(f"\nthe suites' text ({', '.join(FLIP_SUITES)}, {FLIP_TASKS} tasks each): a verify of {FLIP_K} against "
          "one row at a time\n\n| runtime, configuration | greedy token differs | max \\|Δlogit\\| |\n|---|---|---|")
    for name, options in CONFIGS.items():
        result = in_child("flips", args.target, options)
        cells = ([f"refused: {result['error']}", ""] if "error" in result else
                 [f"{result['changed']} of {result['positions']}", f"{result['largest']:.3g}"])
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.suites:
        print(f"\ngreedy default decoder vs plain greedy, {args.limit} tasks per suite, {args.max_new_tokens} new tokens: replies equal\n")
        print("| configuration | " + " | ".join(args.suites) + " |")
        print("|---" * (len(args.suites) + 1) + "|")
        for name, options in (("default", {}), ("batch-invariant", dict(batch_invariant=True))):
            counts = in_child("departures", args.target, options, args.suites, args.limit, args.max_new_tokens)
            if "error" in counts:
                print(f"| {name} | refused: {counts['error']} |")
                continue
            print(f"| {name} | " + " | ".join(f"{counts[s][0]}/{counts[s][1]}" for s in args.suites) + " |")


if __name__ == "__main__":
    main()
