"""Train a small Llama-architecture causal LM into a standard Hugging Face checkpoint directory.

`specdec train FILES... -o DIR` tokenizes text/code files (training a byte-level BPE tokenizer, or
reusing `--tokenizer DIR`), holds out a slice of the files, and trains with AdamW and a cosine
schedule. Every `--save-every` steps the whole training state goes to DIR/checkpoint (safetensors
and JSON only: nothing is pickled), so an interrupted run resumes where it stopped. The final
model is written to DIR with `save_pretrained` (config.json, model.safetensors, tokenizer files)
plus DIR/training.json with the settings and the held-out loss history.

Distilling a draft from a target is `specdec.distill` (`specdec train --distill-from TARGET`).
"""

from __future__ import annotations

import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdec.config import TrainConfig
from specdec.errors import SpecDecError

EOS_TEXT = "<|endoftext|>"


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # {"step", "train_loss", "heldout_loss"}


# ---------------------------------------------------------------------------------------- data


def expand_files(paths: Sequence[str]) -> list[Path]:
    """Files as given; directories contribute their *.py, *.txt and *.md files, sorted."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise SpecDecError(f"training file not found: {path}")
    if not files:
        raise SpecDecError("the training paths hold no .py, .txt or .md files")
    return files


def stdlib_sources() -> list[Path]:
    """This interpreter's standard library .py files outside site-packages, sorted by path text:
    the demo pair's corpus, and the order its held-out files are counted in."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [Path(f) for f in sorted(str(p) for p in stdlib.rglob("*.py")
                                    if "site-packages" not in p.relative_to(stdlib).parts)]


def split_files(files: list[Path], holdout: float) -> tuple[list[Path], list[Path]]:
    """A deterministic slice of every 1/holdout-th file is held out (at least one, never all)."""
    every = max(2, round(1 / holdout))
    held = [f for i, f in enumerate(files) if i % every == every - 1] or files[-1:]
    train = [f for f in files if f not in set(held)] or files
    return train, held


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise SpecDecError(f"cannot read {path}: {error}") from error


def train_tokenizer(files: list[Path], vocab_size: int):
    """Byte-level BPE (every byte is a token, so any text encodes); <|endoftext|> separates files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TEXT, model_max_length=10**9)


def encode_files(files: list[Path], tokenizer, progress: bool) -> np.ndarray:
    """One stream of ids: each file's tokens followed by EOS."""
    eos = tokenizer.eos_token_id
    chunks = []
    for f in tqdm(files, desc="tokenizing", unit="file", disable=not progress, leave=False):
        chunks.append(np.asarray(tokenizer.encode(read_text(f), add_special_tokens=False) + [eos], dtype=np.int32))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)


