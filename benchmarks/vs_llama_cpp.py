"""specdec on llama.cpp against llama.cpp itself: the same GGUF files, prompts and threads, interleaved.

    bash benchmarks/build_llama_cpp_tools.sh          # llama.cpp's own programs (once, ~10 min)
    python benchmarks/vs_llama_cpp.py --limit 30 --threads 1 2 --out runs/vs-llama-cpp

Per mode (greedy; sampled at T 0.8, top-k 20) and thread count, every prompt runs every contestant
in turn, so drift on this shared machine hits all alike; the 1-minute load average is recorded
beside every run. Contestants:
- specdec (llama.cpp backend): plain decoding and its speculative strategies;
- llama-cpp-python's own generate() on the same loaded file: plain and its prompt-lookup draft;
- llama.cpp's programs (subprocesses; their own decode timing, model loading excluded):
  llama-completion (plain), llama-speculative-simple (draft model), llama-speculative
  (stochastic, draft model), llama-lookup.
Reported: median decode-phase tokens/s per contestant (generated tokens over the time after the
prompt's prefill: the llama.cpp programs print that phase's timing, and the in-process contestants
time their prefill apart) and the median per-prompt ratio to specdec plain decoding;
and the read bandwidth of one core with the plain-decoding bound it implies (weight bytes per token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import llama_tools  # noqa: E402

import specdec  # noqa: E402
from specdec import AutoDrafter, ModelDrafter, NgramDrafter, PromptLookupDrafter, SpeculativeDecoder, TreeShape  # noqa: E402
from specdec.demo import demo_gguf, demo_ngram  # noqa: E402
from specdec.bench.peers import peers  # noqa: E402
from specdec.bench.prompts import humaneval_prompts  # noqa: E402
from specdec.bench.runner import read_bandwidth  # noqa: E402
from specdec.katz import KatzTrigram  # noqa: E402
from specdec.params import SamplingParams  # noqa: E402

MODES = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=0.8, top_k=20)}


def specdec_contestants(target, draft) -> dict:
    ngram = KatzTrigram.load(demo_ngram())
    decoders = {
        "specdec plain": SpeculativeDecoder(target),
        "specdec default (auto)": SpeculativeDecoder(target, AutoDrafter(ModelDrafter(draft), PromptLookupDrafter())),
        "specdec prompt lookup γ=4": SpeculativeDecoder(target, PromptLookupDrafter(), 4),
        "specdec prompt lookup γ=8": SpeculativeDecoder(target, PromptLookupDrafter(), 8),
        "specdec n-gram γ=2": SpeculativeDecoder(target, NgramDrafter(ngram), 2),
        "specdec chain γ=2": SpeculativeDecoder(target, ModelDrafter(draft), 2),
        "specdec chain γ=3": SpeculativeDecoder(target, ModelDrafter(draft), 3),
        "specdec staged γ=3 (lookup)": SpeculativeDecoder(target, ModelDrafter(draft, inner=PromptLookupDrafter()), 3),
        "specdec tree 4 γ=2": SpeculativeDecoder(target, ModelDrafter(draft, tree=TreeShape(4, 2)), 2),
    }

    def runner(decoder):
        def run(prompt, ids, sampling, seed, new):
            result = decoder.generate(ids, max_new_tokens=new, temperature=sampling.temperature, top_k=sampling.top_k, seed=seed)
            return {"tokens": len(result.tokens), "seconds": result.stats.total_seconds - result.stats.prefill_seconds, "token_ids": result.tokens,
                    "accepted": result.stats.accepted, "drafted": result.stats.drafted}
        return run

    return {name: runner(decoder) for name, decoder in decoders.items()}


def peer_contestants(target, new: int) -> dict:
    def runner(peer):
        def run(prompt, ids, sampling, seed, _new):
            out = peer.run(ids, sampling, seed)
            return {"tokens": len(out.tokens), "seconds": out.seconds - out.prefill_seconds, "token_ids": out.tokens}
        return run

    return {peer.name: runner(peer) for peer in peers(target, None, new)}


def tool_contestants(target_path: str, draft_path: str, threads: int) -> dict:
    kinds = {"llama.cpp completion (plain)": ("plain", {}),
             "llama.cpp speculative-simple n=2": ("draft-simple", {"draft_n_max": 2}),
             "llama.cpp speculative-simple n=4": ("draft-simple", {"draft_n_max": 4}),
             "llama.cpp speculative n=3": ("speculative", {"draft_n_max": 3}),
             "llama.cpp lookup n=8": ("lookup", {"draft_n_max": 8})}

    def runner(kind, extra):
        def run(prompt, ids, sampling, seed, new):
            out = llama_tools.run_tool(kind, prompt, new, threads, target_path, draft_path, temperature=sampling.temperature,
                                       top_k=sampling.top_k, seed=seed, **extra)
            return {"tokens": out.tokens, "seconds": out.seconds, "accepted": out.accepted, "drafted": out.drafted}
        return run

    return {name: runner(kind, extra) for name, (kind, extra) in kinds.items()}


def attempt(run, *arguments) -> dict | None:
    """One run; a llama.cpp program that fails is reported and left out, not fatal."""
    try:
        return run(*arguments)
    except RuntimeError as error:
        print(f"skipped: {str(error)[:300]}", file=sys.stderr)
        return None


def measure(args) -> dict:
    prompts = humaneval_prompts()[: args.limit]
    results = {"config": vars(args) | {"out": str(args.out)}, "runs": {}, "bandwidth": {}}
    for threads in args.threads:
        target = specdec.load_model(args.target, threads=threads)
        draft = specdec.load_model(args.draft, threads=threads)
        contestants = specdec_contestants(target, draft) | peer_contestants(target, args.max_new_tokens)
        if llama_tools.available() and not args.no_tools:
            contestants |= tool_contestants(args.target, args.draft, threads)
        bandwidth = read_bandwidth(threads)
        results["bandwidth"][str(threads)] = {"bytes_per_second": bandwidth, "weight_bytes": target.weight_bytes,
                                         "bound_tokens_per_second": bandwidth / target.weight_bytes}
        for mode, sampling in MODES.items():
            for name, run in contestants.items():  # warm-up: every code path once, not recorded
                attempt(run, prompts[0], target.tokenizer.encode(prompts[0]), sampling, 0, 16)
            runs = results["runs"].setdefault(f"{mode} · {threads} thread{'s' if threads > 1 else ''}", {})
            for i, prompt in enumerate(prompts):
                ids = target.tokenizer.encode(prompt)
                for name, run in contestants.items():
                    record = attempt(run, prompt, ids, sampling, args.seed + i, args.max_new_tokens)
                    if record is not None:
                        record["load"] = os.getloadavg()[0]
                        runs.setdefault(name, []).append(record | {"prompt": i})
                print(f"{mode} {threads}t prompt {i + 1}/{len(prompts)} load {os.getloadavg()[0]:.2f}", file=sys.stderr)
            save(args.out, results)
    return results


def summarize(results: dict) -> str:
    lines = []
    for window, runs in results["runs"].items():
        threads = int(window.split("·")[1].split()[0])
        plain = runs["specdec plain"]
        loads = [r["load"] for rs in runs.values() for r in rs]
        bound = results["bandwidth"][str(threads)]["bound_tokens_per_second"]
        lines += [f"\n### {window} (load during runs: median {statistics.median(loads):.2f}, max {max(loads):.2f}; "
                  f"read-bandwidth bound for plain decoding: {bound:.0f} tok/s)\n",
                  "| contestant | tok/s (median) | × specdec plain | acceptance |", "| --- | --- | --- | --- |"]
        for name, rs in runs.items():
            rates = [r["tokens"] / r["seconds"] for r in rs if r["seconds"] > 0]
            plain_rate = {p["prompt"]: p["tokens"] / p["seconds"] for p in plain}
            ratios = [(r["tokens"] / r["seconds"]) / plain_rate[r["prompt"]] for r in rs if r["seconds"] > 0]
            drafted = sum(r.get("drafted") or 0 for r in rs)
            acceptance = f"{sum(r.get('accepted') or 0 for r in rs) / drafted:.2f}" if drafted else "–"
            lines.append(f"| {name} | {statistics.median(rates):.0f} | {statistics.median(ratios):.2f} | {acceptance} |")
        greedy_check = [name for name, rs in runs.items() if "token_ids" in rs[0] and window.startswith("greedy")
                        and any(r["token_ids"] != p["token_ids"] for r, p in zip(rs, plain))]
        lines.append(f"\n{min(map(len, runs.values()))}–{max(map(len, runs.values()))} prompts per contestant "
                     "(a llama.cpp program that printed no timing line is left out for that prompt).")
        if window.startswith("greedy"):
            lines.append(f"\nGreedy token ids equal to specdec plain for every in-process contestant: "
                         f"{'yes' if not greedy_check else 'no: ' + ', '.join(greedy_check)}")
    return "\n".join(lines)


def save(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="default: the demo pair's target (specdec.demo.demo_gguf)")
    parser.add_argument("--draft", help="default: the demo pair's draft")
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-tools", action="store_true", help="skip llama.cpp's programs")
    parser.add_argument("--out", type=Path, default=Path("runs/vs-llama-cpp"))
    args = parser.parse_args()
    args.target, args.draft = args.target or str(demo_gguf("target")), args.draft or str(demo_gguf("draft"))
    started = time.time()
    results = measure(args)
    results["seconds"] = time.time() - started
    save(args.out, results)
    table = summarize(results)
    (args.out / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
