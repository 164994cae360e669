"""Turn `run_bench`'s data into a Markdown table and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [
    ("tokens/s", "tokens_per_second", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}×"),
    ("spread (IQR)", "speedup_iqr", "{0[0]:.2f}–{0[1]:.2f}"),
    ("predicted", "predicted_speedup", "{:.2f}×"),
    ("predicted (i.i.d. α)", "predicted_speedup_iid_alpha", "{:.2f}×"),
    ("acceptance", "acceptance_rate", "{:.3f}"),  # trees: accepted depth / offered depth
    ("tokens/target fwd", "tokens_per_target_forward", "{:.2f}"),
    ("nodes/verify", "tree_nodes_per_iteration", "{:.1f}"),
    ("target fwd/token", "target_forwards_per_token", "{:.3f}"),
    ("draft fwd/token", "draft_forwards_per_token", "{:.2f}"),
    ("weight MB/token", "weight_bytes_per_token", "{:.1f}"),
    ("valid", "valid_share", "{:.0%}"),  # under a constraint (the json suite): outputs that match it
]


def markdown(data: dict) -> str:
    suites = data["suites"]
    counts = ", ".join(f"{name} {part['prompts']}" for name, part in suites.items())
    lines = [f"Prompts: {counts} × {data['config'].get('rounds', 1)} round(s) · "
             f"new tokens per prompt: {data['config']['max_new_tokens']} · "
             f"machine: {data['machine']['cpu']}, {data['machine']['cores']} cores, "
             f"{data['machine']['torch_threads']} torch threads, "
             f"torch {data['machine']['torch']}"]
    load = data.get("load") or {}
    if load.get("median") is not None:
        lines.append(f"Load (1-minute average) during the run: median {load['median']:.2f}, max {load['max']:.2f}, "
                     f"with {load['own_threads']} thread(s) of our own on {load['cores']} cores")
    if load.get("warning"):
        lines.append(f"**Warning:** {load['warning']}")
    models = data["models"]
    target = models["target"]
    lines.append(f"Target: {target['parameters'] / 1e6:.1f}M parameters ({target['dtype']})"
                 + (f" · output layer: {target['output_layer']}" if target.get("output_layer") else "")
                 + (" · batch-invariant" if target.get("batch_invariant") else "")
                 + (f" · draft: {models['draft']['parameters'] / 1e6:.2f}M" if models["draft"] else ""))
    if len(suites) > 1:
        lines += ["", *overview(data)]
    for name, part in suites.items():
        lines += ["", f"## {name}: {part['prompts']} prompts × {part['rounds']} round(s)"]
        for mode, rows in part["summary"].items():
            lines += ["", f"### {name} · {mode}", "", "| strategy | " + " | ".join(c[0] for c in COLUMNS) + " |",
                      "|---|" + "---|" * len(COLUMNS)]
            lines += [f"| {strategy} | " + " | ".join(_cell(row, key, fmt) for _, key, fmt in COLUMNS) + " |"
                      for strategy, row in rows.items()]
            if DEFAULT in rows:
                lines += ["", f"The default drafted: {_choices(rows[DEFAULT])}."]
        mismatches = part["greedy_mismatches"]
        lines += ["", "Greedy output identical to plain decoding for every strategy and peer."
                  if not mismatches else "Greedy output that left plain decoding's: " + "; ".join(
                      f"{strategy}: {len(v)} of {part['prompts'] * part['rounds']} runs "
                      f"(first: prompt {v[0]['prompt']}, token {v[0]['first_difference']})"
                      for strategy, v in mismatches.items())]
    costs = data["costs"]["target"]
    lines += ["", "Target forward cost by new tokens k (ratio to k = 1): " + ", ".join(
        f"{k}: {costs[k] / costs[min(costs)]:.2f}" for k in sorted(costs))]
    if "draft" in data["costs"]:
        lines.append(f"Draft forward cost / target forward cost (k = 1): {data['costs']['draft'][1] / costs[1]:.3f}")
    if "profile" in data:
        lines.append(f"Cost curve stable after {data['profile']['rounds']} interleaved rounds; "
                     "engine time per iteration outside the target's forward: "
                     f"{data['profile']['step_overhead'] * 1e3:.2f} ms "
                     f"({data['profile']['step_overhead'] / costs[1]:.2f} × t_target(1))")
    return "\n".join(lines) + "\n"


DEFAULT = "default (auto)"
FIXED = ("chain", "tree", "staged", "lookup", "ngram")  # strategy families with a fixed shape


def overview(data: dict) -> list[str]:
    """One line per suite and mode: the default against the best fixed strategy and the best peer."""
    lines = ["| suite | mode | default | best fixed strategy | best peer | "
             "greedy runs off plain | the default drafted |",
             "|---|---|---|---|---|---|---|"]
    family = {s["name"]: s["family"] for s in data["strategies"]}
    for name, part in data["suites"].items():
        for mode, rows in part["summary"].items():
            best = lambda kinds: max(((r["speedup"], s) for s, r in rows.items()
                                      if family[s] in kinds and r["speedup"]), default=None)
            fixed, peer = best(FIXED), best(("peer",))
            off = sum(len(v) for v in part["greedy_mismatches"].values()) if mode == "greedy" else "–"
            lines.append(f"| {name} | {mode} | {_cell(rows.get(DEFAULT, {}), 'speedup', '{:.2f}×')} | "
                         + (f"{fixed[1]}: {fixed[0]:.2f}× | " if fixed else "– | ")
                         + (f"{peer[1]}: {peer[0]:.2f}× | " if peer else "– | ")
                         + f"{off} | {_choices(rows[DEFAULT]) if DEFAULT in rows else '–'} |")
    return lines


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if key == "weight_bytes_per_token" and value is not None:
        value /= 1e6
    return "–" if value is None else fmt.format(value)


def _choices(row: dict) -> str:
    """What proposed the default's drafts, as shares of iterations, and their mean depth."""
    shares = ", ".join(f"{label} {share:.0%}" for label, share in (row.get("drafted_by") or {}).items())
    depth = f"; mean depth {row['mean_depth']:.1f}" if row.get("mean_depth") is not None else ""
    return (shares or "nothing") + depth


