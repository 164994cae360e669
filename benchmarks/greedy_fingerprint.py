"""What every strategy generates on the demo pair, on both backends, as one JSON document: the proof
that a refactor moved no token. Greedy tokens for every strategy, and seeded samples for the fixed
strategies (their draws repeat when their drafting does) and for the default (a seed keys its draws
by position: plain decoding's text).

    python benchmarks/greedy_fingerprint.py > before.json   # on the old commit
    python benchmarks/greedy_fingerprint.py > after.json    # on the new one
    diff before.json after.json                              # nothing: no token moved
"""

from __future__ import annotations

import json
import sys

import specdec

PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:\n    def __init__(self, path):", "for i in range(10):\n    print(i"]
STRATEGIES = {  # name -> specdec.load keywords
    "plain": dict(plain=True),
    "default": dict(),
    "chain γ=4": dict(gamma=4),
    "tree 8, depth 3": dict(tree=8, gamma=3),
    "staged lookup": dict(staged=True, prompt_lookup=True, gamma=3),
    "staged n-gram": dict(staged=True, gamma=3),
    "n-gram γ=4": dict(ngram="demo", gamma=4),
    "prompt lookup γ=4": dict(prompt_lookup=True, gamma=4),
}


def load(backend: str, options: dict) -> specdec.SpeculativeDecoder:
    options = dict(options)
    if options.get("ngram") == "demo":
        from specdec.demo import demo_ngram

        options["ngram"] = str(demo_ngram())
    return specdec.load(backend=backend, threads=1, **options)


def main() -> None:
    out = {}
    for backend in ("llamacpp", "transformers"):
        for name, options in STRATEGIES.items():
            print(f"{backend}: {name}", file=sys.stderr)
            decoder = load(backend, options)
            runs = {}
            for i, prompt in enumerate(PROMPTS):
                runs[f"greedy {i}"] = decoder.generate(prompt, max_new_tokens=40, temperature=0).tokens
                runs[f"seed {i}"] = decoder.generate(prompt, max_new_tokens=24, temperature=0.8, seed=i).tokens
            out[f"{backend}: {name}"] = runs
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
