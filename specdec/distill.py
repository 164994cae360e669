"""Distil a small draft from the user's own target: `specdec train --distill-from TARGET -o DIR`.

Any target specdec runs works as the teacher (a GGUF file on llama.cpp, a checkpoint on
transformers); it is used only through the runtime protocol. Four stages, each saved under
DIR/work, so re-running the same command resumes where it stopped:

1. corpus: local text and code (default: the standard library's source, less the files the bench
   suites are built from, so acceptance is measured on text the draft never saw), tokenized by the
   target, capped at `corpus_tokens`;
2. generations (self-distillation): the target continues windows of the corpus (`prompts` of
   `prompt_tokens`, then `short_prompts` of 8-48 tokens that start a line) to `prompt_tokens +
   new_tokens` tokens, half greedily and half sampled at `temperature`; every generated token keeps
   the target's `soft_top` most likely tokens and their logits, the soft labels;
3. vocabulary: the `draft_vocab` target tokens most frequent in the generations and the corpus
   (the target's stop tokens always among them); the draft predicts only these (`runtime.pruned`:
   q = 0 elsewhere, which keeps speculative sampling exact);
4. training: a small Llama-architecture model, its embeddings initialised from the target's
   (projected to the draft's width) where the target's weights can be read; loss = KL(target's
   top-k || draft) on continuation tokens, cross-entropy on corpus tokens.

DIR then holds a transformers checkpoint with `vocab_map.json`, `draft.gguf` (the same weights for
llama.cpp, the map in its metadata) and `distill.json` (settings, data, held-out agreement with the
target's greedy choice, wall time and peak memory per stage).
"""

from __future__ import annotations

import json
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specdec.config import DistillConfig
from specdec.errors import SpecDecError
from specdec.runtime.base import Feed
from specdec.runtime.pruned import VocabMap
from specdec.runtime.vocab import tokenizer_fingerprint
from specdec.sampling import probs_from_logits, sample
from specdec.params import SamplingParams


# ---------------------------------------------------------------------------------------- stages


def default_corpus() -> list[Path]:
    """The standard library's source, less the held-out files the bench suites are built from."""
    from specdec.bench.suites import heldout_sources
    from specdec.train import stdlib_sources

    held = set(heldout_sources())
    return sorted(p for p in stdlib_sources() if p not in held)  # ordered as Paths, as the corpus always was


def python_docs() -> str:
    """Prose this machine has offline: Python's reference documentation, the topics `help()` shows
    (about 110k tokens of English; empty where the interpreter was built without them)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return ""
    return "\n\n".join(topics[name] for name in sorted(topics))


def build_corpus(config: DistillConfig, tokenizer) -> np.ndarray:
    """One stream of target ids, texts in order (each followed by EOS), at most corpus_tokens long: the
    user's files, or by default Python's documentation (prose) and then the standard library's source."""
    from specdec.train import expand_files, read_text

    files = expand_files(config.files) if config.files else default_corpus()
    texts = ([] if config.files else [python_docs]) + [lambda path=path: read_text(path) for path in files]
    eos = tokenizer.eos_token_id
    chunks, total = [], 0
    for text in tqdm(texts, desc="corpus", unit="file", disable=not config.progress, leave=False):
        ids = tokenizer.encode(text(), add_special_tokens=False) + ([eos] if eos is not None else [])
        chunks.append(np.asarray(ids, dtype=np.int32))
        total += len(ids)
        if total >= config.corpus_tokens:
            break
    stream = np.concatenate(chunks)[: config.corpus_tokens] if chunks else np.zeros(0, dtype=np.int32)
    if len(stream) < config.prompt_tokens * 4:
        raise SpecDecError(f"the corpus holds {len(stream)} tokens of the target, too few for "
                           f"{config.prompt_tokens}-token prompts")
    return stream