def write_report(data: dict, out: str | Path) -> list[Path]:
    """bench.json, bench.md and the plots; returns the paths written."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "bench.md").write_text(markdown(data))
    return [out / "bench.json", out / "bench.md", *plots(data, out)]


def plots(data: dict, out: Path) -> list[Path]:
    """Per suite: speedups by strategy, speedup against γ, acceptance by position, accepted
    lengths ({suite}-*.png); and the target's forward cost curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    for suite, part in data["suites"].items():
        suite_plots(plt, save, suite, part["summary"], data["strategies"])
    if len(data["suites"]) > 1:
        suites_plot(plt, save, data)

    # the forward cost curve
    fig, ax = plt.subplots(figsize=(6, 4))
    costs = data["costs"]["target"]
    ks = sorted(costs)
    ax.plot(ks, [costs[k] / costs[ks[0]] for k in ks], "o-")
    ax.set_xlabel("new tokens k in one target forward")
    ax.set_ylabel("t_target(k) / t_target(1)")
    ax.set_title("Target forward cost by batch of new tokens")
    save(fig, "forward_cost.png")
    return written


def suites_plot(plt, save, data: dict) -> None:
    """suites.png: per mode, the default's speedup beside the best fixed strategy's and the best peer's,
    suite by suite."""
    family = {s["name"]: s["family"] for s in data["strategies"]}
    modes = list(next(iter(data["suites"].values()))["summary"])
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        names = list(data["suites"])
        for offset, (label, chosen) in enumerate((("default", lambda s: s == DEFAULT),
                                                  ("best fixed", lambda s: family[s] in FIXED),
                                                  ("best peer", lambda s: family[s] == "peer"))):
            # an interrupted run may lack a later suite's mode
            values = [max((r["speedup"] or 0 for s, r in data["suites"][n]["summary"].get(mode, {}).items()
                           if chosen(s)), default=0) for n in names]
            ax.bar([i + (offset - 1) * 0.27 for i in range(len(names))], values, width=0.27, label=label)
        ax.axhline(1, color="black", lw=0.8)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("× plain tokens/s (median per prompt)")
        ax.set_title(f"{mode}: speedup by workload")
        ax.legend(fontsize=8)
    save(fig, "suites.png")


