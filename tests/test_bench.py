"""`specdec bench` on tiny saved models: every strategy and peer runs, greedy texts agree, reports are written."""

from __future__ import annotations

import json

import pytest

from specdec.analysis import expected_tokens, speedup, weight_bytes_per_token
from specdec.costs import nearest
from specdec.bench import BenchConfig, run_bench
from specdec.bench.report import markdown, read_bench, write_report
from specdec.bench.runner import LoadMonitor
from specdec.cli import main
from specdec.katz import KatzTrigram


@pytest.fixture(scope="module")
def bench_data(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    prompts = root / "prompts.txt"
    prompts.write_text("abcabcab\ndefg hij\nklm klm k\n")
    ngram = root / "ngram.safetensors"
    KatzTrigram.build([[1, 2, 3, 1, 2, 3, 4, 5] * 5], vocab_size=16).save(ngram)
    config = BenchConfig(target=model_dirs["llama"], draft=model_dirs["llama-near"], ngram=str(ngram), prompts=str(prompts),
                         max_new_tokens=10, gammas=(1, 3), trees=((4, 2),), staged_tree=3, progress=False)
    return run_bench(config), root


def test_every_strategy_and_peer_is_measured(bench_data):
    data, _ = bench_data
    names = [s["name"] for s in data["strategies"]]
    assert names == ["plain", "default (auto)", "default, no exploring", "default + history", "chain γ=1", "chain γ=3", "chain γ=auto", "tree 4 γ=2",
                     "staged γ=3 (n-gram)", "staged tree 3 γ=3 (n-gram)", "staged γ=3 (lookup)", "staged tree 3 γ=3 (lookup)",
                     "prompt lookup γ=8", "n-gram γ=4", "HF generate", "HF assisted", "HF prompt lookup"]
    assert list(data["suites"]) == ["prompts"]
    for mode in ("greedy", "sampled"):
        rows = data["suites"]["prompts"]["summary"][mode]
        assert rows["plain"]["speedup"] == 1.0 and rows["plain"]["target_forwards_per_token"] == 1.0
        assert rows["HF generate"]["target_forwards_per_token"] == pytest.approx(1.0, abs=0.11)  # its prefill is a forward too
        for name in ("chain γ=1", "chain γ=3"):
            row = rows[name]
            assert 0 < row["acceptance_rate"] < 1 and row["tokens_per_target_forward"] > 1
            assert row["predicted_speedup"] > 0 and len(row["acceptance_by_position"]) == int(name[-1])
            assert sum(row["accepted_length_counts"].values()) > 0
        assert rows["HF assisted"]["draft_forwards_per_token"] > 0
        assert rows["chain γ=3"]["tree_nodes_per_iteration"] <= 3 < rows["tree 4 γ=2"]["tree_nodes_per_iteration"] <= 4
        for name in ("tree 4 γ=2", "staged tree 3 γ=3 (lookup)"):
            assert rows[name]["tokens_per_target_forward"] > 1 and rows[name]["predicted_speedup"] > 0
        assert all(len(runs) == 3 for runs in data["suites"]["prompts"]["runs"][mode].values())
        for row in rows.values():  # the spread of the per-prompt ratios brackets their median
            q1, q3 = row["speedup_iqr"]
            assert q1 <= row["speedup"] <= q3
        assert rows["default (auto)"]["tokens"] > 0
        assert sum(rows["default (auto)"]["drafted_by"].values()) == pytest.approx(1.0)  # what it chose, iteration by iteration


def test_the_run_records_its_load_and_a_stable_cost_curve(bench_data):
    data, _ = bench_data
    load = data["load"]
    assert load["median"] is not None and load["max"] >= load["median"] and load["own_threads"] >= 1
    assert data["profile"]["rounds"] >= 3 and sorted(data["costs"]["target"])[0] == 1
    assert "Load (1-minute average) during the run" in markdown(data)


def test_foreign_load_is_warned_about():
    quiet, busy = LoadMonitor(own_threads=1), LoadMonitor(own_threads=1)
    quiet.samples, busy.samples = [0.9, 1.1, 1.0], [2.5, 3.0, 2.8]
    assert quiet.summary()["warning"] is None
    warning = busy.summary()["warning"]
    assert "foreign load" in warning and "not trustworthy" in warning


def test_the_quick_preset():
    config = BenchConfig.quick(target="t", limit=None, max_new_tokens=None)
    assert (config.limit, config.max_new_tokens, config.gammas, config.trees, config.staged) == (5, 64, (2,), (), False)
    assert BenchConfig.quick(limit=2).limit == 2


def test_greedy_texts_agree_across_strategies_and_peers(bench_data):
    data, _ = bench_data
    assert data["suites"]["prompts"]["greedy_mismatches"] == {}
    greedy = data["suites"]["prompts"]["runs"]["greedy"]
    for runs in greedy.values():
        assert [r["tokens"] for r in runs] == [r["tokens"] for r in greedy["plain"]]


def test_report_files(bench_data):
    data, root = bench_data
    paths = write_report(data, root / "out")
    assert {p.name for p in paths} == {"bench.json", "bench.md", "prompts-speedup.png", "prompts-speedup_vs_gamma.png",
                                       "prompts-acceptance_by_position.png", "prompts-accepted_lengths.png", "forward_cost.png"}
    assert all(p.stat().st_size > 0 for p in paths)
    assert json.loads((root / "out" / "bench.json").read_text())["suites"]["prompts"]["prompts"] == 3
    assert read_bench(root / "out" / "bench.json")["suites"]["prompts"]["summary"]["greedy"]["plain"]["speedup"] == 1.0
    table = markdown(data)
    assert "| chain γ=3 |" in table and "HF assisted" in table and "identical" in table and "The default drafted:" in table


def test_cli_bench(model_dirs, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abcab"}\n{"prompt": "ghi"}\n')
    code = main(["bench", "--target", model_dirs["llama"], "--draft", model_dirs["llama-near"], "--prompts", str(prompts),
                 "--max-new-tokens", "6", "--gammas", "2", "--trees", "3x2", "--mode", "greedy", "--no-peers", "--out", str(tmp_path / "o")])
    assert code == 0
    out = capsys.readouterr().out
    assert "| chain γ=2 |" in out and "| tree 3 γ=2 |" in out and "| staged γ=3 (lookup) |" in out
    assert (tmp_path / "o" / "prompts-speedup.png").exists()
    assert main(["bench", "--target", model_dirs["llama"], "--prompts", str(tmp_path / "none.txt")]) == 1
    assert "prompts file not found" in capsys.readouterr().err
    assert main(["bench", "--target", model_dirs["llama"], "--gammas", "2,x"]) == 1
    assert main(["bench", "--target", model_dirs["llama"], "--trees", "4"]) == 1
    assert "NODESxDEPTH" in capsys.readouterr().err
    assert main(["bench", "--target", model_dirs["llama"], "--trees", "0x2"]) == 1
    code = main(["bench", "--quick", "--target", model_dirs["llama"], "--draft", model_dirs["llama-near"], "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--mode", "sampled", "--no-peers", "--out", str(tmp_path / "q")])
    out = capsys.readouterr().out
    assert code == 0 and "| default (auto) |" in out and "| chain γ=2 |" in out and "| tree" not in out and "staged" not in out


def test_leviathan_formulas():
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    costs = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}

    def leviathan(alpha: float, gamma: int, t_draft: float) -> float:  # speedup(γ) at measured costs
        return speedup(expected_tokens(alpha, gamma), gamma * t_draft, costs[gamma + 1], costs[1])

    def best_gamma(alpha: float, t_draft: float) -> int:  # among the γ ≥ 1 whose verify was measured
        return max(range(1, 5), key=lambda gamma: leviathan(alpha, gamma, t_draft))

    # free drafts and flat verify cost: speedup = expected tokens
    assert leviathan(0.8, 4, 0.0) == pytest.approx(expected_tokens(0.8, 4))
    assert best_gamma(0.8, 0.0) == 4
    assert best_gamma(0.3, 0.5) == 1
    assert speedup(3.0, 0.5, 1.5) == 1.5  # plain_seconds left at 1: tokens per second
    assert speedup(3.0, 0.5, 1.5, plain_seconds=0.5) == 0.75
    assert weight_bytes_per_token(10, 100, 30, 10, 20) == 65



def test_the_bench_reads_the_verify_cost_at_the_nearest_measured_size():
    costs = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}
    sizes = (0.2, 1.4, 2.9, 3.0, 3.1, 6.0, 7.5, 100)
    assert [nearest(costs, k) for k in sizes] == [1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0]  # a tie: the smaller