@dataclass
class Generations:
    """The target's continuations of corpus windows, one row each, all `prompt_tokens + new_tokens`
    long: `tokens` [n, length] (the window's `prompt_lengths` [n] tokens, then what the target
    generated, -1 after a stop) and, at every generated position t, the target's soft labels for
    token t: `top_ids` / `top_logits` [n, length, soft_top] (unused before the prompt's end), and
    `states` [n, length, hidden] float16: the target's final-norm row whose logits gave those labels
    (the state at position t - 1, what a draft head reads; zeros before the prompt's end)."""

    tokens: np.ndarray
    top_ids: np.ndarray
    top_logits: np.ndarray
    prompt_lengths: np.ndarray
    states: np.ndarray

    def generated(self) -> np.ndarray:
        """[n, length] True where the target generated the token."""
        return (np.arange(self.tokens.shape[1])[None, :] >= self.prompt_lengths[:, None]) & (self.tokens >= 0)

    def save(self, path: Path) -> None:
        np.savez(path, tokens=self.tokens, top_ids=self.top_ids, top_logits=self.top_logits,
                 prompt_lengths=self.prompt_lengths, states=self.states)

    @staticmethod
    def load(paths: list[Path], states: bool = True) -> Generations:
        """The saved batches in order; without `states`, an empty [n, length, 0] array stands for them."""
        parts = [np.load(p) for p in paths]
        if states and not all("states" in part for part in parts):
            raise SpecDecError(f"{paths[0].parent}: these generations were made before specdec recorded the target's "
                               "hidden states (a draft head needs them); distil into a new output directory")
        arrays = [np.concatenate([part[key] for part in parts])
                  for key in ("tokens", "top_ids", "top_logits", "prompt_lengths")]
        kept = (np.concatenate([part["states"] for part in parts]) if states
                else np.zeros((*arrays[0].shape, 0), np.float16))
        return Generations(*arrays, kept)


SHORT_PROMPT = (8, 48)  # token range of the short prompts' lengths (at most half of prompt_tokens)


