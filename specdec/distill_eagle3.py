"""Train an EAGLE-3 head for the user's own target: `specdec train --distill-from TARGET --head -o DIR`.

Stages, each timed into DIR/work/report.json and resumed from DIR/work:
1. corpus: the files' tokens in the target's vocabulary (`distill.build_corpus`);
2. prefill: one target forward per window of `prompt_tokens` corpus tokens, keeping at every position
   the target's states at the head's three layers (bfloat16) and its top `soft_top` logits among the
   draft vocabulary (the corpus's most frequent tokens, chosen first), the output layer narrowed to
   those rows where the backend can (`narrow_output`). No autoregressive generation: every position of
   real text is a training position, and a window costs one forward (`Prefills`);
3. train: the head (`runtime.eagle3.Eagle3Net`, as wide as the target, its token embeddings the
   target's, frozen) learns KL(the target's top-k || q) at every position with "training-time test":
   step 0 reads the target's features, each later step k the head's own outputs of step k - 1 (the
   entry at position t + k attends to the target-read entries up to t and to its own chain), as it
   will when it drafts k deep; step k's loss is weighted STEP_DECAY ** k;
4. write: DIR/config.json and DIR/model.safetensors in the EAGLE-3 layout (`midlayer.`, `d2t`, `t2d`,
   no embeddings of its own), which `--draft DIR` loads here and vLLM and SGLang load as published
   heads; DIR/eagle3.json the run's report (stages, held-out agreement by depth).

Held-out agreement by depth: on held-out windows, how often the head's most likely token at step k
is the target's (teacher-forced tokens, the head's own outputs deeper): about the acceptance of the
k-th token of a greedy chain given the ones before were accepted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specdec.config import DistillConfig
from specdec.distill import build_corpus, fit, soft_loss, split_rows, staged
from specdec.errors import SpecDecError
from specdec.runtime.eagle3 import Eagle3Config, Eagle3Net

# `specdec train --head`'s, where a draft model's differ
EAGLE3_DEFAULTS = dict(prompts=2048, prompt_tokens=256, batch_size=4, steps=1200, lr=1e-3, weight_decay=0.0,
                       bf16=True, draft_vocab=8192, soft_top=8, holdout=0.03, eval_every=200, save_every=200)
STEPS_AHEAD = 4  # training-time test: steps unrolled on the head's own outputs (0 reads the target's)
STEP_DECAY = 0.8  # step k's loss weight is STEP_DECAY ** k
HEAD_DIM = 64


def default_layers(layer_count: int) -> tuple[int, int, int]:
    """EAGLE-3's (2, L // 2, L - 3), or for a target too shallow for them to be distinct, the nearest three
    distinct layers from 1 on."""
    half = layer_count // 2
    for layers in ((2, half, layer_count - 3), (1, half, layer_count - 2), (1, half, layer_count - 1)):
        if len(set(layers)) == 3 and all(1 <= i < layer_count for i in layers):
            return layers
    raise SpecDecError(f"an EAGLE-3 head reads three of the target's layers past the first; it has {layer_count}")


@dataclass
class Prefills:
    """Per window: tokens [n, W] (target ids), the states at the head's layers [n, W, 3 * hidden] (bfloat16
    stored as int16 bits: float16 overflows on residual streams such as Gemma's, which pass 65504) and
    the target's top-k logits after each token (ids [n, W, k], logits float16)."""

    tokens: np.ndarray
    states: np.ndarray
    top_ids: np.ndarray
    top_logits: np.ndarray

    def save(self, path: Path) -> None:
        np.savez(path, **asdict(self))

    @staticmethod
    def load(path: Path) -> Prefills:
        with np.load(path) as saved:
            return Prefills(**{name: saved[name] for name in ("tokens", "states", "top_ids", "top_logits")})


