"""Train a draft head for the user's own target: `specdec train --distill-from TARGET --small-head -o DIR`.

The same first stages as a distilled draft (`specdec.distill`: corpus, the target's generations with
its final-norm states recorded as they are generated, the pruned vocabulary), so one DIR/work
serves both. Then the head (`specdec.runtime.head`) learns to guess the target's next state from
(its state, the next token), scored through the target's own output rows:

- loss per position = KL(the target's top-k soft labels || the head's q) + a small regression of the
  guessed state onto the target's, for `unroll` positions in a row, each one after the first reading
  the head's own guess (as it will when it drafts: "training-time test"); the target's state it starts
  from carries a little noise (EAGLE's, so that guesses near it are read alike);
- held-out agreement per depth: how often the head's most likely token at depth d is the target's
  (from the target's states at depth 1, its own guesses deeper): about the per-position acceptance of
  a greedy chain.

DIR then holds head.safetensors and head.json (shape, vocabulary map, training summary).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from specdec.config import DistillConfig
from specdec.distill import Generations, Report, fit, prepare, soft_loss, split_rows, target_embeddings
from specdec.errors import SpecDecError
from specdec.runtime.head import HeadNet, HeadShape, save_head
from specdec.runtime.pruned import VocabMap

# `specdec train --small-head`'s, where the draft's differ
HEAD_DEFAULTS = dict(batch_size=256, steps=2000, lr=1e-3, weight_decay=0.0)
UNROLL = 3  # positions trained in a row from one state of the target's
STATE_WEIGHT = 0.1  # of the state regression beside the KL
# Gaussian noise on the target's state fed in training, relative to its RMS (EAGLE: robust to its own guesses)
STATE_NOISE = 0.1


def head_inputs(target, vocab_map: VocabMap) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embeddings of the predicted tokens plus a zero row for the rest
    ([vocab + 1, width]), and its output rows of them ([vocab, width])."""
    embeddings = target_embeddings(target)
    outputs = target_output_rows(target, embeddings)
    if embeddings is None or outputs is None:
        raise SpecDecError("a draft head needs the target's embedding and output matrices, which specdec cannot "
                           f"read from {target.path}")
    ids = list(vocab_map.target_ids)
    return torch.cat([embeddings[ids], torch.zeros(1, embeddings.shape[1])]), outputs[ids]


def target_output_rows(target, embeddings: torch.Tensor | None) -> torch.Tensor | None:
    """The target's output matrix [vocab, width] in float32: `embeddings` (its input embeddings,
    already read) where a GGUF file ties the two, not dequantized a second time."""
    return target.output_rows(embeddings)


class Windows:
    """Training windows: (row, t) where the target generated tokens t .. t + UNROLL, so the head
    reads its state before token t and learns tokens t + 1 .. t + UNROLL. Arrays are the
    generations' in draft ids: tokens [n, length], soft labels [n, length, k], states [n, length, width]."""

    def __init__(self, generations: Generations, vocab_map: VocabMap):
        to_draft = vocab_map.to_draft()
        self.tokens = torch.from_numpy(to_draft[np.maximum(generations.tokens, 0)])
        mapped = to_draft[generations.top_ids]
        self.top_ids = torch.from_numpy(np.where(mapped == vocab_map.unknown, -1, mapped))
        self.top_logits = torch.from_numpy(np.nan_to_num(generations.top_logits.astype(np.float32), neginf=-1e4))
        self.states = torch.from_numpy(generations.states)  # float16
        generated = generations.generated()
        ok = generated.copy()
        for k in range(1, UNROLL + 1):
            ok[:, :-k] &= generated[:, k:]
        ok[:, -UNROLL:] = False
        self.rows, self.starts = (torch.from_numpy(a) for a in np.nonzero(ok))

    def __len__(self) -> int:
        return len(self.rows)

    def loss(self, net: HeadNet, windows: np.ndarray, device: str) -> torch.Tensor:
        """Mean over the windows' positions of KL + STATE_WEIGHT x the state regression."""
        rows, starts = self.rows[windows], self.starts[windows]
        state = self.states[rows, starts].float().to(device)
        state = state + STATE_NOISE * state.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn_like(state)
        total = torch.zeros((), device=device)
        for k in range(UNROLL):
            at = starts + k + 1
            guessed, logits = net(state, self.tokens[rows, starts + k].to(device))
            truth = self.states[rows, at].float().to(device)
            total = total + soft_loss(logits, self.top_ids[rows, at].to(device),
                                      self.top_logits[rows, at].to(device)).mean()
            total = total + STATE_WEIGHT * torch.nn.functional.smooth_l1_loss(guessed.float(), truth)
            state = guessed
        return total / UNROLL

    def agreement(self, net: HeadNet, windows: np.ndarray, device: str) -> list[float]:
        """Per depth 1..UNROLL: how often the head's most likely token is the target's."""
        rows, starts = self.rows[windows], self.starts[windows]
        state, agreed = self.states[rows, starts].float().to(device), []
        for k in range(UNROLL):
            at = starts + k + 1
            state, logits = net(state, self.tokens[rows, starts + k].to(device))
            agreed.append(round(float((logits.argmax(-1).cpu() == self.top_ids[rows, at][:, 0]).float().mean()), 4))
        return agreed