def prompt_plan(config: DistillConfig, corpus: np.ndarray, line_start_ids: set[int]) -> list[tuple[int, int]]:
    """(start, length) of every window the target continues: `prompts` full windows anywhere, then
    `short_prompts` windows of 8-48 tokens that start a line (a docstring, a comment, a definition:
    what a short prompt usually is), whose continuations are longer by as much."""
    full = np.random.default_rng([config.seed, 1]).integers(0, len(corpus) - config.prompt_tokens, config.prompts)
    rng = np.random.default_rng([config.seed, 2])
    high = min(SHORT_PROMPT[1], config.prompt_tokens // 2)
    starts = np.flatnonzero(np.isin(corpus[: -high - 1], list(line_start_ids))) + 1
    if len(starts) == 0:
        starts = np.arange(len(corpus) - high)
    short = rng.choice(starts, config.short_prompts)
    lengths = rng.integers(min(SHORT_PROMPT[0], high), high + 1, config.short_prompts)
    return [(int(s), config.prompt_tokens) for s in full] + [(int(s), int(n)) for s, n in zip(short, lengths)]


def line_start_ids(tokenizer) -> set[int]:
    """Tokens that end with a newline (in SentencePiece, byte-level BPE or byte-fallback spelling)."""
    return {i for piece, i in tokenizer.get_vocab().items() if piece.endswith(("\n", "\u010a", "<0x0A>"))}


def generate(target, corpus: np.ndarray, config: DistillConfig, work: Path, states: bool) -> Generations:
    """The target's continuations (stage 2), decoded generate_batch at a time in one batched
    forward per token and saved a batch per file, so an interrupted run loses at most one batch.
    The target's states are always recorded (a draft and a head can then share the stage);
    `states`: load them too."""
    plan = prompt_plan(config, corpus, line_start_ids(target.tokenizer))
    batches = [range(i, min(i + config.generate_batch, len(plan))) for i in range(0, len(plan), config.generate_batch)]
    files = [work / f"generations-{b:05d}.npz" for b in range(len(batches))]
    done = sum(f.exists() for f in files)
    bar = tqdm(total=len(plan), initial=min(len(plan), done * config.generate_batch), desc="target generations",
               unit="prompt", disable=not config.progress)
    for batch, file in zip(batches[done:], files[done:]):
        prompts = [corpus[plan[i][0]: plan[i][0] + plan[i][1]] for i in batch]
        continue_batch(target, prompts, [i % 2 == 1 for i in batch], config).save(file)
        bar.update(len(batch))
    bar.close()
    return Generations.load(files, states)


def continue_batch(target, prompts: list[np.ndarray], sampled: list[bool], config: DistillConfig) -> Generations:
    """Continue each prompt to prompt_tokens + new_tokens tokens (greedy, or sampled at the
    temperature), recording the target's top soft_top logits at every generated token."""
    rng = torch.Generator().manual_seed(config.seed * 1_000_003 + int(prompts[0][0]) + len(prompts))
    params = SamplingParams(temperature=config.temperature)
    n, length = len(prompts), config.prompt_tokens + config.new_tokens
    tokens = np.full((n, length), -1, dtype=np.int32)
    top_ids = np.zeros((n, length, config.soft_top), dtype=np.int32)
    top_logits = np.full((n, length, config.soft_top), -np.inf, dtype=np.float16)
    states = np.zeros((n, length, target.hidden_size), dtype=np.float16)
    lengths = np.array([len(p) for p in prompts])
    target.keep_states()  # each forward leaves its rows' final-norm states on the sequence
    sequences = [target.sequence() for _ in prompts]
    try:
        logits = [seq.forward(p.tolist(), last=1)[0] for seq, p in zip(sequences, prompts)]
        last_states = [seq.states[0] for seq in sequences]
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        live = list(range(n))
        for step in range(length - int(lengths.min())):
            for row in live:
                row_logits, at = logits[row].float(), lengths[row] + step
                values, ids = torch.topk(row_logits, config.soft_top)
                top_ids[row, at], top_logits[row, at] = ids.numpy(), values.numpy()
                states[row, at] = last_states[row].float().cpu().numpy()
                tokens[row, at] = (sample(probs_from_logits(row_logits, params), rng) if sampled[row]
                                   else int(row_logits.argmax()))
            live = [row for row in live if tokens[row, lengths[row] + step] not in target.stop_token_ids
                    and lengths[row] + step + 1 < length]
            if not live:
                break
            fed = target.forward_batch([Feed(sequences[row], [int(tokens[row, lengths[row] + step])], last=1)
                                        for row in live])
            for row, row_logits in zip(live, fed):
                logits[row], last_states[row] = row_logits[0], sequences[row].states[0]
    finally:
        for seq in sequences:
            seq.release()
        target.keep_states(False)
    return Generations(tokens, top_ids, top_logits, lengths, states)


def choose_vocabulary(corpus: np.ndarray, generations: Generations, size: int, stop_ids, vocab_size: int) -> np.ndarray:
    """The `size` target ids the draft will predict: ranked by how often the target generated them
    (or ranked them in its top soft labels), then by corpus frequency; stop tokens always in."""
    generated = generations.generated()
    counts = np.bincount(generations.tokens[generated], minlength=vocab_size).astype(np.float64) * 1e6
    counts += np.bincount(generations.top_ids[generated].reshape(-1), minlength=vocab_size) * 1e3
    counts += np.bincount(corpus, minlength=vocab_size)
    counts[list(stop_ids)] = np.inf
    ranked = np.argsort(-counts, kind="stable")
    return np.sort(ranked[: min(size, int((counts > 0).sum()))])


# ---------------------------------------------------------------------------------------- draft model


def draft_config(config: DistillConfig, vocab_map: VocabMap, eos_draft_id: int | None):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_map.draft_vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.layers,
        num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.context, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=eos_draft_id, pad_token_id=eos_draft_id,
    )


def target_embeddings(target) -> torch.Tensor | None:
    """The target's input embedding matrix [vocab, width] in float32, where its weights can be read."""
    return target.input_embeddings()


def project_embeddings(embeddings: torch.Tensor, width: int) -> torch.Tensor:
    """Rows projected onto their top `width` principal directions, scaled to an init's magnitude
    (std 0.02 per entry): the draft starts from the target's geometry of its tokens."""
    centered = embeddings - embeddings.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(centered, full_matrices=False)
    projected = (centered @ v[:width].T if v.shape[0] >= width
                 else torch.nn.functional.pad(centered @ v.T, (0, width - v.shape[0])))
    return projected * (0.02 / projected.std().clamp_min(1e-12))


