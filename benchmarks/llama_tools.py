"""Run llama.cpp's own command-line programs on a prompt and parse their speed.

The programs are built by ``benchmarks/build_llama_cpp_tools.sh`` from the llama.cpp source
vendored in llama-cpp-python's sdist (the same llama.cpp the installed ``llama_cpp`` uses).
This module is meant for benchmark scripts that compare them with specdec::

    import llama_tools
    from specdec.demo import demo_gguf
    if llama_tools.available():
        run = llama_tools.run_tool("draft-simple", "def fibonacci(n):", 64, threads=1,
                                   target=str(demo_gguf("target")), draft=str(demo_gguf("draft")))
        print(run.tokens_per_second, run.accepted, run.drafted)

``python benchmarks/llama_tools.py --check`` runs every kind once and prints the results.

Kinds and programs (llama.cpp as vendored in llama-cpp-python 0.3.36):

* ``plain``        llama-completion (llama-cli in this tree is the chat UI, built only with the
                   server): ``-no-cnv --no-display-prompt --simple-io`` = no conversation mode, no
                   chat template, the prompt is not echoed.
* ``draft-simple`` llama-speculative-simple ``-md DRAFT --spec-type draft-simple`` (greedy
                   drafting by the draft model; the target samples and keeps the matching prefix).
* ``speculative``  llama-speculative ``-md DRAFT`` (one draft sequence; with temperature > 0 it
                   does stochastic speculative sampling, i.e. rejection sampling).
* ``lookup``       llama-lookup (prompt-lookup / n-gram drafting from the context only: no
                   ``-lcs``/``-lcd`` cache files are passed, so runs do not influence each other).

All kinds get ``-n N -t T -tb T -c 1024 --color off`` and ``--ignore-eos`` (default, see
``run_tool``); the draft-model kinds also get ``-td T -tbd T`` (draft threads) and all
speculative kinds ``--spec-draft-n-max K`` (p_min keeps its default 0.0, so drafts are always K
long). Greedy is ``--temp 0`` (llama.cpp's temp sampler takes the argmax when temp <= 0);
sampled runs pass ``--temp T --top-k K --top-p 1.0 --min-p 0.0 --seed S``, so the chain is
plain temperature + top-k (top_k 0 = whole vocabulary; the other default samplers, penalties,
DRY, typical, XTC, top-n-sigma, are no-ops at their defaults). ``--no-warmup`` is NOT passed:
the warmup happens at load time, outside every timed region, and keeps first-touch costs out of
the prompt/decode timings.

What is timed (all numbers are the tool's own printout on stderr; stdout carries only text):

* plain: ``common_perf_print: eval time = 218.32 ms / 63 runs (3.47 ms per token, 288.57 tokens
  per second)``: the summed llama_decode time of the single-token decodes after the prompt.
  It excludes sampling (reported separately, ~1% here) and printing. There are n_predict - 1
  runs: the first token is sampled from the prompt's logits, the last is printed, not decoded.
* draft-simple / speculative / lookup: ``decoded   69 tokens in    0.249 seconds, speed:  277.154
  t/s``: wall clock of the whole generation loop (draft, verify, sampling, printing), after the
  prompt ("encoded ..."). The count overshoots n_predict by up to draft_n_max + 1 tokens (the loop
  stops once it has *more* than n_predict), and ``text`` holds all of them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("LLAMA_TOOLS_BIN", ROOT / "llama.cpp-src" / "build" / "bin"))

PROGRAMS = {
    "plain": "llama-completion",
    "draft-simple": "llama-speculative-simple",
    "speculative": "llama-speculative",
    "lookup": "llama-lookup",
}
CONTEXT = 1024  # the demo pair's context length; prompt + n_predict (+ draft) must fit
TIMEOUT_S = 300


@dataclass
class ToolRun:
    name: str                 # kind, e.g. "draft-simple"
    tokens: int               # tokens of the decode phase, as the tool counts them
    seconds: float            # decode-phase seconds, as the tool reports them
    tokens_per_second: float  # tokens / seconds
    text: str                 # generated text, without the prompt
    accepted: int | None      # n_accept (speculative kinds), else None
    drafted: int | None       # n_drafted (speculative kinds), else None


def available() -> bool:
    """True when every program used by run_tool has been built into BIN."""
    return all((BIN / p).is_file() and os.access(BIN / p, os.X_OK) for p in PROGRAMS.values())


# --- regexes, written against this version's output (stderr lines carry a "0.00.314.383 I "
# timestamp/level prefix, so none of them is anchored at the line start) ---
# llama-completion, common_perf_print (common/sampling.cpp):
#   common_perf_print:        eval time =     218.32 ms /    63 runs   (    3.47 ms per token,   288.57 tokens per second)
EVAL_RE = re.compile(r"common_perf_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs")
# llama-speculative-simple, llama-speculative, llama-lookup (examples/*/*.cpp):
#   decoded   69 tokens in    0.249 seconds, speed:  277.154 t/s
DECODED_RE = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+(\S+) t/s")
#   n_drafted = 84          (llama-lookup pads: "n_drafted    = 57")
#   n_accept  = 48
DRAFTED_RE = re.compile(r"\bn_drafted\s+=\s+(\d+)")
ACCEPT_RE = re.compile(r"\bn_accept\s+=\s+(\d+)")


def _command(kind, prompt, n_predict, threads, target, draft, temperature, top_k, seed,
             draft_n_max, ignore_eos, context=CONTEXT):
    if kind not in PROGRAMS:
        raise ValueError(f"kind must be one of {sorted(PROGRAMS)}, not {kind!r}")
    cmd = [str(BIN / PROGRAMS[kind]), "-m", str(target), "-p", prompt, "-n", str(n_predict),
           "-t", str(threads), "-tb", str(threads), "-c", str(context), "--color", "off"]
    if temperature == 0:
        cmd += ["--temp", "0"]
    else:
        cmd += ["--temp", str(temperature), "--top-k", str(top_k), "--top-p", "1.0",
                "--min-p", "0.0", "--seed", str(seed)]
    if ignore_eos:
        cmd += ["--ignore-eos"]
    if kind == "plain":
        cmd += ["-no-cnv", "--no-display-prompt", "--simple-io"]
        return cmd
    cmd += ["--spec-draft-n-max", str(draft_n_max)]
    if kind in ("draft-simple", "speculative"):
        if draft is None:
            raise ValueError(f"kind {kind!r} needs a draft model")
        cmd += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        if kind == "draft-simple":
            cmd += ["--spec-type", "draft-simple"]
    return cmd


@lru_cache(maxsize=None)
def _eos_piece(model: str) -> str | None:
    """The EOS token's text, read from the GGUF (None when the gguf package is missing)."""
    try:
        import gguf
        fields = gguf.GGUFReader(model).fields
        eos = fields["tokenizer.ggml.eos_token_id"]
        tokens = fields["tokenizer.ggml.tokens"]
        eos_id = int(eos.parts[eos.data[0]][0])
        return bytes(tokens.parts[tokens.data[eos_id]]).decode("utf-8", "replace")
    except Exception:
        return None


