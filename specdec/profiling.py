"""Measuring what a forward costs on this machine (`specdec.costs.Profile`): once per model,
backend, threads, device and way of running it (`model_identity`), kept on disk.

t(k) is timed as decoding pays it: each timed forward follows an untimed one of the same size, so
llama.cpp reuses its graph as in steady decoding (timed alone after another size, a one-token
forward costs more than decoding pays). Every timed forward returns its logits on the CPU (or is
waited for on the device), so the device's time is inside each figure. On CUDA the eager path's
attention does not go to cuDNN, which builds an execution plan for every new key length: timed
again and again at one length it paid no plan, while plain steps, each at a new length, paid one
every token, and the difference was read as the engine's overhead (`runtime.hf.avoid_cudnn_attention`).

Timings are noisy on a shared machine, so sizes are timed round-robin (drift hits every size alike),
each size keeps its low quartile over rounds, and rounds go on until two successive estimates of
the whole curve agree within `STABLE` (at most `MAX_ROUNDS`). A curve is made non-decreasing: a
forward of more tokens never costs less, whatever the noise said.

Profiles are cached as JSON under $SPECDEC_CACHE_DIR (default: `profiles` in specdec's cache,
~/.cache/specdec), keyed by the model files (path, size, modification time), backend, threads,
device, dtype and CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.costs import Profile
from specdec.drafters.base import DraftRequest
from specdec.drafters.model import ModelDrafter
from specdec.engine import DecodeState, Engine
from specdec.policy import FixedGamma
from specdec.runtime import CausalLM
from specdec.runtime.base import synchronize
from specdec.sampling import RandomStreams
from specdec.params import SamplingParams

PREFIX = 256  # tokens cached before a timed forward (at most a quarter of the model's context)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DRAFT_SIZES = (1, 2, 4, 8, 16, 32, 64)
STABLE = 0.05
MIN_ROUNDS, MAX_ROUNDS = 3, 12
BUDGET, DRAFT_BUDGET = 8.0, 3.0  # seconds of rounds, after MIN_ROUNDS, before a curve stops being refined
QUIET_LOAD = 0.5  # a 1-minute load average below this: nothing else runs, a profile can be measured again
# bump when what is measured changes: old cache files are then ignored (3: CUDA attention off cuDNN, static slots;
# 4: time budgets, contention recorded)
FORMAT = 4



def measure_curve(model: CausalLM, sizes=SIZES, max_rounds: int = MAX_ROUNDS, budget: float = BUDGET,
                  name: str = "target") -> tuple[dict[int, float], int, float]:
    """Seconds of one forward of k new tokens after prefix_length cached ones, each after an
    untimed one of its size, for each k that fits the context (see the module docstring for the
    noise handling; after MIN_ROUNDS, rounds also stop once `budget` seconds have gone). Returns
    (curve, rounds taken, the share of the timed forwards' time its threads waited for a core)."""
    prefix = prefix_length(model)
    sizes = tuple(k for k in sizes if prefix + k <= model.max_length) or (1,)
    times: dict[int, list[float]] = {k: [] for k in sizes}
    sequence = model.sequence()
    previous, rounds, waits, started_all = None, 0, CoreWaits(), time.perf_counter()
    bar = tqdm(total=max_rounds, desc=f"timing the {name}'s forwards", unit="round", leave=False, file=sys.stderr)
    try:
        sequence.forward([i % model.vocab_size for i in range(prefix)], last=1)
        while rounds < max_rounds:
            rounds += 1
            for k in sizes:
                tokens = [(7 * i + 3) % model.vocab_size for i in range(k)]
                forward_as_decoding(model, sequence, tokens)  # untimed: llama.cpp builds its graph for this size
                sequence.truncate(prefix)
                with waits:
                    started = time.perf_counter()
                    forward_as_decoding(model, sequence, tokens)
                    times[k].append(time.perf_counter() - started)
                sequence.truncate(prefix)
            bar.update(1)
            curve = _monotone({k: _low_quartile(t) for k, t in times.items()})
            if rounds >= MIN_ROUNDS and ((previous is not None and _agree(previous, curve))
                                         or time.perf_counter() - started_all > budget):
                break
            previous = curve
    finally:
        bar.close()
        sequence.release()
    return curve, rounds, 0.0 if model.on_gpu else waits.share


def forward_as_decoding(model: CausalLM, sequence, tokens: list[int]) -> None:
    """A forward, done when the device is: a model that keeps logits on its device (a GPU's static
    pool) leaves them there, as the engine has it, and is waited for; others return them on the CPU."""
    if model.device_logits:
        sequence.forward(tokens, on_device=True)
        synchronize(model.device)
    else:
        sequence.forward(tokens)


def prefix_length(model: CausalLM) -> int:
    return min(PREFIX, model.max_length // 4)


def measure(target: CausalLM, draft: CausalLM | None = None, max_rounds: int = MAX_ROUNDS) -> Profile:
    """A fresh profile of a target and an optional draft model (see the module docstring)."""
    target_curve, rounds, contention = measure_curve(target, max_rounds=max_rounds)
    profile = Profile(target_curve, rounds=rounds, load=load_average(), measured=time.strftime("%Y-%m-%d %H:%M:%S"),
                      contention=round(contention, 3))
    profile.step_overhead = max(0.0, _plain_step(target) - profile.verify(1))
    if draft is not None:
        profile.draft, draft_rounds, draft_contention = measure_curve(draft, DRAFT_SIZES, max_rounds,
                                                                      budget=DRAFT_BUDGET, name="draft")
        profile.rounds = max(rounds, draft_rounds)
        profile.contention = round(max(contention, draft_contention), 3)
        profile.level_overhead = max(0.0, _draft_level(draft) - profile.draft[1])
    return profile


class CoreWaits:
    """How long this process's threads waited for a core, against how long they ran, inside its
    `with` blocks (Linux's per-thread schedstat; 0 where there is none): other work on the machine
    shows as waiting, whatever the threads do while they run (llama.cpp's spin at barriers)."""

    def __init__(self):
        self.ran = self.waited = 0

    def __enter__(self):
        self._start = _schedstat()

    def __exit__(self, *_):
        ran, waited = _schedstat()
        self.ran += ran - self._start[0]
        self.waited += waited - self._start[1]

    @property
    def share(self) -> float:
        return self.waited / (self.ran + self.waited) if self.ran + self.waited else 0.0


def _schedstat() -> tuple[int, int]:
    """Nanoseconds this process's threads have run and waited on a run queue (0, 0 where unknown)."""
    ran = waited = 0
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            run, wait, _ = stat.read_text().split()
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        ran, waited = ran + int(run), waited + int(wait)
    return ran, waited


def cache_path(target: CausalLM, draft: CausalLM | None = None) -> Path:
    return cache_dir() / f"{cache_key(target, draft)}.json"


def profile(target: CausalLM, draft: CausalLM | None = None, refresh: bool = False) -> Profile:
    """The cached profile for these models on this machine, measured now if there is none (or
    `refresh`), or if the one kept was measured beside other work and the machine is quiet now."""
    if not refresh and why_measure(target, draft) is None:
        return cached_profile(target, draft)
    measured = measure(target, draft)
    path = cache_path(target, draft)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(measured.to_json(), indent=1))
        temporary.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only home: the profile is still used, just measured again next time
    return measured


def why_measure(target: CausalLM, draft: CausalLM | None = None) -> str | None:
    """Why `profile` would measure now: "none kept", "measured beside other work" (and the machine is
    quiet now), or None (it reads the one kept)."""
    cached = cached_profile(target, draft)
    if cached is None:
        return "none kept"
    return None if cached.trusted or not quiet() else "measured beside other work"


def cached_profile(target: CausalLM, draft: CausalLM | None = None) -> Profile | None:
    """The profile kept for these models on this machine (None: none, or unreadable)."""
    try:
        return Profile.from_json(json.loads(cache_path(target, draft).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def quiet() -> bool:
    """Nothing else has kept the machine busy over the last minute (the 1-minute load average)."""
    load = load_average()
    return load is not None and load < QUIET_LOAD


def cache_dir() -> Path:
    """$SPECDEC_CACHE_DIR, else `profiles` in specdec's cache (`specdec.cache.cache_dir`)."""
    from specdec.cache import cache_dir as specdec_cache

    return Path(os.environ.get("SPECDEC_CACHE_DIR") or specdec_cache() / "profiles")


def cache_key(target: CausalLM, draft: CausalLM | None) -> str:
    facts = {"format": FORMAT, "cpu": cpu_name(), "target": model_identity(target),
             "draft": model_identity(draft) if draft else None}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def model_identity(model: CausalLM) -> dict:
    """What makes a model's costs what they are: its files, backend, threads, device, dtype, output layer, and how
    it runs them as it says (`describe`: its attention implementation, a static pool's forward)."""
    path = Path(model.path)
    files = ([path] if path.is_file()
             else sorted(p for p in path.glob("*") if p.suffix in (".json", ".safetensors", ".bin", ".gguf")))
    stamps = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files if p.exists()]
    return {"path": str(path.resolve()), "files": stamps, "backend": model.backend, "dtype": model.dtype,
            "device": str(model.device), "threads": model.threads or torch.get_num_threads(),
            "compiled": model.compile_backend, "context": model.max_length,  # a static pool's rows and read buckets
            "output_layer": model.output_layer, "runs": model.describe()}


def _plain_step(target: CausalLM) -> float:
    """Median seconds of one engine iteration of plain decoding (a forward of one token plus the
    engine's sampling and bookkeeping), after a prompt of prefix_length tokens."""
    prefix = prefix_length(target)
    steps = min(24, target.max_length - prefix - 1)
    if steps < 2:
        return 0.0
    state = DecodeState([i % target.vocab_size for i in range(prefix)], SamplingParams(temperature=1.0), steps,
                        FixedGamma(0), RandomStreams(0))
    engine, times = Engine(target, None), []
    engine.open(state)
    try:
        while state.finish_reason is None:
            started = time.perf_counter()
            engine.step([state])
            times.append(time.perf_counter() - started)
    finally:
        engine.close(state)
    return statistics.median(times[1:])


def _draft_level(draft: CausalLM) -> float:
    """Median seconds per draft level of the draft model drafting a chain (its forward, sampling and bookkeeping)."""
    prefix = prefix_length(draft)
    depth = min(8, draft.max_length - prefix - 2)
    if depth < 1:
        return 0.0
    drafter, times = ModelDrafter(draft), []
    prompt = [i % draft.vocab_size for i in range(prefix)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        slot = drafter.open(prompt)
        try:
            drafter.prefill(slot)  # the prompt is not part of a draft level
            started = time.perf_counter()
            draft, = drafter.propose([DraftRequest(slot, prompt, depth, SamplingParams(temperature=1.0), generator)])
            if isinstance(draft, Exception):
                raise draft
            times.append((time.perf_counter() - started) / depth)
        finally:
            drafter.close(slot)
    return statistics.median(times[1:])


def _low_quartile(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def _monotone(curve: dict[int, float]) -> dict[int, float]:
    out, highest = {}, 0.0
    for k in sorted(curve):
        highest = max(highest, curve[k])
        out[k] = highest
    return out


def _agree(a: dict[int, float], b: dict[int, float]) -> bool:
    return all(abs(a[k] - b[k]) <= STABLE * b[k] for k in b)


def load_average() -> float | None:
    """The 1-minute load average (None where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
