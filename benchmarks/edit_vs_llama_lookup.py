"""specdec's default against llama.cpp's own `llama-lookup` on one suite, in the same window:
each prompt runs specdec plain, the default and prompt lookup γ=8, then llama.cpp's plain
(`llama-completion`) and `llama-lookup` at draft 8 and 16, round after round. Every ratio is to
its own plain on the same prompt (speeds of the decode phase: after the prompt, as llama.cpp's
programs report them). Needs the tools: `bash benchmarks/build_llama_cpp_tools.sh`.

    python benchmarks/edit_vs_llama_lookup.py --target $G            # edit, 8 prompts x 2 rounds, 1 thread, greedy
    python benchmarks/edit_vs_llama_lookup.py --target $G --suite agent --limit 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_tools  # noqa: E402

import specdec  # noqa: E402
from specdec.bench.runner import machine_description, quartiles  # noqa: E402
from specdec.bench.suites import suite_tasks  # noqa: E402
from specdec.drafters import AutoDrafter, PromptLookupDrafter  # noqa: E402


def specdec_runs(target_path: str, threads: int, new: int):
    """name -> (prompt text -> (decode tokens/s, acceptance)) for specdec's strategies."""
    target = specdec.load_model(target_path, threads=threads)
    decoders = {"specdec plain": specdec.SpeculativeDecoder(target),
                "specdec default": specdec.SpeculativeDecoder(target, AutoDrafter(None, PromptLookupDrafter()), history=None),
                "specdec prompt lookup γ=8": specdec.SpeculativeDecoder(target, PromptLookupDrafter(), gamma=8)}

    def runner(decoder):
        def run(text: str):
            ids = target.tokenizer.encode(text, add_special_tokens=True)
            stats = decoder.generate(ids, max_new_tokens=new, temperature=0.0).stats
            return stats.generated_tokens / (stats.total_seconds - stats.prefill_seconds), stats.acceptance_rate, len(ids)
        return run

    return {name: runner(decoder) for name, decoder in decoders.items()}


def tool_runs(target_path: str, threads: int, new: int, context: int):
    def runner(kind: str, draft_n_max: int = 8):
        def run(text: str):
            out = llama_tools.run_tool(kind, text, new, threads, target_path, draft_n_max=draft_n_max, context=context)
            return out.tokens_per_second, (out.accepted / out.drafted if out.drafted else None), None
        return run

    return {"llama.cpp plain": runner("plain"), "llama-lookup draft 8": runner("lookup", 8), "llama-lookup draft 16": runner("lookup", 16)}


def summary(results: dict[str, list[tuple]]) -> dict:
    """Per strategy: the median of its per-run ratios to its own plain (specdec's or llama.cpp's)."""
    rows = {}
    for name, runs in results.items():
        plain = results["specdec plain" if name.startswith("specdec") else "llama.cpp plain"]
        ratios = [r[0] / p[0] for r, p in zip(runs, plain)]
        accept = [r[1] for r in runs if r[1] is not None]
        rows[name] = {"speedup": statistics.median(ratios), "iqr": quartiles(ratios),
                      "tokens_per_second": statistics.median(r[0] for r in runs),
                      "acceptance": statistics.median(accept) if accept else None}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="a GGUF file")
    parser.add_argument("--suite", default="edit")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="write the per-run figures as JSON here")
    args = parser.parse_args()
    if not llama_tools.available():
        sys.exit(f"llama.cpp's tools are not built in {llama_tools.BIN}: run benchmarks/build_llama_cpp_tools.sh")
    strategies = {**specdec_runs(args.target, args.threads, args.max_new_tokens),
                  **tool_runs(args.target, args.threads, args.max_new_tokens, args.context)}
    texts = [t.text for t in suite_tasks(args.suite)][: args.limit]
    for run in strategies.values():  # warm-up, not recorded
        run(texts[0][:200])
    results = {name: [] for name in strategies}
    loads = []
    with tqdm(total=args.rounds * len(texts) * len(strategies), unit="run") as bar:
        for _ in range(args.rounds):
            for text in texts:
                for name, run in strategies.items():
                    results[name].append(run(text))
                    bar.update(1)
                loads.append(os.getloadavg()[0])
    rows = summary(results)
    print(f"{args.suite}, {len(texts)} prompts x {args.rounds} rounds, {args.threads} thread(s), greedy, {args.max_new_tokens} new tokens; "
          f"{machine_description()['cpu']}; load median {statistics.median(loads):.2f}")
    print("| strategy | ratio to its own plain (IQR) | tokens/s | acceptance |\n| --- | --- | --- | --- |")
    for name, row in rows.items():
        iqr = "–".join(f"{q:.2f}" for q in row["iqr"]) if row["iqr"] else ""
        accept = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "–"
        print(f"| {name} | {row['speedup']:.2f}× ({iqr}) | {row['tokens_per_second']:.1f} | {accept} |")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_description(), "loads": loads, "summary": rows, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
