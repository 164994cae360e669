"""The prepared GPU check (issue 31): one device call, each section with its own time limit, every
result written to $OUT as soon as it is known (summary.md, one JSON per section).

    bash benchmarks/gpu_call.sh              # on the GPU machine (how to carry it: that file)
    SMALL=1 DEVICE=cpu python benchmarks/gpu.py   # the rehearsal: tiny models, the same code paths
    ONLY=3 ...                               # only the sections whose names start with 3

Sections:
1. where a step's time goes on the demo target: the eager path with and without cuDNN's attention
   (a new execution plan per key length), the static compiled path; per-token times on fresh
   context lengths, syncs per step (`torch.cuda.set_sync_debug_mode`), torch.profiler tables;
2. the demo pair on every suite's prompts: greedy equality of every strategy in float32 and bfloat16,
   tokens/s of plain (eager, compiled), HF generate on two suites, the default and the fixed strategies;
3. an 8B-shaped Llama built in memory (random weights, bf16): the memory floor, plain decoding on
   each path (transformers' forward and the fused one, both in hand-captured graphs), HF generate both
   ways, t(k)/t(1), a prediction equal to its own greedy text;
4. the server's batch: 16 greedy rows stepped together on the eager path and on the compiled pool,
   tokens/s together and rows whose text departs from their lone text;
5. last, as time allows: the 8B shape on Inductor's kernels, and HF generate with a static cache;
6. the 8B shape's one-token step kernel by kernel (torch.profiler), transformers' forward and the fused one;
7. drafting beside the 8B shape: a 1B-shaped draft model's step and an EAGLE-3 head's level against the
   target's, and the speedups Leviathan's formula gives for acceptance rates measured on the CPU;
8. every family the fused forward covers, on the device's compiled kernels: a random model of each (float32),
   its logits and greedy text against transformers' forward on the same pool, and t(1) both ways;
9. the 8B shape's one-token step at each context (cells per row), attention reading the read bucket its rows
   need and (as before read buckets) the whole row, against the bytes a row's cells hold; 16 rows at 4096.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec  # noqa: E402
from specdec.runtime.hf import HFModel  # noqa: E402
from specdec.runtime.base import Feed, synchronize  # noqa: E402
from specdec.runtime.static import BUCKETS, StaticHFModel, _Step  # noqa: E402

SMALL = os.environ.get("SMALL") == "1"
DEVICE = os.environ.get("DEVICE", "cuda")
OUT = Path(os.environ.get("OUT", "/tmp/gpu-out"))
DEADLINE = time.monotonic() + float(os.environ.get("BUDGET_S", "500"))
COMPILE = os.environ.get("COMPILE") or "graphs"  # on the CPU (SMALL) the same buffers, replayed eagerly
DEMO = Path(specdec.__file__).parent / "demo_pair"
PROFILED = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
SUMMARY: list[str] = []
SECTIONS: list = []  # (name, seconds allowed, function of its deadline), in order


def section(name: str, limit_s: float):
    def register(function):
        SECTIONS.append((name, limit_s, function))
        return function
    return register


def run_section(name: str, limit_s: float, function) -> None:
    """Run a section within min(limit_s, what is left); its failure is written, not raised."""
    left = DEADLINE - time.monotonic()
    if left < 20:
        note(f"## {name}: skipped ({left:.0f} s left)")
        return
    started = time.monotonic()
    try:
        result = function(started + min(limit_s, left))
        (OUT / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    except Exception:
        note(f"## {name}: failed\n```\n{traceback.format_exc()[-3000:]}\n```")
    note(f"({name}: {time.monotonic() - started:.0f} s)")


def note(text: str) -> None:
    print(text, flush=True)
    SUMMARY.append(text)
    (OUT / "summary.md").write_text("\n\n".join(SUMMARY) + "\n")


def load(path, compile: str, dtype: str = "bfloat16", plain: bool = True, **options):
    dtype = "float32" if SMALL else dtype
    return specdec.load(str(path), backend="transformers", device=DEVICE, dtype=dtype, compile=compile, plain=plain, **options)


def per_token(decoder, prompt: list[int], new: int) -> tuple[float, list[int]]:
    seconds, result = timed(decoder, prompt, new)
    return seconds, result.tokens


def timed(decoder, prompt: list[int], new: int):
    """(seconds per generated token, the generation's result), greedy."""
    synchronize(DEVICE)
    started = time.perf_counter()
    result = decoder.generate(prompt, max_new_tokens=new, temperature=0)
    synchronize(DEVICE)
    return (time.perf_counter() - started) / max(1, len(result.tokens)), result


def hf_generate(model: HFModel, prompt: list[int], new: int, **options) -> float:
    ids = torch.tensor([prompt], device=model.device)
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                temperature=None, top_p=None, top_k=None, pad_token_id=0, **options)
    with torch.inference_mode():
        model.model.generate(ids, **args)  # warm-up (and compile, for a static cache)
        synchronize(DEVICE)
        started = time.perf_counter()
        model.model.generate(ids, **args)
        synchronize(DEVICE)
    return (time.perf_counter() - started) / new


def syncs_per_step(decoder, prompt: list[int], new: int) -> float | None:
    """Host waits per iteration on the device, counted by CUDA's sync debug mode."""
    if DEVICE != "cuda":
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = decoder.generate(prompt, max_new_tokens=new, temperature=0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncing = [w for w in caught if "synchroniz" in str(w.message).lower()]
    steps = result.stats.target_forwards
    return len(syncing) / max(1, steps)


def fresh_prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(7 * i + 3 + n) % vocab for i in range(n)] for n in lengths]