def window_count(corpus: np.ndarray, config: DistillConfig) -> int:
    """How many windows of `config.prompt_tokens` the prefill reads: `config.prompts`, or what the corpus holds."""
    count = min(config.prompts, len(corpus) // config.prompt_tokens)
    if count < 2:
        raise SpecDecError(f"the corpus holds {len(corpus)} tokens: too few for 2 windows of {config.prompt_tokens}")
    return count


def prefill_windows(target, corpus: np.ndarray, config: DistillConfig, layers, ids: np.ndarray, held: np.ndarray,
                    work: Path) -> Prefills:
    """Stage 2: `window_count` windows of the corpus, evenly spaced, each one target forward; saved in
    parts of 64 windows (a rerun resumes after the last part saved). The top-k is over the draft
    vocabulary `ids` (all a head can predict; where the backend narrows its output layer to those rows,
    most of a small target's forward is saved), except for the held-out windows `held`, whose top-k
    is over the whole vocabulary: their agreement counts a first choice the head cannot make as missed."""
    width, count = config.prompt_tokens, window_count(corpus, config)
    # each window opens as the target's prompts do (Gemma's BOS: its states after one differ from those without)
    opening = np.asarray(target.tokenizer.encode("", add_special_tokens=True), dtype=corpus.dtype)[: width // 2]
    starts = np.linspace(0, len(corpus) - width, count).astype(np.int64)
    whole = np.zeros(count, dtype=bool)
    whole[held] = True
    parts, done = [], 0
    while (work / f"prefill-{len(parts)}.npz").exists():
        parts.append(Prefills.load(work / f"prefill-{len(parts)}.npz"))
        done += len(parts[-1].tokens)
    target.keep_states(layers=layers)
    bar = tqdm(total=count, initial=done, desc="prefilling windows", unit="window", disable=not config.progress)
    try:
        while done < count:
            chunk = range(done, min(done + 64, count))
            windows = [np.concatenate([opening, corpus[starts[i]: starts[i] + width - len(opening)]]) for i in chunk]
            parts.append(_prefill(target, windows, config.soft_top, [None if whole[i] else ids for i in chunk]))
            parts[-1].save(work / f"prefill-{len(parts) - 1}.npz")
            done += len(chunk)
            bar.update(len(chunk))
    finally:
        target.keep_states(False)
        target.narrow_output(None)
        bar.close()
    return Prefills(*(np.concatenate([getattr(p, name) for p in parts]) for name in
                      ("tokens", "states", "top_ids", "top_logits")))


def _prefill(target, windows: list[np.ndarray], top: int, columns: list[np.ndarray | None]) -> Prefills:
    """Each window's forward; its top-k over `columns` (target ids; None: all)."""
    tokens, states, ids, logits = [], [], [], []
    for window, among in zip(windows, columns):
        narrowed = target.narrow_output(among)
        sequence = target.sequence()
        try:
            rows = sequence.forward(window.tolist())  # [W, vocab or len(among)]: every position's logits
            kept = sequence.states  # [W, 3 * hidden]
        finally:
            sequence.release()
        if among is not None and not narrowed:
            rows = rows[:, torch.from_numpy(among)]
        best = rows.float().topk(top, dim=-1)
        chosen = best.indices if among is None else torch.from_numpy(among)[best.indices]
        tokens.append(window.astype(np.int32))
        states.append(kept.to(torch.bfloat16).view(torch.int16).numpy())
        ids.append(chosen.to(torch.int32).numpy())
        logits.append(best.values.to(torch.float16).numpy())
    return Prefills(*(np.stack(a) for a in (tokens, states, ids, logits)))


def choose_vocabulary(corpus: np.ndarray, size: int, stop_ids, vocab_size: int) -> np.ndarray:
    """The `size` target ids the head predicts, as EAGLE-3 chooses them: the corpus's most frequent
    tokens (on the default corpus they hold 98% of Gemma 3's first choices at 8192), stop tokens always."""
    counts = np.bincount(corpus, minlength=vocab_size).astype(np.float64)
    counts[list(stop_ids)] = np.inf
    ranked = np.argsort(-counts, kind="stable")
    return np.sort(ranked[: min(size, int((counts > 0).sum()))])


def head_config(target, layers, draft_vocab: int) -> Eagle3Config:
    hidden = target.hidden_size
    heads = max(1, hidden // HEAD_DIM)
    return Eagle3Config(hidden=hidden, heads=heads, kv_heads=heads, head_dim=HEAD_DIM, intermediate=2 * hidden,
                        draft_vocab=draft_vocab, target_vocab=target.vocab_size, target_hidden=hidden, rms_eps=1e-6,
                        rope={"rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 8192},
                        layers=tuple(layers))


class Unrolled:
    """Training-time test over a batch of windows: `logits(rows)` -> one [b, W - 1, draft vocab] per step."""

    def __init__(self, net: Eagle3Net, prefills: Prefills, to_draft: torch.Tensor):
        self.net, self.prefills, self.to_draft = net, prefills, to_draft

    def batch(self, rows: np.ndarray):
        """The windows' tokens, states, top-k in draft ids (-1: not predicted) and logits, on the net's device."""
        p, device = self.prefills, self.net.fc.weight.device
        tokens = torch.from_numpy(p.tokens[rows]).long()
        states = torch.from_numpy(p.states[rows])
        states = (states.view(torch.bfloat16) if states.dtype == torch.int16 else states).float()
        top_ids = self.to_draft[torch.from_numpy(p.top_ids[rows]).long()]
        return tuple(x.to(device) for x in (tokens, states, top_ids, torch.from_numpy(p.top_logits[rows]).float()))

    def logits(self, tokens: torch.Tensor, states: torch.Tensor) -> list[torch.Tensor]:
        """Step 0: entry i (position i + 1) reads token i + 1 and the target's feature at i; step k:
        token i + 1 + k and step k - 1's output at row i, attending to step 0's rows up to i and to
        its own chain's entries of steps 1 .. k."""
        net, (b, w) = self.net, tokens.shape
        n = w - 1
        hidden = net.fuse(states[:, :-1])  # [b, n, hidden]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        keys, values, steps = [], [], []
        for k in range(STEPS_AHEAD):
            shifted = tokens[:, 1 + k:]  # [b, n - k]
            m = n - k
            positions = torch.arange(1 + k, 1 + k + m)
            entries = net.inputs(shifted.reshape(-1), hidden[:, :m].reshape(b * m, -1), positions.repeat(b))
            key, value, query, residual = (t.reshape(b, m, *t.shape[1:]) for t in entries)
            keys.append(key)
            values.append(value)
            attended = self._attend(query, keys, values, causal[:m, :m])
            step_logits, out = net.finish(attended.reshape(b, m, -1), residual)
            steps.append(step_logits)
            # step k + 1's row i reads step k's row i, one position on: the last row has no next
            hidden = out[:, :-1]
            keys, values = [x[:, : m - 1] for x in keys], [x[:, : m - 1] for x in values]
        return steps

    def _attend(self, query, keys, values, causal) -> torch.Tensor:
        """query [b, m, h, d]; keys[0], values[0]: step 0's rows (attended causally), keys[j]: step j's
        (each row its own only) -> [b, m, h * d]."""
        groups = query.shape[2] // keys[0].shape[2]
        expand = (lambda x: x.repeat_interleave(groups, dim=2)) if groups > 1 else (lambda x: x)
        scale = query.shape[-1] ** -0.5
        first = torch.einsum("bihd,bjhd->bhij", query, expand(keys[0])) * scale
        first = first.masked_fill(~causal, -torch.inf)
        diagonal = [torch.einsum("bihd,bihd->bhi", query, expand(key))[..., None] * scale for key in keys[1:]]
        weights = torch.softmax(torch.cat([first, *diagonal], dim=-1), dim=-1)
        m = query.shape[1]
        attended = torch.einsum("bhij,bjhd->bihd", weights[..., :m], expand(values[0]))
        for j, value in enumerate(values[1:]):
            attended = attended + weights[..., m + j].permute(0, 2, 1)[..., None] * expand(value)
        return attended

    def loss(self, rows: np.ndarray) -> torch.Tensor:
        tokens, states, top_ids, top_logits = self.batch(rows)
        total = 0.0
        for k, step_logits in enumerate(self.logits(tokens, states)):
            m = step_logits.shape[1]
            # step k's row i predicts the token after position i + 1 + k: the target's top-k there
            ids, logits = top_ids[:, 1 + k: 1 + k + m].flatten(0, 1), top_logits[:, 1 + k: 1 + k + m].flatten(0, 1)
            known = (ids >= 0).any(-1)  # a position whose top-k the head predicts none of teaches nothing
            losses = soft_loss(step_logits.flatten(0, 1)[known], ids[known], logits[known])
            total = total + STEP_DECAY ** k * losses.mean()
        return total

    def agreement(self, rows: np.ndarray) -> list[float]:
        """Per step: how often the head's most likely token is the target's first choice."""
        tokens, states, top_ids, _ = self.batch(rows)
        figures = []
        for k, step_logits in enumerate(self.logits(tokens, states)):
            m = step_logits.shape[1]
            figures.append(round(float((step_logits.argmax(-1) == top_ids[:, 1 + k: 1 + k + m, 0]).float().mean()), 4))
        return figures


def distill_eagle3(config: DistillConfig) -> dict:
    """Run (or resume) the four stages; returns the report written to OUTPUT/eagle3.json."""
    from specdec.runtime import load_model, takes_device

    config.check()
    out, work = Path(config.output), Path(config.output) / "work"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    report, stage = staged(work)
    options = (dict(device=config.device) if takes_device(config.target, config.backend)
               else dict(context=config.prompt_tokens + 8))
    target = load_model(config.target, backend=config.backend, threads=config.threads, **options)
    layers = default_layers(target.layer_count)
    corpus_file = work / "corpus.npy"
    if not corpus_file.exists():
        np.save(corpus_file, stage("corpus", lambda: build_corpus(config, target.tokenizer)))
    corpus = np.load(corpus_file)
    ids = choose_vocabulary(corpus, config.draft_vocab, target.stop_token_ids, target.vocab_size)
    held, train_rows = split_rows(window_count(corpus, config), config)
    prefills = stage("prefill", lambda: prefill_windows(target, corpus, config, layers, ids, held, work))
    to_draft = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_draft[torch.from_numpy(ids)] = torch.arange(len(ids))
    net = _initial_net(target, layers, ids).to(config.device)
    unrolled = Unrolled(net, prefills, to_draft)
    state = stage("train", lambda: fit(net, config, work / "checkpoint", report, "training the EAGLE-3 head",
                                       config.prompt_tokens, unrolled.loss, train_rows,
                                       lambda: {"heldout_agreement_by_depth": unrolled.agreement(held)}))
    save_eagle3(net.cpu(), ids, target.vocab_size, out)
    summary = {"parameters": sum(p.numel() for p in net.parameters()), "layers": list(layers),
               "draft_vocab": len(ids), "windows": len(prefills.tokens), "window_tokens": config.prompt_tokens,
               # how often the target's first choice is a token the head can draft at all (held-out windows)
               "heldout_first_choices_in_vocabulary": round(float(
                   (to_draft[torch.from_numpy(prefills.top_ids[held, :, 0]).long()] >= 0).float().mean()), 4),
               "training_positions": int(len(train_rows) * (config.prompt_tokens - 1)), "steps": state.step,
               "heldout_agreement_by_depth": report.history[-1]["heldout_agreement_by_depth"] if report.history
               else None, "stages": report.stages, "history": report.history}
    (out / "eagle3.json").write_text(json.dumps(summary, indent=1))
    return summary


def _initial_net(target, layers, ids: np.ndarray) -> Eagle3Net:
    """The head to train: the target's input embeddings (frozen), its output rows of the predicted tokens
    as the first lm_head (the head starts by scoring as the target does)."""
    embeddings = target.input_embeddings()
    if embeddings is None:
        raise SpecDecError(f"an EAGLE-3 head reads the target's token embeddings, which specdec cannot read from "
                           f"{target.path}")
    net = Eagle3Net(head_config(target, layers, len(ids)), embeddings.float()[: target.vocab_size])
    outputs = target.output_rows(embeddings)
    with torch.no_grad():
        if outputs is not None:
            net.lm_head.weight.copy_(outputs[torch.from_numpy(ids)].float())
        net.d2t.copy_(torch.from_numpy(ids) - torch.arange(len(ids)))
    return net.train()


def save_eagle3(net: Eagle3Net, ids: np.ndarray, target_vocab: int, directory: Path) -> None:
    """The EAGLE-3 layout: config.json and model.safetensors (no embeddings: the target's are read)."""
    from safetensors.torch import save_file

    config = net.config
    weights = {name: tensor.detach().float().contiguous() for name, tensor in net.state_dict().items()
               if name not in ("embed_tokens",) and not name.startswith("rotary.")}
    weights["d2t"] = net.d2t.detach().clone()
    weights["t2d"] = torch.zeros(target_vocab, dtype=torch.bool)
    weights["t2d"][torch.from_numpy(ids)] = True
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": config.hidden, "num_attention_heads": config.heads, "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim, "intermediate_size": config.intermediate, "vocab_size": config.target_vocab,
        "draft_vocab_size": config.draft_vocab, "target_hidden_size": config.target_hidden,
        "rms_norm_eps": config.rms_eps, "hidden_act": "silu", "tie_word_embeddings": False, **config.rope,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.layers)}, "torch_dtype": "float32"},
        indent=1))