def suite_plots(plt, save, suite: str, summary: dict, strategies: list[dict]) -> None:
    modes = list(summary)

    # 1. speedup by strategy
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = summary[mode]
        names = list(rows)
        medians = [rows[n]["speedup"] or 0 for n in names]
        spread = [[m - (rows[n].get("speedup_iqr") or [m, m])[0] for n, m in zip(names, medians)],
                  [(rows[n].get("speedup_iqr") or [m, m])[1] - m for n, m in zip(names, medians)]]
        ax.barh(names, medians, xerr=spread, capsize=2,
                color=["tab:gray" if "HF" in n or "llama" in n else "tab:blue" for n in names])
        ax.axvline(1, color="black", lw=0.8)
        ax.invert_yaxis()
        ax.set_title(f"{suite} · {mode}: speedup vs plain (median per prompt, bars: IQR)", fontsize=10)
        ax.set_xlabel("× plain tokens/s")
    save(fig, f"{suite}-speedup.png")

    # 2. measured and predicted speedup vs γ (fixed-γ chains)
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        chain = [(s["gamma"], s["name"]) for s in strategies if s["family"] == "chain" and isinstance(s["gamma"], int)]
        rows = summary[mode]
        if chain:
            gammas = [g for g, _ in chain]
            ax.plot(gammas, [rows[n]["speedup"] for _, n in chain], "o-", label="measured")
            ax.plot(gammas, [rows[n]["predicted_speedup"] for _, n in chain], "s--",
                    label="predicted (measured tokens/iteration, costs)")
            ax.plot(gammas, [rows[n]["predicted_speedup_iid_alpha"] for _, n in chain], "^:",
                    label="predicted (i.i.d. α formula, costs)")
            ax.axhline(1, color="black", lw=0.8)
            ax.legend()
        ax.set_title(f"{suite} · {mode}: speedup vs γ")
        ax.set_xlabel("γ (draft tokens per iteration)")
    save(fig, f"{suite}-speedup_vs_gamma.png")

    # 3. acceptance by draft position, 4. accepted-length histogram
    for name, key in (("acceptance_by_position.png", "acceptance_by_position"),
                      ("accepted_lengths.png", "accepted_length_counts")):
        fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            for strategy, row in summary[mode].items():
                values = row[key]
                if not values:
                    continue
                if key == "acceptance_by_position":
                    ax.plot(range(1, len(values) + 1), values, "o-", label=strategy)
                    ax.set_xlabel("draft position")
                    ax.set_ylabel("share of drafts accepted up to here")
                else:
                    lengths = sorted(int(k) for k in values)
                    total = sum(values.values())
                    ax.plot(lengths, [values[k if k in values else str(k)] / total for k in lengths], "o-",
                            label=strategy)
                    ax.set_xlabel("accepted draft tokens per iteration")
                    ax.set_ylabel("share of iterations")
            ax.set_title(f"{suite} · {mode}: {name[:-4].replace('_', ' ')}")
            ax.legend(fontsize=7)
        save(fig, f"{suite}-{name}")


def read_bench(path: str | Path) -> dict:
    """bench.json back into run_bench's shape (JSON turned the integer keys into strings)."""
    data = json.loads(Path(path).read_text())
    data["costs"] = {model: {int(k): v for k, v in costs.items()} for model, costs in data["costs"].items()}
    for part in data["suites"].values():
        for rows in part["summary"].values():
            for row in rows.values():
                row["accepted_length_counts"] = {int(k): v for k, v in row["accepted_length_counts"].items()}
    return data