@section("1-demo-step-profile", 120)
def demo_profile(until: float) -> dict:
    new = 8 if SMALL else 48
    results = {}
    target = DEMO / "target"
    prompts = fresh_prompts(8192, (40, 300) if not SMALL else (20,))
    for label, compile, cudnn in (("eager, cuDNN attention", "off", True), ("eager", "off", False), (f"static, {COMPILE}", COMPILE, False)):
        if time.monotonic() > until:
            break
        started = time.perf_counter()
        decoder = load(target, compile)  # a static pool's shapes compiled as it is built
        results[f"{label}: load and warm-up s"] = round(time.perf_counter() - started, 2)
        torch.backends.cuda.enable_cudnn_sdp(cudnn)  # load() turned it off for the eager path
        for prompt in prompts:  # every length new to this process: what decoding meets
            seconds, _ = per_token(decoder, prompt, new)
            results[f"{label}: ms/token after {len(prompt)}"] = round(seconds * 1e3, 2)
        results[f"{label}: syncs/step"] = syncs_per_step(decoder, prompts[0], 16)
        with torch.profiler.profile(activities=PROFILED) as profile:
            decoder.generate(fresh_prompts(8192, (61,))[0], max_new_tokens=16, temperature=0)
            synchronize(DEVICE)
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50)
        with open(OUT / "profiles.txt", "a") as tables:  # one file: the call brings back at most 8
            tables.write(f"## {label}\n{table}\n")
    torch.backends.cuda.enable_cudnn_sdp(False)
    note("## 1. Demo target, one step\n" + "\n".join(f"- {k}: {v}" for k, v in results.items()))
    return results


# the suites whose rows also time the baselines (eager, unfused, HF generate); the rest time plain and the strategies
BASELINE_SUITES = ("complete", "edit")


@section("2-demo-pair-suites", 190)
def demo_suites(until: float) -> dict:
    """Every suite, float32 then bfloat16 (each dtype its share of the time): plain decoding and each
    strategy, greedy, and the issue's targets read off: the default against plain and the best fixed strategy."""
    from specdec.bench.suites import SUITES, suite_tasks

    new = 16 if SMALL else 96
    tokenizer = load(DEMO / "target", "off").tokenizer
    prompts = {suite: [_ids(tokenizer, task) for task, _ in zip(suite_tasks(suite), range(2 if SMALL else 4))]
               for suite in SUITES}
    rows, equal, stats, profiles = {}, {}, {}, {}
    for n, dtype in enumerate(("float32", "bfloat16")):
        share = time.monotonic() + (until - time.monotonic()) / (2 - n)
        plain_eager, plain_static = load(DEMO / "target", "off", dtype), load(DEMO / "target", COMPILE, dtype)
        unfused_model = load(DEMO / "target", "off", dtype).target
        plain_unfused = specdec.SpeculativeDecoder(StaticHFModel(unfused_model.model, unfused_model.tokenizer, "demo target",
                                                                 backend=COMPILE, fused=False))
        strategies = demo_strategies(plain_static.target, dtype)
        plain_static.target.warm_up()
        plain_unfused.target.warm_up()
        strategies["chain 4"].drafter.model.warm_up(tokens=(1, 4, 16))
        for suite, ids in prompts.items():
            for prompt in ids:
                if time.monotonic() > share:
                    break
                eager_s, want = per_token(plain_eager, prompt, new)
                static_s, got = per_token(plain_static, prompt, new)
                row = rows.setdefault(f"{dtype} {suite}", {"plain eager": [], "plain compiled": [],
                                                           "plain compiled, unfused": [], "HF generate": []})
                row["plain eager"].append(eager_s)
                row["plain compiled"].append(static_s)
                if suite in BASELINE_SUITES:
                    row["plain compiled, unfused"].append(per_token(plain_unfused, prompt, new)[0])
                    row["HF generate"].append(hf_generate(plain_eager.target, prompt, new))
                equal.setdefault(f"{dtype} compiled plain = eager plain", []).append(got == want)
                for name, decoder in strategies.items():
                    seconds, result = timed(decoder, prompt, new)
                    tokens = result.tokens
                    row.setdefault(name, []).append(seconds)
                    stats.setdefault(f"{dtype} {suite}, {name}", []).append(result.stats)
                    equal.setdefault(f"{dtype} {name} = eager plain", []).append(tokens == want)
                    equal.setdefault(f"{dtype} {name} = compiled plain", []).append(tokens == got)
        profiles[dtype] = what_the_default_read(strategies["default"])
    speeds = {key: {name: 1 / statistics.median(times) for name, times in row.items() if times} for key, row in rows.items()}
    columns = list(dict.fromkeys(name for row in rows.values() for name in row))
    table = ["| dtype, suite | " + " | ".join(columns) + " | default / plain | default / best fixed |",
             "| --- |" + " ---: |" * (len(columns) + 2)]
    for key, speed in speeds.items():
        fixed = max(speed[name] for name in speed if name in FIXED)
        table.append(f"| {key} | " + " | ".join(f"{speed[c]:.0f}" if c in speed else "-" for c in columns)
                     + f" | {speed['default'] / speed['plain compiled']:.2f} | {speed['default'] / fixed:.2f} |")
    equality = {k: f"{sum(v)}/{len(v)}" for k, v in equal.items()}
    drafting = {key: drafting_of(each) for key, each in stats.items()}
    note("## 2. Demo pair, tokens/s (median over prompts)\n" + "\n".join(table) + "\n\ngreedy equality (prompts equal / prompts): "
         + json.dumps(equality) + "\n\nhow each strategy drafted: " + json.dumps(drafting, indent=1)
         + "\n\nthe cost profile it decided by (t(k)/t(1), draft d(k)/t(1)): " + json.dumps(profiles, indent=1))
    return {"tokens_per_s": {k: {n: [1 / s for s in v] for n, v in r.items()} for k, r in rows.items()}, "greedy_equal": equality,
            "drafting": drafting, "profiles": profiles}