def _generated_text(kind: str, prompt: str, stdout: str, eos_piece: str | None) -> str:
    """Cut the generated text out of the tool's stdout.

    llama-completion (--no-display-prompt) prints  GENERATED + ["" or " [end of text]\\n"] + "\\n\\n".
    The three example programs print  "\\n\\n" + PROMPT + GENERATED + "\\n\\n" + "\\n\\n", where PROMPT
    is the detokenized prompt (equal to ``prompt`` for this tokenizer: no BOS, lossless).
    llama-speculative and llama-lookup print the EOS piece (e.g. "<|endoftext|>") when they stop on
    EOS (only possible without --ignore-eos); it is removed. llama-speculative-simple does not.
    """
    if kind == "plain":
        text = stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")
        return text
    text = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if eos_piece:
        text = text.removesuffix(eos_piece)
    if text.startswith(prompt):
        return text[len(prompt):]
    # A tokenizer that does not round-trip (e.g. adds a leading space) would end up here: the
    # boundary is unknown, so return the echo as well rather than guess.
    return text


def run_tool(kind: str, prompt: str, n_predict: int, threads: int, target: str,
             draft: str | None = None, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             draft_n_max: int = 4, ignore_eos: bool = True, context: int = CONTEXT) -> ToolRun:
    """Run one llama.cpp program (see the module docstring for kinds and flags) and parse it.

    ignore_eos (default True, passed to every kind) makes all runs generate about n_predict
    tokens, so their speeds cover the same length; set it False to stop at EOS like specdec
    does when comparing texts that might contain EOS. context: KV cells (-c), prompt and new
    tokens included.
    """
    cmd = _command(kind, prompt, n_predict, threads, target, draft, temperature, top_k, seed,
                   draft_n_max, ignore_eos, context)
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = b"".join(x if isinstance(x, bytes) else x.encode() for x in (e.stdout, e.stderr) if x)
        raise RuntimeError(f"{PROGRAMS[kind]} timed out after {TIMEOUT_S} s: {cmd}\n"
                           f"--- output tail ---\n{out.decode(errors='replace')[-3000:]}") from e
    except FileNotFoundError as e:
        raise RuntimeError(f"{cmd[0]} not found: run benchmarks/build_llama_cpp_tools.sh") from e
    log = proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{PROGRAMS[kind]} exited with {proc.returncode}: {cmd}\n"
                           f"--- output tail ---\n{(proc.stdout + log)[-3000:]}")

    accepted = drafted = None
    if kind == "plain":
        m = EVAL_RE.search(log)
        if m:
            seconds, tokens = float(m.group(1)) / 1e3, int(m.group(2))
    else:
        m = DECODED_RE.search(log)
        if m:
            tokens, seconds = int(m.group(1)), float(m.group(2))
        a, d = ACCEPT_RE.search(log), DRAFTED_RE.search(log)
        accepted = int(a.group(1)) if a else None
        drafted = int(d.group(1)) if d else None
    if not m:
        raise RuntimeError(f"could not find the timing line in {PROGRAMS[kind]}'s output: {cmd}\n"
                           f"--- output tail ---\n{log[-3000:]}")
    return ToolRun(name=kind, tokens=tokens, seconds=seconds,
                   tokens_per_second=tokens / seconds if seconds > 0 else float("inf"),
                   text=_generated_text(kind, prompt, proc.stdout,
                                        None if ignore_eos else _eos_piece(str(target))),
                   accepted=accepted, drafted=drafted)