def output_scale(states: torch.Tensor) -> torch.Tensor:
    """Per channel, the root mean square of the target's states after RMS normalisation: where the
    head's output norm starts (the target's final-norm weights, as seen in its states)."""
    sample = states.reshape(-1, states.shape[-1])
    sample = sample[sample.abs().sum(-1) > 0][:20000].float()
    normalised = sample * torch.rsqrt(sample.pow(2).mean(-1, keepdim=True) + 1e-6)
    return normalised.pow(2).mean(0).sqrt()


def distill_head(config: DistillConfig, shape: HeadShape | None = None) -> dict:
    """Run (or resume) a head's training; returns the summary also written into DIR/head.json."""
    if not config.head:
        raise ValueError("distill_head trains heads: set config.head")
    run = prepare(config)
    inputs, outputs = head_inputs(run.target, run.vocab_map)
    shape = shape or HeadShape(width=outputs.shape[1], inner=outputs.shape[1], vocab=len(run.vocab_map.target_ids))
    net = HeadNet(shape, inputs, outputs).to(config.device)
    windows = Windows(run.generations, run.vocab_map)
    if len(windows) < 2:
        raise SpecDecError("the target's generations hold no window long enough to train a head on")
    with torch.no_grad():
        net.out_norm.weight.copy_(output_scale(windows.states))
    held_rows, _ = split_rows(len(run.generations.tokens), config)  # whole continuations held out, as for a draft
    is_held = np.isin(windows.rows.numpy(), held_rows)
    held, train = np.flatnonzero(is_held)[:4096], np.flatnonzero(~is_held)
    if len(held) == 0 or len(train) == 0:
        raise SpecDecError(f"the {len(held_rows)} held-out continuations hold no training window (or all of them do): "
                           "use more prompts or another --holdout")
    work, history = Path(config.output) / "work", Report()  # the head's own history (a draft may share the work folder)
    state = run.stage("train head", lambda: fit(
        net, config, work / "head-checkpoint", history, "training the head", UNROLL,
        lambda rows: windows.loss(net, rows, config.device),
        train, lambda: {"heldout_agreement_by_depth": windows.agreement(net, held, config.device)}))
    summary = {
        "target": str(config.target), "shape": asdict(shape), "parameters": sum(p.numel() for p in net.parameters()),
        "windows": len(windows), "steps": state.step,
        "train_seconds": round(state.seconds, 1), "stages": run.report.stages, "history": history.history,
        "heldout_agreement_by_depth": history.history[-1]["heldout_agreement_by_depth"] if history.history else None,
        "total_seconds": round(sum(s["seconds"] for s in run.report.stages.values()), 1),
    }
    save_head(net.cpu(), run.vocab_map, config.output, {"training": summary})
    return summary