def drafting_of(stats_list) -> dict:
    """What a strategy drafted over a suite's prompts: tokens per verify, its iterations' sources, and
    where an iteration's time went (ms: drafting, the verify, the rest)."""
    from collections import Counter

    tokens = sum(s.generated_tokens for s in stats_list)
    iterations = max(1, sum(s.iterations for s in stats_list))
    sources = Counter(source for s in stats_list for source in s.drafters)
    draft, verify = (sum(getattr(s, f) for s in stats_list) * 1e3 / iterations for f in ("draft_seconds", "verify_seconds"))
    rest = sum(s.total_seconds - s.prefill_seconds for s in stats_list) * 1e3 / iterations - draft - verify
    return {"tokens per verify": round(tokens / max(1, sum(s.target_forwards for s in stats_list)), 2),
            "draft forwards": sum(s.draft_forwards for s in stats_list), "iterations by source": dict(sources.most_common(4)),
            "ms per iteration: draft, verify, rest": [round(draft, 3), round(verify, 3), round(rest, 3)]}


def what_the_default_read(decoder) -> dict:
    """The measured profile the default's policy used: t(k)/t(1), d(k)/t(1), overheads / t(1)."""
    from specdec import profiling

    profile = profiling.profile(decoder.target, decoder.drafter.draft_model)
    one = profile.target[1]
    return {"t(1) ms": round(one * 1e3, 3), "t(k)/t(1)": {k: round(v / one, 2) for k, v in profile.target.items()},
            "d(k)/t(1)": {k: round(v / one, 2) for k, v in (profile.draft or {}).items()},
            "step overhead / t(1)": round(profile.step_overhead / one, 2),
            "level overhead / t(1)": round(profile.level_overhead / one, 2), "load": profile.load}


FIXED = ("chain 4", "tree 8", "prompt lookup")  # demo_strategies' fixed ones, which the default must come near


def demo_strategies(target, dtype: str) -> dict:
    """Decoders over one compiled target (one set of graphs), drafting with the compiled demo draft."""
    from specdec import AutoDrafter, ModelDrafter, PromptLookupDrafter, SpeculativeDecoder, TreeShape
    from specdec.runtime import load_model

    draft = load_model(DEMO / "draft", device=DEVICE, dtype="float32" if SMALL else dtype, compile=COMPILE)
    return {"default": SpeculativeDecoder(target, AutoDrafter(ModelDrafter(draft), PromptLookupDrafter()), "auto"),
            "chain 4": SpeculativeDecoder(target, ModelDrafter(draft), 4),
            "tree 8": SpeculativeDecoder(target, ModelDrafter(draft, tree=TreeShape(nodes=8)), 3),
            "prompt lookup": SpeculativeDecoder(target, PromptLookupDrafter(), 4)}


def _ids(tokenizer, task) -> list[int]:
    prompt = task.prompt_for(tokenizer)
    return prompt if isinstance(prompt, list) else tokenizer.encode(prompt)


@section("4-demo-server-batch", 80)
def server_batch(until: float) -> dict:
    """16 greedy generations stepped together (what the server's batcher does) on the compiled pool,
    against each alone: tokens/s together, and how many rows' texts depart from their lone text."""
    from specdec.engine import Engine

    new, clients = (8, 4) if SMALL else (96, 16)
    results = {}
    for label, compile in (("eager", "off"), ("compiled", COMPILE)):
        if time.monotonic() > until:
            break
        started = time.perf_counter()
        decoder = load(DEMO / "target", compile, slots=clients)  # every batch bucket up to the clients compiled
        results[f"{label}: load and warm-up s"] = round(time.perf_counter() - started, 2)
        prompts = fresh_prompts(8192, tuple(24 + 7 * i for i in range(clients)))
        lone = [decoder.generate(p, max_new_tokens=new, temperature=0).tokens for p in prompts]
        engine, generations = Engine(decoder.target, None), [decoder.request(p, max_new_tokens=new, temperature=0) for p in prompts]
        for generation in generations:
            generation.open(engine)
        synchronize(DEVICE)
        started = time.perf_counter()  # after the prompts: what is timed is the rows' steps
        while any(not g.done for g in generations):
            live = [g for g in generations if not g.done]
            for generation, result in zip(live, engine.step([g.state for g in live])):
                generation.add(result)
        synchronize(DEVICE)
        seconds = time.perf_counter() - started
        texts = [g.result().tokens for g in generations]
        for generation in generations:
            engine.close(generation.state)
        results[label] = {"tok/s together": (sum(map(len, texts)) - clients) / seconds,  # the first tokens came with the prompts
                          "rows equal to alone": f"{sum(t == l for t, l in zip(texts, lone))}/{clients}"}
    note("## 4. Demo target, 16 rows stepped together (bf16)\n" + json.dumps(results, indent=1))
    return results


def shaped_8b() -> tuple:
    """Llama-3-8B's shapes (untied output matrix, as Llama 3 8B's) with random weights built so that
    greedy choices are decisive, far from bfloat16's ties: token embeddings of unit scale, residual
    branches scaled by 0.05 (the stream stays near the last token's embedding), and the output row of
    each word token (a space and 3+ lowercase letters) the embedding of the word before it in a random
    cycle of them: its greedy text walks the cycle, far from any tie, and is text that tokenizes back
    into the same tokens (so a prediction of it aligns: random ids round-trip 8 tokens at a time,
    median). Other rows are zero, so HF generate never picks ids specdec does not see."""
    import re

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "target")
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=8192) if SMALL else dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    model = random_llama(shape, tied=False)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.mul_(0.05)
        embeddings, vocab = model.model.embed_tokens.weight, len(tokenizer)
        embeddings.normal_(0.0, 1.0)
        embeddings[vocab:] = 0
        words = torch.tensor([i for i in range(vocab) if re.fullmatch(r" [a-z]{3,}", tokenizer.decode([i]))])
        cycle = words[torch.randperm(len(words), generator=torch.Generator().manual_seed(0))].to(DEVICE)
        model.lm_head.weight.zero_()
        model.lm_head.weight[cycle.roll(-1)] = embeddings[cycle]  # after word cycle[i] comes cycle[i + 1]
    return model.eval(), tokenizer


