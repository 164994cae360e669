"""The workload suites of `specdec bench`: built from held-out local material, deterministic, for
base and chat models alike, and reported suite by suite."""

from __future__ import annotations

import itertools
import sysconfig
from pathlib import Path

import pytest

import specdec
from specdec.bench import BenchConfig, run_bench
from specdec.bench.report import markdown, write_report
from specdec.bench.suites import SUITES, heldout_sources, suite_tasks
from specdec.cli import main
from specdec.errors import SpecDecError
from specdec.runtime import RuntimeConfig
from specdec.train import split_files


def test_the_material_is_what_the_demo_pair_never_saw():
    """The held-out files are those `specdec train`'s own split (holdout 0.02) kept out of the demo
    pair's training list, the sorted standard library files (scripts/make_demo_pair.sh): 35 files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.rglob("*.py") if "site-packages" not in p.relative_to(stdlib).parts)
    _, kept_out = split_files(files, 0.02)
    assert [str(p) for p in heldout_sources()] == kept_out and len(kept_out) == 35


@pytest.mark.parametrize("name", list(SUITES))
def test_every_suite_has_enough_deterministic_tasks(name):
    first, second = list(itertools.islice(suite_tasks(name), 8)), list(itertools.islice(suite_tasks(name), 8))
    assert len(first) == 8 and [t.text for t in first] == [t.text for t in second]
    assert all(t.suite == name and t.text and t.messages and t.messages[-1]["role"] == "user" for t in first)


def test_copy_heavy_suites_hold_their_answer_in_the_prompt():
    """What edit, agent, chat and extract ask for is mostly in their prompt (what lookup can copy);
    complete and prose are the controls, with no answer to copy."""
    for name in ("edit", "agent", "chat", "extract"):
        for task in itertools.islice(suite_tasks(name), 8):
            words = task.reference.split()
            assert words and sum(word in task.text for word in words) >= 0.6 * len(words), (name, task.reference)
    assert all(not task.reference for name in ("complete", "prose") for task in itertools.islice(suite_tasks(name), 8))


def test_chat_models_get_their_template_and_base_models_the_text(model_dirs):
    decoder = specdec.load(model_dirs["llama"], device="cpu", plain=True)
    task = next(suite_tasks("chat"))
    assert task.prompt_for(decoder.tokenizer) == task.text
    decoder.tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    try:
        ids = task.prompt_for(decoder.tokenizer)
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    finally:
        decoder.tokenizer.chat_template = None


def test_unknown_suites_are_refused_before_loading():
    with pytest.raises(SpecDecError, match="no suite 'poetry'"):
        run_bench(BenchConfig(target="/nonexistent", suites=("poetry",)))
    assert main(["bench", "--suite", "poetry"]) == 1


def test_a_bench_over_several_suites_reports_each(tmp_path):
    """The demo pair on transformers, two suites, two rounds: per-suite summaries, what the default
    chose, the overview table and the suites plot."""
    config = BenchConfig(runtime=RuntimeConfig(backend="transformers"), suites=("edit", "prose"), limit=2, rounds=2, max_new_tokens=8, modes=("greedy",),
                         gammas=(2,), trees=(), staged=False, peers=False, progress=False)
    data = run_bench(config)
    assert list(data["suites"]) == ["edit", "prose"]
    assert {"default + prediction", "default + history"} <= {s["name"] for s in data["strategies"]}  # edit tasks know their answer
    history_runs = data["suites"]["edit"]["runs"]["greedy"]["default + history"]  # round 1's prompts, then round 2's
    assert all("history" not in history_runs[i]["stats"]["source_trials"] for i in (0, 2)), "each round starts with no history"
    for part in data["suites"].values():
        assert part["prompts"] == 2 and part["rounds"] == 2
        rows = part["summary"]["greedy"]
        assert len(part["runs"]["greedy"]["plain"]) == 4 and rows["plain"]["speedup"] == 1.0
        assert rows["default (auto)"]["drafted_by"] and part["greedy_mismatches"] == {}
    table = markdown(data)
    assert "| suite | mode | default | best fixed strategy |" in table and "## edit: 2 prompts × 2 round(s)" in table
    names = {p.name for p in write_report(data, tmp_path)}
    assert {"suites.png", "edit-speedup.png", "prose-speedup.png", "forward_cost.png"} <= names


def test_the_structured_suites_run_every_strategy_under_their_constraint():
    """The demo pair on transformers, greedy, one bench over both suites: every strategy's answer is valid (the
    valid column: JSON under the suite's schema; one call of its tool with such arguments), greedy texts agree
    with plain decoding's, the default drafts the forced text, and the peers, whose loops take no constraint,
    are not run on them (sampled outputs under a constraint: test_constraints, test_tools)."""
    config = BenchConfig(runtime=RuntimeConfig(backend="transformers"), suites=("json", "tools"), limit=1,
                         max_new_tokens=128, modes=("greedy",), gammas=(2,), trees=(), staged=False, peers=True,
                         progress=False)
    data = run_bench(config)
    for suite in ("json", "tools"):
        part = data["suites"][suite]
        for mode, rows in part["summary"].items():
            for name, row in rows.items():
                peer = next(s for s in data["strategies"] if s["name"] == name)["family"] == "peer"
                assert (row["valid_share"] is None and row["tokens"] == 0) if peer else row["valid_share"] == 1.0, \
                    (suite, mode, name)
        assert part["greedy_mismatches"] == {}
        assert any("forced" in label for label in part["summary"]["greedy"]["default (auto)"]["drafted_by"])
        task = next(iter(suite_tasks(suite)))
        assert task.answer.check(task.reference)  # what the prediction strategy sends
        assert not task.answer.check(task.reference.replace('"returns_value": ', '"returns": '))
    assert "| valid |" in markdown(data)
