"""Run every strategy on every prompt, interleaved, and collect raw measurements.

Protocol (docs/benchmarks.md): one process, the same loaded models and prompts for everyone; strategies run
prompt by prompt in turn so machine drift hits all alike; a warm-up first; medians and ratios to
plain decoding measured in the same run; greedy texts must agree across strategies and peers.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
from tqdm import tqdm

from specdec import profiling
from specdec.analysis import expected_tokens, speedup, weight_bytes_per_token
from specdec.build import Parts, assemble, build_decoder, with_demo_paths
from specdec.config import DecoderConfig, DrafterSpec
from specdec.costs import nearest
from specdec.decoder import SpeculativeDecoder
from specdec.demo import demo_ngram
from specdec.bench.prompts import file_prompts
from specdec.bench.peers import peers
from specdec.bench.suites import WITH_REFERENCES, Structured, suite_tasks
from specdec.drafters import History, TreeShape
from specdec.errors import SpecDecError
from specdec.katz import KatzTrigram
from specdec.runtime import CausalLM, RuntimeConfig, takes_device
from specdec.types import GenerationStats
from specdec.params import Limits, SamplingParams

# every run prefills its whole prompt, as the peers' do: no strategy starts from another's kept prefix
Decoder = functools.partial(SpeculativeDecoder, prefix_cache=None)


@dataclass
class BenchConfig:
    target: str | None = None  # None: the demo pair (its draft and n-gram too)
    draft: str | None = None
    ngram: str | None = None
    prompts: str | None = None  # a file of prompts instead of the suites
    suites: tuple[str, ...] = ("complete",)  # specdec.bench.suites; "complete" is HumanEval
    limit: int | None = None  # prompts per suite (None: every task of the suite)
    rounds: int = 1  # every prompt runs this many times, in rounds over all suites
    # a strategy that sends the tasks' reference answers as predictions (where the suite has them)
    predictions: bool = True
    history: bool = True  # a strategy that drafts from the history of the round's earlier prompts and outputs too
    max_new_tokens: int = 128
    modes: tuple[str, ...] = ("greedy", "sampled")
    temperature: float = 0.8  # sampled mode
    top_k: int = 20  # sampled mode
    gammas: tuple[int, ...] = (1, 2, 3, 4)
    lookup_gamma: int = 8
    ngram_gamma: int = 4
    trees: tuple[tuple[int, int], ...] = ((3, 2), (4, 3), (8, 4))  # (nodes, depth) of the token-tree strategies
    tree_width: int = 2
    staged: bool = True
    staged_gamma: int = 3  # depth of the staged strategies
    staged_tree: int = 4  # nodes of the staged-tree strategies
    inner_gamma: int = 4  # draft² tokens per draft-model forward when staged
    peers: bool = True
    seed: int = 0
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # transformers: on the CPU unless a device is given
    progress: bool = True

    @classmethod
    def quick(cls, **overrides) -> BenchConfig:
        """A smoke check that finishes in a few minutes on 2 cores: 5 prompts, 64 new tokens, the
        default policy against plain decoding, one chain, prompt lookup and the peers."""
        settings = dict(limit=5, max_new_tokens=64, gammas=(2,), trees=(), staged=False)
        return cls(**{**settings, **{k: v for k, v in overrides.items() if v is not None}})


@dataclass
class Run:
    """One strategy on one prompt; peers fill only the forward counts of `stats`."""

    tokens: list[int]
    seconds: float
    stats: GenerationStats
    valid: bool | None = None  # under a structured output (the json and tools suites): whether the text is one


@dataclass
class Strategy:
    name: str
    family: str  # "plain", "auto", "chain", "tree", "staged", "lookup", "ngram", "peer"
    gamma: int | str | None
    uses_draft_model: bool
    run: Callable[[list[int], SamplingParams, int], Run]
    history: History | None = None  # emptied as each round starts: a round drafts from its own earlier prompts only


def sampling_for(mode: str, config: BenchConfig) -> SamplingParams:
    return (SamplingParams(temperature=0.0) if mode == "greedy"
            else SamplingParams(temperature=config.temperature, top_k=config.top_k))


# ------------------------------------------------------------------------------------ strategies


def specdec_strategy(name, family, decoder: SpeculativeDecoder, max_new_tokens: int,
                     predicts: bool = False) -> Strategy:
    """predicts: the task's reference answer, where it has one, goes in as the prediction."""

    def run(prompt_ids, sampling, seed, reference: str = "", answer: Structured | None = None) -> Run:
        # seeded for repeatability, drawn as unseeded requests are: the path users' requests take
        prediction = (reference or None) if predicts else None
        generation = decoder.request(prompt_ids, replace(sampling, seed=seed), Limits(max_new_tokens),
                                     prediction=prediction, constraint=answer.constraint if answer else None)
        result = decoder.run(generation.drawn(seed))
        valid = answer.check(result.text) if answer is not None else None
        return Run(result.tokens, result.stats.total_seconds, result.stats, valid)

    uses_draft = decoder.draft_model is not None and not decoder.shapes_by_nodes  # a fixed strategy's draft model
    return Strategy(name, family, decoder.gamma if decoder.drafter else None, uses_draft, run, decoder.history)


