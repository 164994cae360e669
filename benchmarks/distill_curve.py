"""Plot a distillation's held-out agreement and loss against training step and wall time.

    python benchmarks/distill_curve.py DRAFT_DIR [--out benchmarks/distill/gemma_distill.png]

DRAFT_DIR is what `specdec train --distill-from TARGET -o DRAFT_DIR` wrote; its distill.json has the
history (every --eval-every steps) and the time each stage took.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("draft", help="the distilled draft's directory")
    parser.add_argument("--out", default="benchmarks/distill/gemma_distill.png")
    args = parser.parse_args()
    report = json.loads((Path(args.draft) / "distill.json").read_text())
    history, stages = report["history"], report["stages"]
    steps = [h["step"] for h in history]
    minutes_per_step = stages["train"]["seconds"] / 60 / report["steps"]
    before_training = (stages["corpus"]["seconds"] + stages["generate"]["seconds"]) / 60
    fig, (agree, loss) = plt.subplots(1, 2, figsize=(10, 4))
    agree.plot(steps, [h["heldout_agreement"] for h in history], "o-")
    agree.set_xlabel("training step")
    agree.set_ylabel("held-out agreement with the target's greedy choice")
    top = agree.secondary_xaxis("top", functions=(lambda s: before_training + s * minutes_per_step,
                                                  lambda m: (m - before_training) / minutes_per_step))
    top.set_xlabel("minutes since the command started (corpus and generations first)")
    agree.grid(alpha=0.3)
    loss.plot(steps, [h["train_loss"] for h in history], "o-", color="tab:orange")
    loss.set_xlabel("training step")
    loss.set_ylabel("training loss (KL to the target's top-k + corpus CE)")
    loss.grid(alpha=0.3)
    fig.suptitle(f"distilled draft: {report['parameters'] / 1e6:.1f}M parameters, {report['vocabulary']['draft']} of "
                 f"{report['vocabulary']['target']} tokens")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