_SHAPED: list = []  # the 8B-shaped model, built once (16 GB)


def shaped() -> tuple:
    if not _SHAPED:
        _SHAPED.extend(shaped_8b())
    return tuple(_SHAPED)


def eight_b_prompt() -> tuple[int, list[int]]:
    return (16, fresh_prompts(8192, (32,))[0]) if SMALL else (128, fresh_prompts(8192, (128,))[0])


@section("3-8b-shaped", 200)
def eight_b(until: float) -> dict:
    from specdec.api import SpeculativeDecoder

    model, tokenizer = shaped()
    eager = HFModel(model, tokenizer, "8B-shaped")
    new, prompt = eight_b_prompt()
    results = {"weight GB": eager.weight_bytes / 1e9, "bandwidth GB/s": read_bandwidth()}
    results["floor tok/s"] = results["bandwidth GB/s"] / results["weight GB"]
    results["HF generate tok/s"] = 1 / hf_generate(eager, prompt, new)
    seconds, text = per_token(SpeculativeDecoder(eager, None), prompt, new)
    results["specdec eager tok/s"] = 1 / seconds
    note("## 3. 8B-shaped\n" + json.dumps(results, indent=1))
    for fused in (False, True):
        if time.monotonic() < until - 30:
            results.update(static_figures(model, tokenizer, COMPILE, prompt, new, text, fused=fused))
    return results


@section("5-8b-inductor", 300)
def eight_b_inductor(until: float) -> dict:
    """Last, as time allows: Inductor's kernels on the pool, and HF generate with a static cache
    (which compiles with Inductor too): minutes of compiling each."""
    model, tokenizer = shaped()
    new, prompt = eight_b_prompt()
    results = {}
    if not SMALL:
        results["HF generate static+compiled tok/s"] = 1 / hf_generate(HFModel(model, tokenizer, "8B-shaped"), prompt, new,
                                                                      cache_implementation="static")
        note(f"- HF generate, static cache, compiled: {results['HF generate static+compiled tok/s']:.1f} tok/s")
    if time.monotonic() < until - 120:
        results.update(static_figures(model, tokenizer, "inductor", prompt, new, None, fused=False))
    return results


def static_figures(model, tokenizer, backend: str, prompt: list[int], new: int, eager_text, fused: bool,
                   buckets=BUCKETS) -> dict:
    """Plain decoding on the pool, syncs per step, t(k)/t(1) per bucket, and the default with the
    model's own greedy text predicted, against compiled plain."""
    from specdec.api import SpeculativeDecoder
    from specdec.drafters.auto import AutoDrafter
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    static = StaticHFModel(model, tokenizer, "8B-shaped", context=1024, backend=backend, fused=fused)
    backend = f"{backend}, {'fused' if fused else 'transformers forward'}"
    # every row here holds under 512 cells (a prompt of 128, 128 new; 199 + 64): the first read bucket's shapes
    results = {f"{backend}: warm-up s (512 cells read)": static.warm_up(tokens=buckets, reads=static.reads[:1])}
    plain = SpeculativeDecoder(static, None)
    seconds, text = per_token(plain, prompt, new)
    results[f"{backend}: plain tok/s"] = 1 / seconds
    if eager_text is not None:
        results[f"{backend}: plain greedy = eager plain"] = text == eager_text
    results[f"{backend}: syncs/step"] = syncs_per_step(plain, prompt, 16)
    results[f"{backend}: t(k)/t(1), k = buckets"] = verify_costs(static, buckets)
    predicted = SpeculativeDecoder(static, AutoDrafter(None, PromptLookupDrafter()))
    with_prediction = predicted.request(prompt, max_new_tokens=new, temperature=0, prediction=tokenizer.decode(text))
    synchronize(DEVICE)
    started = time.perf_counter()
    result = predicted.run(with_prediction)
    synchronize(DEVICE)
    results[f"{backend}: default with its own text predicted, x compiled plain"] = seconds * len(result.tokens) / (time.perf_counter() - started)
    results[f"{backend}: its tokens per verify"] = len(result.tokens) / max(1, result.stats.target_forwards)
    results[f"{backend}: greedy equal"] = result.tokens == text
    note(f"- {backend}: " + json.dumps(results))
    return results


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name), first match wins
    ("attention", ("fmha", "attention", "flash", "attn")),
    ("matrix products", ("gemm", "gemv", "cutlass", "sm90_", "sm80_", "splitk", "cublas", "matmul", "dot_kernel")),
    ("Inductor's fused elementwise", ("triton",)),
    ("copies and indexing", ("copy", "memcpy", "index", "scatter", "gather", "cat", "fill")),
    ("norms and reductions", ("reduce", "norm", "mean")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")),
)