def batch_at(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """[batch, seq_len + 1] windows of the stream: inputs are [:, :-1], labels [:, 1:]."""
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(stream[index].astype(np.int64))


# ---------------------------------------------------------------------------------------- model


def model_config(config: TrainConfig, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig

    intermediate = config.intermediate_size or 64 * math.ceil(config.hidden_size * 8 / 3 / 64)
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=intermediate,
        num_hidden_layers=config.layers, num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads or config.heads, max_position_embeddings=config.context,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id,
    )


def loss_fn(model, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy."""
    logits = model(input_ids=batch[:, :-1]).logits.float()  # [b, t, vocab]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def learning_rate(config: TrainConfig, step: int) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------- state


def save_checkpoint(directory: Path, model, optimizer, state: TrainState, config: TrainConfig) -> None:
    """Model weights, AdamW moments and the counters, written to a temp folder then swapped in."""
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(_untied(model.state_dict()), str(tmp / "model.safetensors"))
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            s = optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in s:
                    moments[f"{names[id(p)]}::{key}"] = s[key].contiguous()
    save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"state": asdict(state), "config": asdict(config)}))
    if directory.exists():
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()
    tmp.rename(directory)


def _untied(weights: dict) -> dict:
    """A state dict with each tensor once: a tied output matrix (the input embeddings') is left out,
    as safetensors asks, and `load_checkpoint` ties it again."""
    seen, kept = set(), {}
    for name, tensor in weights.items():
        if not tensor.numel() or tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr() if tensor.numel() else None)
            kept[name] = tensor.contiguous()
    return kept


def load_checkpoint(directory: Path, model, optimizer) -> TrainState:
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=False)
    if hasattr(model, "tie_weights"):  # a transformers model (its output matrix is not saved twice)
        model.tie_weights()
    moments = load_file(str(directory / "optimizer.safetensors"))
    saved = json.loads((directory / "state.json").read_text())
    for name, p in model.named_parameters():
        if f"{name}::exp_avg" in moments:
            optimizer.state[p] = {
                "step": torch.tensor(float(saved["state"]["step"])),
                "exp_avg": moments[f"{name}::exp_avg"],
                "exp_avg_sq": moments[f"{name}::exp_avg_sq"],
            }
    return TrainState(**saved["state"])


# ---------------------------------------------------------------------------------------- loop


def train(config: TrainConfig) -> TrainState:
    """Run (or resume) a training run; returns the final state. Writes everything under config.output."""
    from transformers import LlamaForCausalLM

    config.check()
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    tokenizer, (train_files, train_ids), (held_files, held_ids) = training_data(config, out)
    model = LlamaForCausalLM(model_config(config, len(tokenizer), tokenizer.eos_token_id)).to(config.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    checkpoint = out / "checkpoint"
    state = load_checkpoint(checkpoint, model, optimizer) if (checkpoint / "state.json").exists() else TrainState()
    rng = np.random.default_rng([config.seed, state.step])  # a resumed run draws fresh windows
    held_starts = np.random.default_rng(config.seed).integers(0, len(held_ids) - config.seq_len - 1,
                                                              (config.eval_batches, config.batch_size))

    bar = tqdm(total=config.steps, initial=state.step, desc="training", unit="step", disable=not config.progress)
    model.train()
    running = None
    while state.step < config.steps:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, state.step)
        batch = batch_at(train_ids, rng.integers(0, len(train_ids) - config.seq_len - 1, config.batch_size),
                         config.seq_len)
        with _autocast(config):
            loss = loss_fn(model, batch.to(config.device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += batch.shape[0] * config.seq_len
        state.seconds += time.perf_counter() - started
        value = loss.item()
        running = value if running is None else 0.95 * running + 0.05 * value
        bar.update(1)
        bar.set_postfix(loss=f"{running:.3f}", tok_s=f"{state.tokens_seen / max(state.seconds, 1e-9):.0f}")
        last = state.step == config.steps
        if state.step % config.eval_every == 0 or last:
            state.history.append({"step": state.step, "train_loss": running,
                                  "heldout_loss": heldout_loss(model, held_ids, held_starts, config)})
            bar.write(f"step {state.step}: train loss {running:.3f}, "
                      f"held-out loss {state.history[-1]['heldout_loss']:.3f}")
        if state.step % config.save_every == 0 or last:
            save_checkpoint(checkpoint, model, optimizer, state, config)
    bar.close()
    export(model, tokenizer, out, config, state, train_files, held_files, len(train_ids), len(held_ids))
    return state


def training_data(config: TrainConfig, out: Path):
    """The tokenizer (trained on the training files, or given, or the one a resumed run trained) and
    the (files, token ids) of the training and held-out splits, each at least one window long."""
    from transformers import AutoTokenizer

    train_files, held_files = split_files(expand_files(config.files), config.holdout)
    if config.tokenizer or (out / "tokenizer.json").exists():  # a resumed run keeps the tokenizer it trained
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or out, local_files_only=True,
                                                  trust_remote_code=False)
    else:
        tokenizer = train_tokenizer(train_files, config.vocab_size)
        tokenizer.save_pretrained(out)
    if tokenizer.eos_token_id is None:
        raise SpecDecError("the tokenizer has no EOS token to separate files with")
    train_ids = encode_files(train_files, tokenizer, config.progress)
    held_ids = encode_files(held_files, tokenizer, config.progress)
    for name, ids in (("training", train_ids), ("held-out", held_ids)):
        if len(ids) <= config.seq_len + 1:
            raise SpecDecError(f"the {name} files hold {len(ids)} tokens, "
                               f"fewer than one window of {config.seq_len + 1}")
    return tokenizer, (train_files, train_ids), (held_files, held_ids)


def heldout_loss(model, held_ids, starts, config: TrainConfig) -> float:
    """Mean loss over the held-out windows at `starts` (the same windows at every evaluation)."""
    model.eval()
    with torch.no_grad(), _autocast(config):
        losses = [float(loss_fn(model, batch_at(held_ids, s, config.seq_len).to(config.device))) for s in starts]
    model.train()
    return sum(losses) / len(losses)


def _autocast(config: TrainConfig):
    device_type = "cuda" if config.device.startswith("cuda") else "cpu"
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=config.bf16)


def export(model, tokenizer, out: Path, config, state, train_files, held_files, train_tokens, held_tokens) -> None:
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[config.save_dtype]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(dtype).save_pretrained(out)
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    report = {
        "settings": {k: v for k, v in asdict(config).items() if k != "files"},
        "files": config.files,
        "train_files": len(train_files), "heldout_files": len(held_files),
        "train_tokens": train_tokens, "heldout_tokens": held_tokens,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": state.step, "tokens_seen": state.tokens_seen, "train_seconds": round(state.seconds, 1),
        "heldout_loss": state.history[-1]["heldout_loss"] if state.history else None,
        "history": state.history,
    }
    (out / "training.json").write_text(json.dumps(report, indent=1))