def peer_strategy(peer) -> Strategy:
    """Another implementation's loop (see `bench.peers`), measured like ours."""

    def run(prompt_ids, sampling, seed, reference: str = "", answer: Structured | None = None) -> Run:
        out = peer.run(prompt_ids, sampling, seed)
        return Run(out.tokens, out.seconds,
                   GenerationStats(target_forwards=out.target_forwards, draft_forwards=out.draft_forwards))

    return Strategy(peer.name, "peer", None, peer.uses_draft_model, run)


def build_strategies(config: BenchConfig):
    """Load the models once and make every strategy over them, each drafter assembled by the
    builder's registry (`specdec.build.DRAFTERS`) from those models."""
    paths = with_demo_paths(DecoderConfig(config.target, DrafterSpec("model", draft=config.draft), config.runtime,
                                          gamma=1))
    runtime = bench_runtime(config.runtime, paths.target)
    draft_path = paths.drafter.draft
    base = build_decoder(replace(paths, runtime=runtime,
                                 drafter=(DrafterSpec("model", draft=draft_path) if draft_path
                                          else DrafterSpec("plain"))))
    target, draft = base.target, base.draft_model
    ngram_path = config.ngram or (str(demo_ngram()) if config.target is None else None)
    parts = Parts(draft, KatzTrigram.load(ngram_path) if ngram_path else None)
    new = config.max_new_tokens
    auto = lambda **options: Decoder(target, assemble(DrafterSpec("auto"), parts), **{"history": None, **options})
    strategies = [specdec_strategy("plain", "plain", Decoder(target), new),
                  specdec_strategy("default (auto)", "auto", auto(), new),
                  specdec_strategy("default, no exploring", "auto", auto(explore=False), new)]
    if config.history:
        strategies.append(specdec_strategy("default + history", "auto", auto(history=History()), new))
    if config.predictions and not config.prompts and set(config.suites) & set(WITH_REFERENCES):
        strategies.append(specdec_strategy("default + prediction", "auto", auto(), new, predicts=True))
    if draft is not None:
        strategies += [drafted(f"chain γ={gamma}", "chain", DrafterSpec("model"), gamma, target, parts, new)
                       for gamma in (*config.gammas, "auto")]
        if config.trees or config.staged:
            strategies += tree_strategies(config, target, draft, parts.ngram)
    strategies.append(drafted(f"prompt lookup γ={config.lookup_gamma}", "lookup", DrafterSpec("lookup"),
                              config.lookup_gamma, target, parts, new))
    if parts.ngram is not None:
        strategies.append(drafted(f"n-gram γ={config.ngram_gamma}", "ngram", DrafterSpec("ngram"), config.ngram_gamma,
                                  target, parts, new))
    if config.peers:
        strategies += [peer_strategy(peer) for peer in peers(target, draft, new)]
    return target, draft, strategies