@section("6-8b-kernels", 240)
def eight_b_kernels(until: float) -> dict:
    """Where a one-token step of the 8B shape goes. First each fused scope's step (`fused.SCOPES`) in graphs
    three ways (`step_parts`), which splits what is not kernels into the gaps between them and the host's
    work and says which scope the default should keep; then kernel by kernel (torch.profiler, the pool's
    forward launched eagerly: each kernel's device time is what it is inside a graph), each fused scope and,
    last (measured before, 997bfce), transformers' forward, with the weights' bytes against the matrix
    products' time."""
    from specdec.runtime.fused import SCOPES

    model, tokenizer = shaped()
    results, texts = {}, {}
    for scope in SCOPES:
        if time.monotonic() < until - 60:
            parts, texts[scope] = step_parts(fused_pool(model, tokenizer, COMPILE, scope))
            results[f"fused, {scope}: step parts"] = parts
            note(f"- 6. fused, {scope}, in graphs: " + json.dumps(parts))
    if len(texts) == len(SCOPES):
        equal = results["scopes' greedy texts equal"] = len({tuple(text) for text in texts.values()}) == 1
        note(f"- 6. the scopes' greedy texts equal: {equal}")
    kernels = {}
    for label, scope in [(f"fused, {scope}", scope) for scope in SCOPES] + [("transformers forward", None)]:
        if time.monotonic() > until - 20:
            break
        kernels[label] = step_kernels(fused_pool(model, tokenizer, "static", scope), label)
    lines = ["| kind | " + " | ".join(f"{label}: us/step, kernels/step" for label in kernels) + " |",
             "| --- |" + " ---: |" * len(kernels)]
    kinds = dict.fromkeys(kind for by_kind in kernels.values() for kind in by_kind["by kind"])
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(
            "{:.0f}, {:.0f}".format(*r["by kind"].get(kind, (0, 0))) for r in kernels.values()) + " |")
    note("## 6. 8B shape, one step's kernels\n" + "\n".join(lines) + "\n\n" + json.dumps(
        {label: {k: v for k, v in r.items() if k != "by kind"} for label, r in kernels.items()}, indent=1))
    return results | kernels


def step_kernels(static: StaticHFModel, label: str, steps: int = 8) -> dict:
    """A one-token step's kernels by kind (`kernel_kinds`), its forward launched eagerly (backend "static");
    the profiler's table appended to profiles.txt."""
    sequence = static.sequence()
    try:
        sequence.forward(fresh_prompts(8192, (128,))[0], on_device=True)
        for _ in range(3):  # warm: Inductor compiles its kernels for this shape
            sequence.forward([5], on_device=True)
        with torch.profiler.profile(activities=PROFILED) as profile:
            for _ in range(steps):
                sequence.forward([5], on_device=True)
            synchronize(DEVICE)
    finally:
        sequence.release()
    sort = "self_device_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    table = profile.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70)
    with open(OUT / "profiles.txt", "a") as tables:
        tables.write(f"## 8B shape, one-token step, {label} ({steps} steps)\n{table}\n")
    return kernel_kinds(profile, steps, static.weight_bytes)


def fused_pool(model, tokenizer, backend: str, scope: str | None) -> StaticHFModel:
    """The 8B shape's pool: transformers' forward (scope None), or the fused one compiled at `scope`
    (the same concatenated weights each time: `fused._concatenated`). On the static backend (`step_kernels`) a
    forward runs unpadded, so each new shape of a step compiles its kernels there: one-token steps only."""
    from specdec.runtime.fused import FusedForward

    static = StaticHFModel(model, tokenizer, "8B-shaped", context=1024, backend=backend, fused=scope is not None)
    if scope is not None:
        static.fused = FusedForward(model, compiled=DEVICE == "cuda", scope=scope)
    return static


def step_parts(static: StaticHFModel) -> tuple[dict, list[int]]:
    """A one-token step three ways (ms, medians): its graph replayed back to back (the kernels and the gaps
    between them: the device's part), a forward (with the host's inputs, mask and uploads before the replay
    and the logits' rows after it), and an iteration of plain decoding (with the engine's own work and the
    token's read); the warm-up, and plain decoding's greedy text."""
    from specdec.api import SpeculativeDecoder

    new, prompt = eight_b_prompt()
    parts = {"warm-up s (512 cells read)": static.warm_up(tokens=(1,), reads=static.reads[:1])}
    decoder = SpeculativeDecoder(static, None)
    iterations = []
    for _ in range(3):
        synchronize(DEVICE)
        started = time.perf_counter()
        result = decoder.generate(prompt, max_new_tokens=new, temperature=0)
        synchronize(DEVICE)
        iterations.append((time.perf_counter() - started - result.stats.prefill_seconds) / result.stats.target_forwards)
    sequence = static.sequence()
    try:
        sequence.forward(prompt, on_device=True)
        forwards = []
        for _ in range(20):
            synchronize(DEVICE)
            started = time.perf_counter()
            sequence.forward([5], on_device=True)
            synchronize(DEVICE)
            forwards.append(time.perf_counter() - started)
            sequence.truncate(len(prompt))
        # the last forward's graph: replays write its key and value past the row's count, where nothing sees them
        (shape, *_), (graph, buffer, _) = next((key, entry) for key, entry in static.runner().shapes.items()
                                               if key[0][:2] == (1, 1))
        cache = static.pool.cache(1, next(cells for cells in static.reads if cells > len(prompt)))  # the step's
        replay = graph.replay if graph is not None else lambda: static.step_forward(*_Step.views(buffer, shape), cache)
        replays = []
        for _ in range(5):
            synchronize(DEVICE)
            started = time.perf_counter()
            with torch.inference_mode():  # as the forward runs it (its buffers are inference tensors)
                for _ in range(10):
                    replay()
            synchronize(DEVICE)
            replays.append((time.perf_counter() - started) / 10)
    finally:
        sequence.release()
    parts |= {"replay ms": statistics.median(replays) * 1e3, "forward ms": statistics.median(forwards) * 1e3,
              "plain iteration ms": statistics.median(iterations) * 1e3}
    return {k: round(v, 3) for k, v in parts.items()}, result.tokens