def soft_loss(logits: torch.Tensor, top_ids: torch.Tensor, top_logits: torch.Tensor) -> torch.Tensor:
    """KL(target's top-k, renormalised || draft) per position, up to the target's entropy term.

    logits [n, draft vocab]; top_ids [n, k] draft ids (-1: outside the draft's vocabulary, dropped);
    top_logits [n, k] the target's logits at them. A position with none of its top-k in the draft's
    vocabulary teaches nothing (0), not NaN."""
    weights = torch.softmax(top_logits.float().masked_fill(top_ids < 0, -torch.inf), -1).nan_to_num(0.0)
    log_q = torch.log_softmax(logits.float(), -1).gather(-1, top_ids.clamp_min(0))
    return -(weights * log_q).sum(-1)


@dataclass
class Examples:
    """Training rows in draft ids: inputs [n, length], hard labels [n, length] (-100: none), soft
    labels top_ids / top_logits [n, length, k] (top_ids -1: none) and a soft mask [n, length]."""

    inputs: torch.Tensor
    hard: torch.Tensor
    top_ids: torch.Tensor
    top_logits: torch.Tensor
    soft: torch.Tensor

    def rows(self, index) -> Examples:
        return Examples(*(t[index] for t in (self.inputs, self.hard, self.top_ids, self.top_logits, self.soft)))


def examples(generations: Generations, vocab_map: VocabMap) -> Examples:
    """Predict token t+1 from tokens <= t: prompt (corpus) tokens by cross-entropy (where the draft
    can predict them), generated tokens from the target's soft labels."""
    to_draft = vocab_map.to_draft()
    tokens = generations.tokens.astype(np.int64)
    inputs = np.where(tokens[:, :-1] >= 0, to_draft[np.maximum(tokens[:, :-1], 0)], vocab_map.unknown)
    labels = to_draft[np.maximum(tokens[:, 1:], 0)]
    in_prompt = np.arange(1, tokens.shape[1])[None, :] < generations.prompt_lengths[:, None]  # [n, length - 1]
    hard = np.where(in_prompt & (labels != vocab_map.unknown), labels, -100)
    mapped = to_draft[generations.top_ids[:, 1:]]
    top_ids = np.where(mapped == vocab_map.unknown, -1, mapped)
    top_logits = np.nan_to_num(generations.top_logits[:, 1:].astype(np.float32), neginf=-1e4)
    soft = generations.generated()[:, 1:] & (top_ids >= 0).any(-1)
    top_ids[~soft] = -1
    return Examples(*(torch.from_numpy(a) for a in (inputs, hard, top_ids, top_logits, soft)))


def batch_loss(model, batch: Examples, device: str) -> torch.Tensor:
    logits = model(input_ids=batch.inputs.to(device)).logits  # [b, length, draft vocab]
    hard = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.hard.to(device).flatten(),
                                             reduction="sum")
    soft_mask = batch.soft.to(device)
    soft = soft_loss(logits[soft_mask], batch.top_ids.to(device)[soft_mask],
                     batch.top_logits.to(device)[soft_mask]).sum()
    count = (batch.hard >= 0).sum() + batch.soft.sum()
    return (hard + soft) / count.clamp_min(1).to(device)


def agreement(model, held: Examples, device: str) -> float:
    """How often the draft's most likely token is the target's (on held-out continuations): the
    per-token acceptance a greedy chain would see with these contexts."""
    logits = model(input_ids=held.inputs.to(device)).logits.cpu()
    mask = held.soft
    return float((logits[mask].argmax(-1) == held.top_ids[mask][:, 0]).float().mean())


# ---------------------------------------------------------------------------------------- driver


@dataclass
class Report:
    stages: dict = field(default_factory=dict)  # stage -> {"seconds", "peak_rss_mb"}
    history: list = field(default_factory=list)  # {"step", "train_loss", "heldout_agreement"}


@dataclass
class Prepared:
    """What a draft and a head are both trained from: the target, the corpus, its generations and
    the pruned vocabulary; `stage` runs (and times) a stage into the run's report."""

    target: object
    corpus: np.ndarray
    generations: Generations
    vocab_map: VocabMap
    report: Report
    stage: object