def drafted(name: str, family: str, spec: DrafterSpec, gamma, target: CausalLM, parts: Parts,
            max_new_tokens: int) -> Strategy:
    """A strategy of one fixed drafter, assembled from loaded models by the builder's registry."""
    return specdec_strategy(name, family, Decoder(target, assemble(spec, parts), gamma), max_new_tokens)


def bench_runtime(runtime: RuntimeConfig, target: str) -> RuntimeConfig:
    """transformers: the CPU unless a device is asked for (not CUDA just because it is there)."""
    if runtime.device is None and takes_device(target, runtime.backend):
        return replace(runtime, device="cpu")
    return runtime


def tree_strategies(config: BenchConfig, target: CausalLM, draft: CausalLM, ngram) -> list[Strategy]:
    """Token trees of the draft model, and staged drafting with each draft² (n-gram, prompt lookup),
    as a chain and as a tree."""
    parts, out = Parts(draft, ngram), []
    make = lambda name, family, spec, gamma: drafted(name, family, spec, gamma, target, parts, config.max_new_tokens)
    refusal = target.tree_refusal() or draft.tree_refusal()
    if refusal is not None:  # chains still run; trees would be refused (never scored wrong)
        print(f"bench: token-tree strategies skipped: {refusal}", file=sys.stderr)
    for nodes, depth in config.trees if refusal is None else ():
        out.append(make(f"tree {nodes} γ={depth}", "tree",
                        DrafterSpec("model", tree=TreeShape(nodes, config.tree_width)), depth))
    if not config.staged:
        return out
    inners = {"n-gram": "ngram", "lookup": "lookup"} if ngram is not None else {"lookup": "lookup"}
    shapes = (None,) if refusal is not None else (None, TreeShape(config.staged_tree, config.tree_width))
    for inner_name, inner in inners.items():
        for tree in shapes:
            name = f"staged {'tree ' + str(tree.nodes) + ' ' if tree else ''}γ={config.staged_gamma} ({inner_name})"
            spec = DrafterSpec("model", tree=tree, inner=inner, inner_gamma=config.inner_gamma)
            out.append(make(name, "staged", spec, config.staged_gamma))
    return out


# ------------------------------------------------------------------------------------ load


class LoadMonitor:
    """The machine's 1-minute load average, sampled through the run. Foreign load is what runs
    beside the benchmark's own threads; on a shared machine it makes timings untrustworthy."""

    def __init__(self, own_threads: int):
        self.own_threads, self.samples = own_threads, []

    def sample(self) -> None:
        load = profiling.load_average()
        if load is not None:
            self.samples.append(load)

    def summary(self) -> dict:
        cores = os.cpu_count() or 1
        if not self.samples:
            return {"median": None, "max": None, "own_threads": self.own_threads, "cores": cores, "warning": None}
        median, highest = statistics.median(self.samples), max(self.samples)
        foreign = median - self.own_threads
        warning = None
        if foreign > 0.5 or self.own_threads + foreign > cores:
            warning = (f"foreign load: the 1-minute load averaged {median:.2f} (max {highest:.2f}) while this run "
                       f"used {self.own_threads} thread(s) of {cores} cores; other work competed for the CPU, so "
                       "speedups and tokens/s are not trustworthy (run again on a quiet machine, or with --threads 1)")
        return {"median": median, "max": highest, "own_threads": self.own_threads, "cores": cores, "warning": warning}


def own_threads(target: CausalLM) -> int:
    return target.threads or torch.get_num_threads()


# ------------------------------------------------------------------------------------ the run


def check_config(config: BenchConfig) -> None:
    """What can be refused before any model loads."""
    if config.limit is not None and config.limit < 1:
        raise SpecDecError("--limit must be >= 1")
    if config.rounds < 1:
        raise SpecDecError("--rounds must be >= 1")
    for name in config.suites if not config.prompts else ():
        suite_tasks(name)  # an unknown name is refused