def kernel_kinds(profile, steps: int, weight_bytes: int) -> dict:
    """Device time per step by kind of kernel (KERNEL_KINDS), and what the matrix products read per second."""
    by_kind: dict[str, list[float]] = {}
    for event in profile.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or 0
        if device_us <= 0 or event.device_type != torch.autograd.DeviceType.CUDA:  # kernels, not the ops launching them
            continue
        name = event.key.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name for m in marks)), "other: " + event.key[:40])
        entry = by_kind.setdefault(kind, [0.0, 0.0])
        entry[0] += device_us / steps
        entry[1] += event.count / steps
    total = sum(us for us, _ in by_kind.values())
    products = by_kind.get("matrix products", [0.0])[0]
    return {"by kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1][0])), "device us/step": total,
            "kernels/step": sum(n for _, n in by_kind.values()),
            "matrix products GB/s (weight bytes / their time)": weight_bytes / max(products, 1e-9) / 1e3}


# per-token acceptance of a chain's first drafted token, measured on the CPU (benchmarks/RESULTS.md): Gemma 3
# 270M's distilled draft on `complete` (greedy), the demo pair's draft model and its EAGLE-3-style head there
ACCEPTANCE = {"Gemma 270M, distilled draft, complete": 0.37, "demo pair, draft model, complete": 0.70,
              "demo pair, trained head, complete": 0.74}


@section("7-8b-drafts", 90)
def eight_b_drafts(until: float) -> dict:
    """What drafting costs beside the 8B shape: a 1B-shaped draft model's step on its own fused pool and a
    published-layout EAGLE-3 head's level (eager, on the device, as specdec runs it), each against the target's step, and the speedup
    Leviathan et al.'s formula gives for the CPU's acceptance rates at those costs."""
    model, tokenizer = shaped()
    target = StaticHFModel(model, tokenizer, "8B-shaped", context=1024, fused=True)
    target.warm_up(reads=target.reads[:1])  # its rows hold under 512 cells
    costs = verify_costs(target)
    results = {"target t(1) ms": costs["t(1) ms"], "t(k)/t(1)": {k: v for k, v in costs.items() if k != "t(1) ms"}}
    draft = StaticHFModel(random_llama(LLAMA_1B_SMALL if SMALL else LLAMA_1B, tied=True), tokenizer, "1B-shaped",
                          context=1024, fused=True)
    draft.warm_up(tokens=(1,), reads=draft.reads[:1])
    results["1B draft d(1)/t(1)"] = verify_costs(draft, (1,))["t(1) ms"] / costs["t(1) ms"]
    del draft
    head = eagle3_head(target)
    results["EAGLE-3 head level h(1)/t(1)"] = head_level_ms(head) / costs["t(1) ms"]  # on the device, as specdec runs it
    results["EAGLE-3 head beside the target: greedy text = plain"] = head_speculation(target, head)
    results["predicted speedup (best gamma)"] = {
        f"{name}, {drafter}": leviathan(alpha, results[key], results["t(k)/t(1)"])
        for name, alpha in ACCEPTANCE.items()
        for drafter, key in (("1B draft", "1B draft d(1)/t(1)"), ("EAGLE-3 head", "EAGLE-3 head level h(1)/t(1)"))}
    note("## 7. Drafting beside the 8B shape\n" + json.dumps(results, indent=1))
    return results


def head_speculation(target: StaticHFModel, head) -> str:
    """Speculation with the head beside the target as a generation runs it (the prefill's states from the host,
    each verify's on the device, a tree of the head's levels): whether its greedy text is plain decoding's,
    and its tokens per verify (a random head guesses little: the path, not the rate, is what is checked)."""
    from specdec import ModelDrafter, TreeShape
    from specdec.api import SpeculativeDecoder

    _, prompt = eight_b_prompt()
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=32, temperature=0).tokens
    drafted = SpeculativeDecoder(target, ModelDrafter(head, tree=TreeShape(nodes=8, width=2)), 3)
    result = drafted.generate(prompt, max_new_tokens=32, temperature=0)
    per_verify = len(result.tokens) / max(1, result.stats.target_forwards)
    return (f"{'yes' if result.tokens == plain else 'NO'} ({per_verify:.2f} tokens per verify, "
            f"{result.stats.draft_forwards} of the head's forwards)")


LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
LLAMA_1B_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=8192)  # the rehearsal's