def prepare(config: DistillConfig) -> Prepared:
    """Stages 1-3, each resumed from DIR/work where it was saved."""
    from specdec.runtime import load_model, takes_device

    config.check()
    work = Path(config.output) / "work"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    report, stage = staged(work)
    on_gpu = config.device.startswith("cuda")
    if takes_device(config.target, config.backend):
        options = dict(device=config.device)
    else:  # on a GPU, every layer offloaded (where llama.cpp was built with CUDA)
        options = dict(context=config.prompt_tokens + config.new_tokens + 8, gpu_layers=-1 if on_gpu else None)
    target = load_model(config.target, backend=config.backend, threads=config.threads, slots=config.generate_batch,
                        **options)
    corpus = _cached(work / "corpus.npy", lambda: stage("corpus", lambda: build_corpus(config, target.tokenizer)))
    generations = stage("generate", lambda: generate(target, corpus, config, work, states=config.head))
    ids = choose_vocabulary(corpus, generations, config.draft_vocab, target.stop_token_ids, target.vocab_size)
    vocab_map = VocabMap(tuple(int(i) for i in ids), target.vocab_size,
                         tokenizer_fingerprint(target.tokenizer, spaces_as_written=True))
    return Prepared(target, corpus, generations, vocab_map, report, stage)


def staged(work: Path):
    """The run's report (resumed from work/report.json) and `stage(name, run)`, which runs a stage and
    adds its seconds and the peak memory so far to the report, saved at once."""
    report = Report(**json.loads((work / "report.json").read_text())) if (work / "report.json").exists() else Report()

    def stage(name: str, run):
        started = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - started + report.stages.get(name, {}).get("seconds", 0.0)
        report.stages[name] = {"seconds": round(seconds, 1), "peak_rss_mb": _peak_rss_mb()}
        (work / "report.json").write_text(json.dumps(asdict(report)))
        return result

    return report, stage


def distill(config: DistillConfig) -> dict:
    """Run (or resume) a distillation; returns the report written to OUTPUT/distill.json."""
    run = prepare(config)
    work = Path(config.output) / "work"
    embeddings = target_embeddings(run.target) if not (work / "checkpoint" / "state.json").exists() else None
    model, state = run.stage("train", lambda: train_draft(config, run.generations, run.vocab_map, embeddings,
                                                          run.target, work, run.report))
    return write_outputs(config, model, run.vocab_map, draft_pieces(run.target.tokenizer, run.vocab_map),
                         run.corpus, run.generations, state, run.report)


def _cached(path: Path, build) -> np.ndarray:
    if path.exists():
        return np.load(path)
    value = build()
    np.save(path, value)
    return value


def _peak_rss_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def train_draft(config: DistillConfig, generations: Generations, vocab_map: VocabMap, embeddings, target, work: Path,
                report: Report):
    """Stage 4: the draft model, by `fit`."""
    from transformers import LlamaForCausalLM

    eos = next((i for i, t in enumerate(vocab_map.target_ids)
                if t == getattr(target.tokenizer, "eos_token_id", None)), None)
    model = LlamaForCausalLM(draft_config(config, vocab_map, eos)).to(config.device)
    if embeddings is not None:
        with torch.no_grad():
            rows = embeddings[list(vocab_map.target_ids)]
            model.get_input_embeddings().weight[: vocab_map.unknown] = (
                project_embeddings(rows, config.hidden_size).to(config.device))
    data = examples(generations, vocab_map)
    held, train_rows = split_rows(len(data.inputs), config)
    state = fit(model, config, work / "checkpoint", report, "training the draft", data.inputs.shape[1],
                lambda rows: batch_loss(model, data.rows(torch.from_numpy(rows)), config.device), train_rows,
                lambda: {"heldout_agreement":
                         round(agreement(model, data.rows(torch.from_numpy(held)), config.device), 4)})
    return model, state


def split_rows(count: int, config: DistillConfig) -> tuple[np.ndarray, np.ndarray]:
    """The held-out rows (a `holdout` share, at least one) and the training rows, in a seeded order."""
    order = np.random.default_rng(config.seed).permutation(count)
    held_count = max(1, int(count * config.holdout))
    return order[:held_count], order[held_count:]