def test_an_interrupted_bench_reports_what_finished(model_dirs, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the third prompt's runs: the report covers the two prompts every strategy finished."""
    import specdec.bench.runner as runner

    prompts = tmp_path / "p.txt"
    prompts.write_text("abcab\nghi\nklmk\nabab\n")
    seen, real = [], runner.specdec_strategy  # the prompts run, in order (the warm-up's is the first's)

    def counting(*args, **kwargs):
        strategy = real(*args, **kwargs)
        run = strategy.run

        def interrupting(prompt_ids, *a, **k):
            seen.append(tuple(prompt_ids))
            if len(dict.fromkeys(seen)) == 3 and seen.count(seen[-1]) == 2:  # the third prompt's second strategy
                raise KeyboardInterrupt
            return run(prompt_ids, *a, **k)
        strategy.run = interrupting
        return strategy

    monkeypatch.setattr(runner, "specdec_strategy", counting)
    code = main(["bench", "--target", model_dirs["llama"], "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--gammas", "2", "--trees", "", "--mode", "greedy", "--no-peers", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 0 and "interrupted: the report covers the prompts every strategy finished" in err
    data = read_bench(tmp_path / "o" / "bench.json")
    assert data["interrupted"] and {len(r) for r in data["suites"]["prompts"]["runs"]["greedy"].values()} == {2}