def random_llama(shape: dict, tied: bool):
    """A random Llama of these shapes on the device, bf16 (float32 in the rehearsal), sdpa attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # positions up to the longest context section 9 asks for (a pool's rows are cut to the model's maximum)
    config = LlamaConfig(**shape, max_position_embeddings=max(CONTEXTS), tie_word_embeddings=tied, rope_theta=500000.0,
                         eos_token_id=None, pad_token_id=0, bos_token_id=None, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if SMALL else torch.bfloat16)
    try:
        with torch.device(DEVICE):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


def eagle3_head(target: StaticHFModel):
    """An EAGLE-3 head of the published layout for this target (one decoder layer over 2 × hidden, a 32k draft
    vocabulary, the target's embeddings, the default layers), random weights, placed as specdec places one:
    on the target's device, in its dtype."""
    from specdec.runtime.eagle3 import Eagle3Config, Eagle3Model, Eagle3Net

    config = target.model.config
    head_config = Eagle3Config(hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                               head_dim=config.hidden_size // config.num_attention_heads, intermediate=config.intermediate_size,
                               draft_vocab=min(32000, config.vocab_size), target_vocab=config.vocab_size,
                               target_hidden=config.hidden_size, rms_eps=1e-5,
                               rope={"rope_theta": 500000.0, "max_position_embeddings": 2048}, layers=None)
    net = Eagle3Net(head_config, target.model.model.embed_tokens.weight)
    layers = (1, 2, 3) if SMALL else (2, config.num_hidden_layers // 2, config.num_hidden_layers - 3)  # EAGLE-3's default
    return Eagle3Model(net, target, layers, dtype=target.model.dtype)  # on the target's device


@torch.inference_mode()
def head_level_ms(head, cached: int = 160) -> float:
    """One level of the head as a drafter runs it: a token after `cached` entries whose target states were
    reported, its logits brought to the host; ms, median of 20."""
    sequence = head.sequence()
    sequence.observe(0, torch.randn(cached, 3 * head.net.config.target_hidden, device=DEVICE, dtype=head.net.dtype))
    sequence.forward(list(range(1, cached + 1)))
    samples = []
    for _ in range(25):
        synchronize(DEVICE)
        started = time.perf_counter()
        sequence.forward([5])
        synchronize(DEVICE)
        samples.append(time.perf_counter() - started)
        sequence.truncate(cached)
    return statistics.median(samples[5:]) * 1e3


def leviathan(alpha: float, draft_cost: float, verify: dict) -> dict:
    """Leviathan et al.'s expected speedup of a chain of gamma drafts at per-token acceptance alpha:
    (1 - alpha^(gamma+1)) / (1 - alpha) tokens per iteration, at gamma draft steps plus a verify of
    gamma + 1 (its bucket's measured t(k)/t(1)) per iteration; the best gamma up to 15."""
    best = (0.0, 0)
    for gamma in range(1, 16):
        bucket = next(k for k in sorted(verify, key=int) if int(k) >= gamma + 1)
        tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha)
        best = max(best, (tokens / (gamma * draft_cost + verify[bucket]), gamma))
    return {"speedup": round(best[0], 2), "gamma": best[1]}


def verify_costs(model: StaticHFModel, buckets=BUCKETS, cached: int = 199) -> dict:
    """A forward of k tokens (each bucket) after `cached` cells, against one token."""
    sequence = model.sequence()
    try:
        sequence.forward(list(range(1, cached + 1)))
        times = {}
        for k in buckets:
            samples = []
            for _ in range(5):
                synchronize(DEVICE)
                started = time.perf_counter()
                sequence.forward(list(range(1, k + 1)), on_device=True)
                synchronize(DEVICE)
                samples.append(time.perf_counter() - started)
                sequence.truncate(cached)
            times[k] = statistics.median(samples)
        return {k: round(t / times[1], 3) for k, t in times.items()} | {"t(1) ms": round(times[1] * 1e3, 3)}
    finally:
        sequence.release()


# a small model of each covered family (`fused.FAMILIES`): 8 layers of 1024, grouped key heads, float32
FAMILY_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=64, vocab_size=32000)
FAMILY_SHAPE_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=32000)  # the rehearsal's
FAMILY_OPTIONS = {"mistral": dict(sliding_window=64), "gemma2": dict(sliding_window=64, query_pre_attn_scalar=64),
                  "gemma3_text": dict(sliding_window=64, query_pre_attn_scalar=64)}


