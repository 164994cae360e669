"""`specdec demo`: the first run. Plain and speculative decoding side by side on the demo pair, on
work where speculation pays (an edit: the answer copies the prompt) and on work where it does not
(continuing prose), each with its speed, its tokens per target forward and whether its text is
plain decoding's."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

from specdec.cli.arguments import add_runtime_arguments, decoder_config
from specdec.errors import SpecDecError

ROUNDS = 2  # timed runs of each decoder per task, interleaved (plain, specdec, plain, specdec)
SEED = 0


@dataclass(frozen=True)
class Work:
    suite: str  # the bench suite whose first task it runs (`specdec.bench.suites`)
    label: str
    temperature: float  # 0: greedy; else sampled with SEED, whose text is plain decoding's with that seed


WORK = (Work("edit", "edit a function (the answer copies the prompt), greedy", 0.0),
        Work("complete", "write a new function (nothing to copy), sampled at T 0.8", 0.8))


def add_parser(commands) -> None:
    demo = commands.add_parser(
        "demo", help="see what specdec does: plain and speculative decoding side by side on the demo pair",
        description="Greedy plain decoding and the default speculative decoder on the demo pair (a code model and "
                    "its draft, shipped with specdec), on an edit, where speculation pays, and on prose, where it "
                    "does not: tokens per second, tokens per target forward, and whether each text is plain "
                    "decoding's. Under a minute on 2 cores, the first time included.")
    demo.add_argument("--max-new-tokens", type=int, default=96, help="tokens per run (default 96)")
    add_runtime_arguments(demo)
    demo.set_defaults(run=run_demo)


@dataclass
class Row:
    """One task's runs: both decoders' tokens per second (median over rounds), and specdec's figures."""

    work: str
    plain: float
    specdec: float
    tokens_per_forward: float
    same_text: bool
    first_difference: int | None  # the first generated token where specdec's text left plain decoding's

    @property
    def speedup(self) -> float:
        return self.specdec / self.plain


def run_demo(args) -> None:
    if args.max_new_tokens < 8:
        raise SpecDecError("--max-new-tokens must be at least 8 for the speeds to mean something")
    # every run computes its prompt and drafts from nothing it saw before (no prefix cache, no history of
    # earlier runs, which would copy the same prompt's last output): the speeds compare decoding alone
    config = decoder_config(args, prefix_cache=0, history_tokens=0)
    from specdec.bench.suites import suite_tasks
    from specdec.build import build_decoder
    from specdec.decoder import SpeculativeDecoder

    print("specdec demo: loading the demo pair", file=sys.stderr)
    specdec = build_decoder(config)
    plain = SpeculativeDecoder(specdec.target, None, prefix_cache=0)
    target = specdec.target
    print(f"target: {target.describe()} · draft: {specdec.draft_model.describe()}", file=sys.stderr)
    rows = [race(work, next(suite_tasks(work.suite)).text, plain, specdec, args.max_new_tokens) for work in WORK]
    print(format_rows(rows, args.max_new_tokens))


def race(work: Work, prompt: str, plain, specdec, max_new_tokens: int) -> Row:
    """Both decoders on one prompt: one untimed run each, then ROUNDS timed ones, interleaved."""
    runs = {"plain": [], "specdec": []}
    seed = SEED if work.temperature else None
    for round_ in range(ROUNDS + 1):
        for name, decoder in (("plain", plain), ("specdec", specdec)):
            result = decoder.generate(prompt, max_new_tokens=max_new_tokens, temperature=work.temperature, seed=seed)
            if round_:  # the first of each warms caches and graphs
                runs[name].append(result)
    reference, ours = runs["plain"][-1].tokens, runs["specdec"][-1].tokens
    first = next((i for i, (a, b) in enumerate(zip(reference, ours)) if a != b),
                 None if len(reference) == len(ours) else min(len(reference), len(ours)))
    speed = {name: statistics.median(r.stats.tokens_per_second for r in results) for name, results in runs.items()}
    forwards = statistics.median(r.stats.tokens_per_target_forward for r in runs["specdec"])
    return Row(work.label, speed["plain"], speed["specdec"], forwards, first is None, first)


def format_rows(rows: list[Row], max_new_tokens: int) -> str:
    lines = [f"{max_new_tokens} new tokens, median of {ROUNDS} runs each, interleaved:", "",
             "| work | plain tok/s | specdec tok/s | speed-up | tokens per target forward | text identical to plain |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        same = "yes" if row.same_text else f"no: from token {row.first_difference} (see below)"
        lines.append(f"| {row.work} | {row.plain:.0f} | {row.specdec:.0f} | {row.speedup:.2f}× | "
                     f"{row.tokens_per_forward:.2f} | {same} |")
    lines += ["", "Plain decoding makes one target forward per token. specdec drafts tokens (prompt lookup, the draft "
              "model) and verifies them in one target forward, keeping exactly the target's output (sampled with a "
              f"seed, {SEED} here, its text is plain decoding's with that seed); where nothing copies and the draft "
              "guesses poorly, its cost-aware policy drafts little. Your own models: `specdec generate PROMPT --target "
              "T.gguf --draft D.gguf`; your own work: `specdec bench`."]
    if not all(row.same_text for row in rows):
        lines += ["", "A text that is not plain decoding's: llama.cpp's numerics move with the batch shape (a verify "
                  "of k tokens rounds differently from k one-token forwards), which can tip a near-tie of the greedy "
                  "choice. --batch-invariant makes them equal at a cost; docs/backends.md, \"Numerics\"."]
    return "\n".join(lines)
