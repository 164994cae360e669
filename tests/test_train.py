"""`specdec train`: tiny runs that train, resume and export loadable checkpoints (distilling: test_distill.py)."""

from __future__ import annotations

import json

import pytest
import torch

import specdec
from specdec.cli import main
from specdec.config import TrainConfig
from specdec.train import train

TINY = dict(vocab_size=300, hidden_size=32, layers=1, heads=2, context=64, seq_len=16, batch_size=4,
            lr=3e-3, warmup=2, eval_every=5, eval_batches=2, save_every=5, progress=False, holdout=0.1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        lines = [f"def function_{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(30)]
        (root / f"module_{i}.py").write_text("".join(lines))
    return root


def test_training_lowers_heldout_loss_and_exports_a_loadable_model(corpus, tmp_path):
    state = train(TrainConfig(files=[str(corpus)], output=str(tmp_path / "m"), steps=30, **TINY))
    losses = [h["heldout_loss"] for h in state.history]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5
    report = json.loads((tmp_path / "m" / "training.json").read_text())
    assert report["steps"] == 30 and report["heldout_files"] >= 1 and report["heldout_loss"] == losses[-1]
    model = specdec.load_model(tmp_path / "m", device="cpu")
    assert model.vocab_size <= 300 and model.max_length == 64
    text = specdec.SpeculativeDecoder(model).generate("def", max_new_tokens=8, temperature=0).text
    assert isinstance(text, str)


def test_an_interrupted_run_resumes_from_its_checkpoint(corpus, tmp_path):
    out = str(tmp_path / "m")
    first = train(TrainConfig(files=[str(corpus)], output=out, steps=10, **TINY))
    assert first.step == 10
    resumed = train(TrainConfig(files=[str(corpus)], output=out, steps=20, **TINY))
    assert resumed.step == 20 and resumed.tokens_seen == 20 * 4 * 16
    assert [h["step"] for h in resumed.history] == [5, 10, 15, 20]
    assert resumed.history[:2] == first.history


def test_cli_train_and_its_errors(corpus, tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["train", str(corpus), "-o", str(out), "--vocab-size", "300", "--hidden-size", "32", "--layers", "1",
            "--heads", "2", "--context", "64", "--seq-len", "16", "--batch-size", "2", "--steps", "3", "--eval-every", "3"]
    assert main(args) == 0
    assert (out / "model.safetensors").exists() and (out / "checkpoint" / "state.json").exists()
    assert "held-out loss" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.py"), "-o", str(out)]) == 1
    assert "training file not found" in capsys.readouterr().err
    assert main(args[:-4] + ["--seq-len", "128"]) == 1
    assert "exceeds the model context" in capsys.readouterr().err


def test_schedule_warms_up_then_decays_to_the_floor():
    from specdec.train import learning_rate

    config = TrainConfig(files=["x"], output="y", steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    rates = [learning_rate(config, s) for s in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
    assert rates[-1] == pytest.approx(0.1, abs=1e-3)
    assert torch.tensor(rates).min() >= 0.1 - 1e-9