@section("8-families", 150)
def families(until: float) -> dict:
    """Each family the fused forward covers, as the device compiles it: the same random model's pool with
    the fused forward and with transformers', in hand-captured graphs: the largest logit difference in a
    4-token step after a prompt (against the logits' spread), whether 64 greedy tokens agree (a random
    model's near-ties may part them: where they first part is said), t(1) and t(16)/t(1) both ways, and
    each warm-up."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specdec.api import SpeculativeDecoder
    from specdec.runtime.fused import FAMILIES

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "target")
    prompt, results = fresh_prompts(len(tokenizer), (100,))[0], {}
    for model_type in FAMILIES:
        if time.monotonic() > until - 25:
            note(f"- 8. {model_type}: skipped (time)")
            continue
        config = AutoConfig.for_model(model_type, **(FAMILY_SHAPE_SMALL if SMALL else FAMILY_SHAPE),
                                      **FAMILY_OPTIONS.get(model_type, {}), max_position_embeddings=2048,
                                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
        config._attn_implementation = FAMILIES[model_type].attention
        with torch.device(DEVICE):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        row, logits, texts = {}, [], []
        for fused in (False, True):
            pool = StaticHFModel(model, tokenizer, model_type, context=1024, backend=COMPILE, fused=fused)
            way = "fused" if fused else "transformers"
            row[f"{way}: warm-up s"] = round(pool.warm_up(tokens=(1, 4, 16), reads=pool.reads[:1]), 2)
            sequence = pool.sequence()
            sequence.forward(prompt)  # a prefill chunk; then a step of the 4 bucket, the compiled kernels'
            logits.append(sequence.forward(prompt[:4]))
            sequence.release()
            texts.append(SpeculativeDecoder(pool, None).generate(prompt, max_new_tokens=64, temperature=0).tokens)
            costs = verify_costs(pool, (1, 16))
            row[f"{way}: t(1) ms"], row[f"{way}: t(16)/t(1)"] = costs["t(1) ms"], costs[16]
            if fused and pool.sliding_window:
                row |= windowed_reads(pool)
        row["largest logit difference / logits' std"] = float((logits[0] - logits[1]).abs().max() / logits[0].std())
        parted = next((i for i, (a, b) in enumerate(zip(*texts)) if a != b), None)
        row["greedy equal (64 tokens)"] = "yes" if parted is None else f"no: parted at token {parted}"
        results[model_type] = row
        note(f"- 8. {model_type}: " + json.dumps(row))
        del model
    return results


def windowed_reads(pool: StaticHFModel) -> dict:
    """A sliding-window family's step after 900 cells (1024 read) both ways: its sliding layers reading their
    window alone (`static.window_read`: 192 cells for a window of 64), or the 1024 as the others do. The largest
    logit difference between the two ways (the same keys and values, gathered or read in place) and t(1)."""
    row, logits = {}, []
    for windowed in (True, False):
        pool.window_reads = windowed
        way = "window" if windowed else "read bucket"
        row[f"sliding layers read their {way}: t(1) ms after 900 cells"] = verify_costs(pool, (1,), 899)["t(1) ms"]
        logits.append(step_logits(pool, 899))
    pool.window_reads = True
    row["cells a sliding layer read (the shapes run)"] = max(shape[3] for shape in pool.compile_seconds)
    row["window against read bucket: largest logit difference / logits' std"] = float(
        (logits[0] - logits[1]).abs().max() / logits[0].std())
    return row


CONTEXTS = (1024, 4096, 16384, 32768)  # cells per row (`--context`); 4096 is the default


@section("9-8b-context", 150)
def eight_b_context(until: float) -> dict:
    """What a row's context costs the 8B shape's one-token step: attention reads the read bucket that holds the
    rows' cells (`static.read_buckets`: 512, 1024, ... cells), where it read every cell of a row, used or not.
    t(1) on the fused pool at each context, 199 cells used, both ways (the whole row: the pool's read buckets cut
    to the last one), beside the bytes a row's cells hold against the weights'; and at the default context a
    step of 16 rows, where the rows' cells weigh most."""
    model, tokenizer = shaped()
    results = {}
    contexts = (512, 2048, 4096) if SMALL else CONTEXTS
    for context in contexts:
        if time.monotonic() > until - 30:
            note(f"- 9. context {context}: skipped (time)")
            break
        rows = 16 if context == contexts[1] else 1
        pool = StaticHFModel(model, tokenizer, "8B-shaped", context=context, rows=rows, fused=True)
        assert pool.capacity == context, f"a pool of {pool.capacity} cells a row for a context of {context}"
        row = {"a row's cells / weights": round(pool.pool.bytes(1) / pool.weight_bytes, 3)}
        if rows > 1:  # what a one-slot decoder warms at the default context: every token and read bucket
            row["warm-up s, one slot, every bucket (Inductor's disk cache as the sections before left it)"] = round(
                pool.warm_up(), 2)
        buckets, logits = pool.reads, []
        for way, reads in (("read bucket", buckets), ("whole row", buckets[-1:])):
            pool.reads = reads  # the whole row: as every step read before read buckets
            pool.warm_up(tokens=(1,), reads=reads[:1])  # what 200 cells read (16 rows: their first step captures)
            row[f"t(1) ms, {way}"] = verify_costs(pool, (1,))["t(1) ms"]
            logits.append(step_logits(pool))
            if rows > 1:
                row[f"16 rows' step ms, {way}"] = batch_step_ms(pool, rows)
        # the same step's logits both ways: whether the device's kernels round them alike over more cells
        row["largest |logit difference| between the two ways"] = (logits[0] - logits[1]).abs().max().item()
        results[context] = row
        note(f"- 9. context {context}: " + json.dumps(row))
        del pool
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    smallest = next(iter(results.values()), {}).get("t(1) ms, read bucket")
    for row in results.values():
        row["t(1) / the smallest context's, whole row"] = round(row["t(1) ms, whole row"] / smallest, 3)
        row["t(1) / the smallest context's, read bucket"] = round(row["t(1) ms, read bucket"] / smallest, 3)
    note("## 9. The 8B shape's step by context (cells per row)\n" + json.dumps(results, indent=1))
    return results


def step_logits(model: StaticHFModel, cached: int = 199) -> torch.Tensor:
    """A step's logits after `cached` cells."""
    sequence = model.sequence()
    try:
        sequence.forward(list(range(1, cached + 1)))
        return sequence.forward([5])
    finally:
        sequence.release()


def batch_step_ms(model: StaticHFModel, rows: int) -> float:
    """A one-token step of `rows` sequences together, 199 cells cached in each (median of 5, ms)."""
    sequences = [model.sequence() for _ in range(rows)]
    try:
        for sequence in sequences:
            sequence.forward(list(range(1, 200)))
        samples = []
        for _ in range(5):
            synchronize(DEVICE)
            started = time.perf_counter()
            model.forward_batch([Feed(sequence, [5], on_device=True) for sequence in sequences])
            synchronize(DEVICE)
            samples.append(time.perf_counter() - started)
            for sequence in sequences:
                sequence.truncate(199)
        return round(statistics.median(samples) * 1e3, 3)
    finally:
        for sequence in sequences:
            sequence.release()


def read_bandwidth() -> float:
    """GB/s of summing a large buffer on the device."""
    size = (64 if SMALL else 4096) * 2**20
    buffer = torch.ones(size // 2, dtype=torch.bfloat16 if not SMALL else torch.float16, device=DEVICE)
    buffer.sum()
    synchronize(DEVICE)
    started = time.perf_counter()
    for _ in range(5):
        buffer.sum()
    synchronize(DEVICE)
    return 5 * size / (time.perf_counter() - started) / 1e9


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    torch._logging.set_logs(perf_hints=True)  # says where CUDA graphs were skipped, and why
    card = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU rehearsal"
    note(f"# GPU check: {card}, torch {torch.__version__}, compile backend {COMPILE}, {time.strftime('%Y-%m-%d %H:%M')}")
    chosen = os.environ.get("ONLY")  # e.g. ONLY=3: the sections whose names start so
    for name, limit_s, function in sorted(SECTIONS, key=lambda entry: "163724589".index(entry[0][0])):  # the 8B shape second, Inductor last
        if chosen is None or name.startswith(tuple(chosen.split(","))):
            run_section(name, limit_s, function)
