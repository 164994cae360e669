"""What a k-token verify costs on llama.cpp's CPU backend, per configuration (issue 22).

For each configuration, in a process of its own (batch invariance is process-wide in ggml), the
cost curve the auto policy decides with (`specdec.profiling.measure_curve`: a forward of k tokens,
logits for all, after a 256-token prefix, as decoding pays it), and llama-cpp-python's own plain
decoding step (Llama.generate, greedy, 64 tokens) for scale. Configurations alternate over
--rounds rounds; the table gives each one's median and its spread (min-max over rounds).

    python benchmarks/verify_cost.py --target $G [--rounds 2] [--plot curves.png]
    python benchmarks/verify_cost.py --target "$(python -c 'from specdec.demo import demo_gguf; print(demo_gguf("target"))')" --site /path/to/a/no-llamafile/build

--site adds a configuration run with that directory first on PYTHONPATH (a llama-cpp-python
installed there with `pip install --target DIR`, e.g. built with CMAKE_ARGS="-DGGML_LLAMAFILE=OFF").
Run it on a quiet machine with 1 thread pinned (taskset -c 1); it records the CPU and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
CONFIGS = {"llama.cpp output layer": dict(output_layer="llama.cpp"), "specdec output layer": dict(output_layer="auto"),
           "specdec output layer, batch-invariant": dict(output_layer="auto", batch_invariant=True)}


def measure(target: str, options: dict, threads: int) -> dict:
    """One configuration, in this process: the curve, llama-cpp-python's plain step, the output layer used."""
    import time

    from llama_cpp import Llama

    from specdec import profiling
    from specdec.runtime import load_model

    model = load_model(target, threads=threads, **options)
    curve, _ = profiling.measure_curve(model, sizes=SIZES)
    layer = model.output_layer
    del model
    llm = Llama(model_path=target, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = llm.tokenize(b"def fibonacci(n):\n    ")
    llm.eval(prompt)
    steps = []
    started = time.perf_counter()
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=False):
        steps.append(time.perf_counter() - started)
        started = time.perf_counter()
        if len(steps) >= 64:
            break
    return {"curve": {str(k): v for k, v in curve.items()}, "llama_cpp_step": statistics.median(steps[4:]), "output_layer": layer}


def run_config(target: str, name: str, threads: int, site: str | None) -> dict:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    options = CONFIGS.get(name, dict(output_layer="auto", batch_invariant=True))
    code = f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import verify_cost; " \
           f"print(json.dumps(verify_cost.measure({target!r}, {options!r}, {threads})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--site", help="a directory holding another llama-cpp-python build (see the module docstring)")
    parser.add_argument("--plot", metavar="FILE.png")
    args = parser.parse_args()
    from specdec.profiling import cpu_name, load_average

    names = list(CONFIGS) + (["another build (--site), specdec output layer, batch-invariant"] if args.site else [])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            runs[name].append(run_config(args.target, name, args.threads, args.site if "--site" in name else None))
    print(f"{args.target} · {cpu_name()} · {args.threads} thread(s) · load {load_average()} · {args.rounds} rounds\n")
    print("| configuration | output layer | t(1) ms | llama-cpp-python plain step ms | " + " | ".join(f"t({k})/t(1)" for k in SIZES[1:]) + " |")
    print("|---" * (4 + len(SIZES) - 1) + "|")
    medians = {}
    for name in names:
        good = [run for run in runs[name] if "error" not in run]
        if not good:
            print(f"| {name} | refused: {runs[name][0]['error']} |")
            continue
        curve = {k: statistics.median(run["curve"][str(k)] for run in good) for k in SIZES if str(k) in good[0]["curve"]}
        spread = {k: (min(r["curve"][str(k)] for r in good), max(r["curve"][str(k)] for r in good)) for k in curve}
        medians[name] = curve
        step = statistics.median(run["llama_cpp_step"] for run in good)
        cells = [f"{curve[k] / curve[1]:.2f}" for k in SIZES[1:] if k in curve]
        print(f"| {name} | {good[0]['output_layer']} | {curve[1] * 1e3:.2f} ({spread[1][0] * 1e3:.2f}-{spread[1][1] * 1e3:.2f}) | "
              f"{step * 1e3:.2f} | " + " | ".join(cells) + " |")
    if args.plot and medians:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(6, 4))
        for name, curve in medians.items():
            axis.plot(list(curve), [v * 1e3 for v in curve.values()], marker="o", label=name)
        axis.set_xlabel("tokens in the forward (k)")
        axis.set_ylabel("ms per forward")
        axis.set_title(f"{os.path.basename(args.target)}, {args.threads} thread(s)")
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