def fit(model, config: DistillConfig, checkpoint: Path, report: Report, description: str, tokens_per_row: int, loss_of,
        train_rows: np.ndarray, evaluate) -> object:
    """AdamW with warmup and a cosine schedule over `config.steps` batches of `config.batch_size`
    training rows (`loss_of(rows)` -> the batch's loss), bf16 autocast if asked, `evaluate()` (a
    dict of held-out figures) into the report every eval_every steps, a checkpoint every
    save_every steps from which the same call resumes. Returns the training state."""
    from specdec.config import TrainConfig
    from specdec.train import TrainState, learning_rate, load_checkpoint, save_checkpoint

    schedule = TrainConfig(files=[], output="", steps=config.steps, lr=config.lr, warmup=config.warmup)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    state = load_checkpoint(checkpoint, model, optimizer) if (checkpoint / "state.json").exists() else TrainState()
    if state.history:  # resumed: the history goes on from the checkpoint's
        report.history = list(state.history)
    rng = np.random.default_rng([config.seed, state.step])
    bar = tqdm(total=config.steps, initial=state.step, desc=description, unit="step", disable=not config.progress)
    running = None
    while state.step < config.steps:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(schedule, state.step)
        with torch.autocast("cuda" if config.device.startswith("cuda") else "cpu", dtype=torch.bfloat16,
                            enabled=config.bf16):
            loss = loss_of(rng.choice(train_rows, config.batch_size))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += config.batch_size * tokens_per_row
        state.seconds += time.perf_counter() - started
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{running:.3f}")
        if state.step % config.eval_every == 0 or state.step == config.steps:
            model.eval()
            with torch.no_grad():
                figures = evaluate()
            model.train()
            report.history.append({"step": state.step, "train_loss": round(running, 4), **figures})
            state.history = report.history
            bar.write(f"step {state.step}: loss {running:.3f}, held-out {readable(figures)}")
        if state.step % config.save_every == 0 or state.step == config.steps:
            save_checkpoint(checkpoint, model, optimizer, state, schedule)
    bar.close()
    return state


def readable(figures: dict) -> str:
    """Held-out figures for a progress line: names in words, numbers to 3 places, a list by depth as a/b/c."""
    def value(v) -> str:
        if isinstance(v, (list, tuple)):
            return "/".join(f"{x:.3f}" for x in v)
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    return ", ".join(f"{k.removeprefix('heldout_').replace('_', ' ')} {value(v)}" for k, v in figures.items())


def write_outputs(config: DistillConfig, model, vocab_map: VocabMap, pieces: list[str], corpus,
                  generations: Generations, state, report: Report) -> dict:
    """OUTPUT: the transformers checkpoint with its vocabulary map, draft.gguf, distill.json."""
    from specdec.export import save_draft

    out = Path(config.output)
    save_draft(model, vocab_map, pieces, out, gguf=config.gguf)
    inside = np.isin(generations.tokens[generations.generated()], np.asarray(vocab_map.target_ids))
    summary = {
        "target": str(config.target),
        "settings": {k: v for k, v in asdict(config).items() if k not in ("target", "output")},
        "corpus_tokens": int(len(corpus)), "continuations": int(len(generations.tokens)),
        "generated_tokens": int(inside.size),
        "vocabulary": {"draft": len(vocab_map.target_ids), "target": vocab_map.target_vocab_size,
                       "generated_tokens_covered": round(float(inside.mean()), 4)},
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": state.step, "train_seconds": round(state.seconds, 1),
        "heldout_agreement": report.history[-1]["heldout_agreement"] if report.history else None,
        "stages": report.stages, "history": report.history,
        "total_seconds": round(sum(s["seconds"] for s in report.stages.values()), 1),
        "peak_rss_mb": max((s["peak_rss_mb"] for s in report.stages.values()), default=_peak_rss_mb()),
    }
    (out / "distill.json").write_text(json.dumps(summary, indent=1))
    return summary


def draft_pieces(tokenizer, vocab_map: VocabMap) -> list[str]:
    """The draft's token strings, for its tokenizer files: each predicted token's text in the
    target's tokenizer (`<tID>` where that text is not unique), then `<unk>`."""
    text = {token_id: piece for piece, token_id in tokenizer.get_vocab().items()}
    pieces = [text.get(i, f"<t{i}>") for i in vocab_map.target_ids] + ["<unk>"]
    seen: set[str] = set()
    for i, piece in enumerate(pieces):
        if piece in seen:
            pieces[i] = f"<t{vocab_map.target_ids[i]}>"
        seen.add(pieces[i])
    return pieces
