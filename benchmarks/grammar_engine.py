"""What a constraint costs (`specdec.constraints`, llguidance) on a model's vocabulary: the grammar
tokenizer's one-time build, each bench schema's and tool call's compile, and per token of a valid output the mask
(llguidance's bitmask, then specdec's boolean row and the masked logits row) and the commit. Prints
one JSON line; medians over the output's tokens.

    python benchmarks/grammar_engine.py                      # the demo pair's target (llama.cpp)
    python benchmarks/grammar_engine.py $G --threads 1       # Gemma 3 270M: a 262k vocabulary
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

import specdec
from specdec.bench.suites import FUNCTION_SCHEMA, suite_tasks
from specdec.constraints import Constraint
from specdec.tools import FORMATS, ToolUse, tools_from

SCHEMAS = {
    "function (the json suite)": FUNCTION_SCHEMA,
    "record": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "tags": {"type": "array", "items": {"type": "string"}}},
               "required": ["name", "age"]},
    "any object": None,
}
# the tools suite's required call, and a choice among three tools (one per format's frame)
DESCRIBE = {"type": "function", "function": {"name": "describe_function", "parameters": FUNCTION_SCHEMA}}
THREE = [DESCRIBE] + [{"type": "function", "function": {"name": name, "parameters": SCHEMAS["record"]}}
                      for name in ("save_record", "find_record")]
TOOL_CALLS = {f"tool call, {format} ({len(tools)} tools)": ToolUse(tools_from(tools), FORMATS[format], "required",
                                                                    parallel=False).constraint()
              for format in FORMATS for tools in ([DESCRIBE], THREE)}


def timed(function):
    started = time.perf_counter()
    out = function()
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", help="a model (default: the demo pair's target)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tasks", type=int, default=4, help="json-suite answers whose tokens are timed")
    args = parser.parse_args()
    decoder = specdec.load(args.target, plain=True, threads=args.threads)
    grammars, vocab = decoder.grammars, decoder.target.vocab_size
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _, tokenizer_seconds = timed(grammars.tokenizer)
    compile_ms = {}
    constraints = {name: Constraint.json_object() if schema is None else Constraint.json_schema(schema)
                   for name, schema in SCHEMAS.items()} | TOOL_CALLS
    for name, constraint in constraints.items():
        _, seconds = timed(lambda: grammars.matcher(constraint))
        _, again = timed(lambda: grammars.matcher(constraint))
        compile_ms[name] = {"first": round(seconds * 1e3, 2), "cached": round(again * 1e3, 3)}
    bitmask, allowed, masked, commit = [], [], [], []
    logits = torch.zeros(1, vocab)
    constraint = Constraint.json_schema(FUNCTION_SCHEMA)
    for task, _ in zip(suite_tasks("json"), range(args.tasks)):
        matcher = grammars.matcher(constraint)
        for token in decoder.tokenizer.encode(task.reference, add_special_tokens=False):
            bitmask.append(timed(matcher._matcher.compute_bitmask)[1])
            allowed.append(timed(matcher.allowed)[1])
            masked.append(timed(lambda: matcher.shape(logits))[1])
            commit.append(timed(lambda: matcher.advance([token]))[1])
    median_ms = lambda values: round(statistics.median(values) * 1e3, 4)
    print(json.dumps({
        "model": args.target or "demo pair target", "vocabulary": vocab, "engine": "llguidance",
        "tokenizer_build_s": round(tokenizer_seconds, 3), "compile_ms": compile_ms,
        "per_token_ms": {"bitmask": median_ms(bitmask), "allowed_row": median_ms(allowed),
                         "masked_logits_row": median_ms(masked), "commit": median_ms(commit)},
        "tokens_timed": len(commit),
        "max_rss_growth_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024, 1),
    }))


if __name__ == "__main__":
    main()