def _check(args) -> int:
    if not available():
        print(f"llama.cpp tools not built in {BIN}: run benchmarks/build_llama_cpp_tools.sh",
              file=sys.stderr)
        return 1
    print(f"bin: {BIN}")
    print(f"load: {os.getloadavg()}")
    for kind in PROGRAMS:
        for temperature in (0.0, args.temperature) if args.sampled else (0.0,):
            t0 = time.perf_counter()
            run = run_tool(kind, args.prompt, args.n_predict, args.threads, args.target,
                           args.draft, temperature=temperature, top_k=args.top_k, seed=args.seed,
                           draft_n_max=args.draft_n_max)
            wall = time.perf_counter() - t0
            print(f"\n== {kind} (temp {temperature}, process wall {wall:.2f} s)")
            print(f"ToolRun(name={run.name!r}, tokens={run.tokens}, seconds={run.seconds:.4f}, "
                  f"tokens_per_second={run.tokens_per_second:.1f}, accepted={run.accepted}, "
                  f"drafted={run.drafted})")
            print(f"text: {run.text!r}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="run each kind once and print results")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--n-predict", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--target", help="default: the demo pair's target (specdec.demo.demo_gguf)")
    p.add_argument("--draft", help="default: the demo pair's draft")
    p.add_argument("--draft-n-max", type=int, default=4)
    p.add_argument("--sampled", action="store_true", help="--check: also one sampled run each")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.check:
        p.print_help()
        return 0
    if args.target is None or args.draft is None:
        from specdec.demo import demo_gguf

        args.target, args.draft = args.target or str(demo_gguf("target")), args.draft or str(demo_gguf("draft"))
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