def suite_prompts(config: BenchConfig, target: CausalLM) -> dict[str, list[tuple[list[int], str, Structured | None]]]:
    """(prompt token ids, reference answer or "", the structured output its answer must be or None) per suite:
    the first `limit` tasks of each that leave room for the new tokens (chat models get their chat
    template), or a file's prompts as the suite "prompts"."""
    tokenizer, room = target.tokenizer, target.max_length - config.max_new_tokens
    encode = lambda prompt: tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
    if config.prompts:
        ids = [encode(p) for p in file_prompts(config.prompts)[: config.limit]]
        too_long = [i for i, prompt in enumerate(ids) if len(prompt) > room]
        if too_long:
            raise SpecDecError(f"{len(too_long)} prompts (first #{too_long[0]}) plus {config.max_new_tokens} new "
                               f"tokens exceed the context of {target.max_length}")
        return {"prompts": [(prompt, "", None) for prompt in ids]}
    chosen: dict[str, list[tuple[list[int], str]]] = {}
    for name in config.suites:
        chosen[name] = []
        for task in suite_tasks(name):
            ids = encode(task.prompt_for(tokenizer))
            if len(ids) <= room:
                chosen[name].append((ids, task.reference, task.answer))
            if len(chosen[name]) == config.limit:
                break
        if not chosen[name]:
            raise SpecDecError(f"no task of the {name} suite leaves room for {config.max_new_tokens} new tokens in the "
                               f"context of {target.max_length}")
    return chosen


def run_bench(config: BenchConfig) -> dict:
    """Everything `specdec bench` reports, as plain data (see report.py for the tables and plots).
    Strategies take turns prompt by prompt; with several rounds, every suite's prompts run once
    per round, round after round."""
    check_config(config)
    target, draft, strategies = build_strategies(config)
    suites = suite_prompts(config, target)
    monitor = LoadMonitor(own_threads(target))
    monitor.sample()
    # measured now, under this run's conditions, until stable; cached, so the default policy decides with it
    profile = profiling.profile(target, draft, refresh=True)
    cost_curves = {"target": profile.target, **({"draft": profile.draft} if profile.draft else {})}
    runs = {suite: {mode: {s.name: [] for s in strategies} for mode in config.modes} for suite in suites}
    total = len(config.modes) * config.rounds * sum(map(len, suites.values())) * len(strategies)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not config.progress)
    try:
        for mode in config.modes:
            sampling = sampling_for(mode, config)
            for strategy in strategies:  # warm-up: every code path once, not recorded
                strategy.run(next(iter(suites.values()))[0][0][-16:], sampling, config.seed)
            for round_ in range(config.rounds):
                for strategy in strategies:
                    if strategy.history is not None:
                        strategy.history.clear()
                for suite, prompts in suites.items():
                    for i, (ids, reference, answer) in enumerate(prompts):
                        for strategy in strategies:
                            if answer is not None and strategy.family == "peer":
                                continue  # the peers' loops take no constraint: not comparable
                            bar.set_postfix_str(f"{mode} · {suite} · {strategy.name}", refresh=False)
                            runs[suite][mode][strategy.name].append(strategy.run(
                                ids, sampling, config.seed + i + round_ * len(prompts), reference, answer))
                            bar.update(1)
                        monitor.sample()
        interrupted = False
    except KeyboardInterrupt:  # Ctrl-C: what finished is reported
        interrupted = True
        runs = finished(runs)
    bar.close()
    if not runs:
        raise SpecDecError("interrupted before any prompt had run with every strategy: nothing to report")
    return {
        "interrupted": interrupted,
        "config": {k: v for k, v in asdict(config).items()},
        "machine": machine_description(),
        "models": {"target": model_facts(target), "draft": model_facts(draft) if draft else None},
        "costs": cost_curves,
        "profile": {"step_overhead": profile.step_overhead, "level_overhead": profile.level_overhead,
                    "rounds": profile.rounds},
        "load": monitor.summary(),
        "strategies": [{"name": s.name, "family": s.family, "gamma": s.gamma, "uses_draft_model": s.uses_draft_model}
                       for s in strategies],
        "suites": {suite: {"prompts": len(suites[suite]), "rounds": config.rounds,
                           "summary": {mode: summarize(by_mode[mode], strategies, target, draft, cost_curves)
                                       for mode in by_mode},
                           "greedy_mismatches": greedy_mismatches(by_mode.get("greedy")),
                           "runs": {mode: {name: [asdict(r) for r in rs] for name, rs in by_name.items()}
                                    for mode, by_name in by_mode.items()}}
                   for suite, by_mode in runs.items()},
    }


def finished(runs: dict) -> dict:
    """Runs by suite, mode and strategy, cut to the prompts every strategy finished (an interrupted
    run's last prompt ran with some strategies only); suites and modes with none left out."""
    out = {}
    for suite, by_mode in runs.items():
        kept = {}
        for mode, by_name in by_mode.items():
            done = min(map(len, by_name.values()), default=0)
            if done:
                kept[mode] = {name: results[:done] for name, results in by_name.items()}
        if kept:
            out[suite] = kept
    return out


def model_facts(model: CausalLM) -> dict:
    return {"path": model.path, "backend": model.backend, "parameters": model.parameters,
            "weight_bytes": model.weight_bytes, "dtype": model.dtype, "vocab_size": model.vocab_size,
            "context": model.max_length, "threads": model.threads,
            "output_layer": model.output_layer, "batch_invariant": model.batch_invariant,
            "compiled": model.compile_backend,
            "compile_seconds": {"x".join(map(str, shape)): round(seconds, 3)
                                for shape, seconds in model.compile_seconds.items()}}


def read_bandwidth(threads: int = 1, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second that summing a large float32 array reads (median of repeats), with `threads`
    torch threads: the bound on plain decoding, which reads every weight once per token."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(megabytes * 2**20 // 4)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            float(data.sum())
            times.append(time.perf_counter() - started)
        return data.numel() * 4 / statistics.median(times[1:])
    finally:
        torch.set_num_threads(previous)


def machine_description() -> dict:
    import platform

    return {"cpu": profiling.cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": platform.python_version()}


# ------------------------------------------------------------------------------------ summaries


def summarize(runs: dict[str, list[Run]], strategies, target: CausalLM, draft: CausalLM | None, curves) -> dict:
    plain = runs["plain"]
    rows = {}
    for strategy in strategies:
        rs = runs[strategy.name]
        tokens = sum(len(r.tokens) for r in rs)
        stats = [r.stats for r in rs]
        target_fw = sum(s.target_forwards for s in stats)
        draft_fw = sum(s.draft_forwards for s in stats)
        drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
        iterations = sum(s.iterations for s in stats)
        nodes = sum(sum(s.tree_nodes) for s in stats)
        rates = [len(r.tokens) / r.seconds for r in rs if r.seconds > 0 and r.tokens]
        ratios = [(len(r.tokens) / r.seconds) / (len(p.tokens) / p.seconds)
                  for r, p in zip(rs, plain) if r.tokens and p.tokens]
        alpha = accepted / drafted if drafted else None
        draft_bytes = draft.weight_bytes if (draft is not None and strategy.uses_draft_model) else 0
        rows[strategy.name] = {
            "tokens": tokens,
            "tokens_per_second": statistics.median(rates) if rates else None,
            "speedup": statistics.median(ratios) if ratios else None,
            "speedup_iqr": quartiles(ratios),
            "acceptance_rate": alpha,
            "tokens_per_target_forward": tokens / target_fw if target_fw else None,
            "target_forwards_per_token": target_fw / tokens if tokens else None,
            "draft_forwards_per_token": draft_fw / tokens if tokens else None,
            "tree_nodes_per_iteration": nodes / iterations if iterations and strategy.family != "peer" else None,
            "weight_bytes_per_token": weight_bytes_per_token(
                target_fw, target.weight_bytes, draft_fw, draft_bytes, tokens),
            "predicted_speedup": predicted(strategy, alpha, drafted, iterations, rs, curves, tokens),
            "predicted_speedup_iid_alpha": (predicted(strategy, alpha, drafted, iterations, rs, curves)
                                            if strategy.family == "chain" else None),
            "acceptance_by_position": [a / d for a, d in zip(_sum_lists(s.accepted_by_position for s in stats),
                                                             _sum_lists(s.drafted_by_position for s in stats))],
            "accepted_length_counts": _histogram(length for s in stats for length in s.accepted_lengths),
            "drafted_by": shares(label for s in stats for label in s.drafters),
            "valid_share": (sum(r.valid for r in rs) / len(rs)) if rs and rs[0].valid is not None else None,
            "mean_depth": (statistics.mean(d for s in stats for d in s.depths)
                           if iterations and strategy.family != "peer" else None),
        }
    return rows


def shares(labels) -> dict[str, float]:
    """How often each label occurs, as shares of all, most frequent first (what the default chose)."""
    counts = _histogram(labels)
    total = sum(counts.values())
    return {label: count / total for label, count in sorted(counts.items(), key=lambda item: -item[1])}


def predicted(strategy, alpha, drafted, iterations, runs, curves, tokens: int | None = None) -> float | None:
    """Leviathan's speedup: tokens per iteration × t_target(1) / (cost of drafting + verifying one iteration).

    Tokens per iteration come from the measured acceptance: counted directly (`tokens` given), or
    from the i.i.d. formula (1 − α^{γ+1}) / (1 − α), which ignores that early positions accept more.
    The verify costs t_target at the measured size nearest nodes + 1 (`costs.nearest`); a draft-model
    iteration costs its draft forwards × t_draft(1) (on this CPU a forward of a few tokens costs about
    as much as one). The formula is `analysis.speedup`'s.
    """
    if strategy.family in ("plain", "peer") or not drafted or not iterations or alpha is None:
        return None
    t_target = curves["target"]
    gamma = drafted / iterations  # the mean draft depth actually offered
    nodes = sum(sum(r.stats.tree_nodes) for r in runs) / iterations  # = gamma for chains
    if strategy.uses_draft_model:
        draft_cost = sum(r.stats.draft_forwards for r in runs) / iterations * curves["draft"][1]
    else:  # model-free drafters: their measured proposal time
        draft_cost = sum(r.stats.draft_seconds for r in runs) / iterations
    per_iteration = tokens / iterations if tokens is not None else expected_tokens(alpha, gamma)
    return speedup(per_iteration, draft_cost, nearest(t_target, nodes + 1), t_target[1])


def quartiles(values: list[float]) -> list[float] | None:
    """[first quartile, third quartile]: the spread of per-prompt ratios around their median."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q3]


def greedy_mismatches(runs: dict[str, list[Run]] | None) -> dict[str, list[dict]]:
    """For every strategy, the prompts where its greedy tokens differ from plain decoding's."""
    if not runs:
        return {}
    out = {}
    for name, rs in runs.items():
        bad = []
        for i, (r, p) in enumerate(zip(rs, runs["plain"])):
            if r.tokens != p.tokens:
                first = next((j for j, (a, b) in enumerate(zip(r.tokens, p.tokens)) if a != b),
                             min(len(r.tokens), len(p.tokens)))
                bad.append({"prompt": i, "first_difference": first})
        if bad:
            out[name] = bad
    return out


def _sum_lists(lists) -> list[int]:
    total: list[int] = []
    for values in lists:
        total += [0] * (len(values) - len(total))
        for i, v in enumerate(values):
            total[i] += v
    return total


def _histogram(values) -> dict[int, int]:
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return dict(sorted(counts.items()))
