"""The `specdec` command: in-process through specdec.cli.main (fast), plus real subprocesses."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import specdec
from specdec.cli import main
from tiny import VOCAB

STATS_KEYS = {
    "target_forwards": int,
    "draft_forwards": int,
    "drafted": int,
    "accepted": int,
    "generated_tokens": int,
    "prompt_tokens": int,
}
FLOAT_OR_NONE_KEYS = ["acceptance_rate", "tokens_per_target_forward", "tokens_per_second"]
EXACT = ["--device", "cpu", "--dtype", "float64"]  # deterministic comparisons on any machine
PROMPT = "hi ej"  # the tiny llama continues it with varied, partly repetitive text


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys, *argv) -> dict:
    code, out, err = cli(capsys, *argv, "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # exactly one JSON object, nothing else on stdout
    return json.loads(lines[0])


def with_newline(text: str) -> str:
    """What generate prints of a text: a newline after it unless it ends in one (the stats line follows)."""
    return text if text.endswith("\n") else text + "\n"


def argparse_exit(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    return info.value.code, capsys.readouterr().err


def error_line(err: str) -> str:
    """The one 'specdec: error: ...' line, which must also be the last line of stderr."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("specdec: error: ")]
    assert len(lines) == 1, err
    assert err.rstrip().splitlines()[-1] == lines[0], err
    return lines[0]


def save_char_tokenizer(directory: Path, vocab: dict[str, int]) -> None:
    backend = Tokenizer(models.BPE(vocab=dict(vocab), merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(directory)


def check_stats(result: dict, prompt_tokens: int | None = None) -> dict:
    """Types and consistency of the --json output."""
    assert set(result) >= {"text", "tokens", "stats"}
    assert isinstance(result["text"], str)
    assert isinstance(result["tokens"], list) and all(isinstance(t, int) and 0 <= t < len(VOCAB) for t in result["tokens"])
    stats = result["stats"]
    for key, kind in STATS_KEYS.items():
        assert isinstance(stats[key], kind) and not isinstance(stats[key], bool), key
        assert stats[key] >= 0, key
    for key in FLOAT_OR_NONE_KEYS:
        assert key in stats
        assert stats[key] is None or (isinstance(stats[key], (int, float)) and math.isfinite(stats[key])), key
    if prompt_tokens is not None:
        assert stats["prompt_tokens"] == prompt_tokens
    assert len(result["tokens"]) == stats["generated_tokens"]
    assert stats["accepted"] <= stats["drafted"]
    if stats["drafted"]:
        assert stats["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["drafted"])
        assert 0 <= stats["acceptance_rate"] <= 1
    else:
        assert stats["acceptance_rate"] is None
    if stats["target_forwards"]:
        assert stats["tokens_per_target_forward"] == pytest.approx(stats["generated_tokens"] / stats["target_forwards"])
        # each target forward commits the accepted drafts plus exactly one more token
        assert stats["generated_tokens"] <= stats["target_forwards"] + stats["accepted"]
    assert stats["tokens_per_second"] is None or stats["tokens_per_second"] > 0
    return stats


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("corpus")
    texts = ["abcdefghijklm n" * 8, "abc abc abc abcabc defdef ghi jkl m n" * 4, "mlkjihgfedcba n" * 3]
    paths = []
    for i, text in enumerate(texts):
        paths.append(root / f"text{i}.txt")
        paths[-1].write_text(text, encoding="utf-8")
    return paths


@pytest.fixture(scope="module")
def ngram_file(model_dirs, text_files, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ngram") / "trigram.safetensors"
    assert main(["ngram", "build", *map(str, text_files), "--tokenizer", model_dirs["llama"], "-o", str(out)]) == 0
    assert out.is_file()
    return out


@pytest.fixture(scope="module")
def swapped_dir(model_dirs, tmp_path_factory) -> Path:
    """The llama draft checkpoint, but its tokenizer has 'a' and 'b' swapped."""
    directory = tmp_path_factory.mktemp("swapped") / "draft"
    shutil.copytree(model_dirs["llama-draft"], directory)
    vocab = dict(VOCAB)
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    save_char_tokenizer(directory, vocab)
    return directory


@pytest.fixture(scope="module")
def broken_dirs(model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken")
    dirs = {}
    for name in ("badjson", "pickled", "truncated", "notokenizer", "noconfig"):
        dirs[name] = root / name
        shutil.copytree(model_dirs["llama"], dirs[name])
    (dirs["badjson"] / "config.json").write_text("{oops")
    (dirs["noconfig"] / "config.json").unlink()
    (dirs["pickled"] / "model.safetensors").rename(dirs["pickled"] / "pytorch_model.bin")
    data = (dirs["truncated"] / "model.safetensors").read_bytes()
    (dirs["truncated"] / "model.safetensors").write_bytes(data[: len(data) // 3])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (dirs["notokenizer"] / name).unlink(missing_ok=True)
    return dirs


@pytest.fixture(scope="module")
def plain_greedy(model_dirs) -> dict:
    """Reference: plain greedy decoding through the library, float64 on the CPU."""
    decoder = specdec.load(model_dirs["llama"], device="cpu", dtype="float64")
    return decoder.generate(PROMPT, max_new_tokens=16, temperature=0).to_dict()


# ----------------------------------------------------------------------------- generate


def test_generate_streams_text_and_a_stats_line(model_dirs, capsys):
    args = ["generate", "abc", "--target", model_dirs["llama"], "--plain", "--temperature", "0", "--max-new-tokens", "8"]
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert out.endswith("\n") and out.strip()
    stats_lines = [line for line in err.splitlines() if line.startswith("[specdec]")]
    assert len(stats_lines) == 1, err
    assert re.search(r"\b8 tokens\b", stats_lines[0]) and "target forwards" in stats_lines[0]
    assert "drafter" not in stats_lines[0]  # plain decoding names no drafter
    # the streamed text is the same as the --json text of the same run
    result = cli_json(capsys, *args)
    assert out == with_newline(result["text"])
    assert len(result["tokens"]) == 8


def test_json_plain_decoding(model_dirs, capsys, plain_greedy):
    result = cli_json(capsys, "generate", PROMPT, "--target", model_dirs["llama"], "--plain", "--temperature", "0",
                      "--max-new-tokens", "16", *EXACT)
    stats = check_stats(result, prompt_tokens=len(PROMPT))
    assert stats["generated_tokens"] == 16
    assert stats["draft_forwards"] == 0 and stats["drafted"] == 0 and stats["accepted"] == 0
    assert stats["acceptance_rate"] is None
    assert stats["target_forwards"] == 16 and stats["tokens_per_target_forward"] == 1.0
    assert result["text"] == plain_greedy["text"] and result["tokens"] == plain_greedy["tokens"]


@pytest.mark.parametrize(
    "drafter",
    ["draft", "draft-auto", "draft-gamma1", "padded-draft", "self-draft", "prompt-lookup", "prompt-lookup-auto",
     "ngram", "ngram-top1"],
)
def test_greedy_output_does_not_depend_on_the_drafter(model_dirs, ngram_file, capsys, plain_greedy, drafter):
    options = {
        "draft": ["--draft", model_dirs["llama-draft"]],
        "draft-auto": ["--draft", model_dirs["llama-draft"], "--gamma", "auto"],
        "draft-gamma1": ["--draft", model_dirs["llama-draft"], "--gamma", "1"],
        "padded-draft": ["--draft", model_dirs["llama-padded"], "--gamma", "3"],
        "self-draft": ["--draft", model_dirs["llama"], "--gamma", "5"],  # every draft is accepted
        "prompt-lookup": ["--prompt-lookup"],
        "prompt-lookup-auto": ["--prompt-lookup", "--gamma", "auto"],
        "ngram": ["--ngram", ngram_file],
        "ngram-top1": ["--ngram", ngram_file, "--ngram-top1", "--gamma", "2"],
    }[drafter]
    result = cli_json(capsys, "generate", PROMPT, "--target", model_dirs["llama"], "--temperature", "0",
                      "--max-new-tokens", "16", *EXACT, *options)
    stats = check_stats(result, prompt_tokens=len(PROMPT))
    assert result["text"] == plain_greedy["text"]
    assert result["tokens"] == plain_greedy["tokens"]
    assert stats["target_forwards"] <= 16
    if "draft" in drafter:
        assert stats["drafted"] > 0 and stats["draft_forwards"] > 0
    else:
        assert stats["draft_forwards"] == 0  # prompt lookup and the n-gram need no network
    if drafter in ("ngram", "prompt-lookup"):
        assert stats["drafted"] > 0
    if drafter == "prompt-lookup":
        assert stats["accepted"] > 0  # the continuation repeats itself
    if drafter == "self-draft":
        assert stats["accepted"] == stats["drafted"] > 0
        assert stats["target_forwards"] < 16
    if drafter == "draft-gamma1":
        assert max(stats["gammas"]) <= 1


def test_stats_line_names_the_drafter(model_dirs, capsys):
    code, out, err = cli(capsys, "generate", "abc", "--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"],
                         "--temperature", "0", "--max-new-tokens", "8", "--gamma", "auto", "--device", "cpu")
    assert code == 0, err
    line = [line for line in err.splitlines() if line.startswith("[specdec]")]
    assert len(line) == 1 and "gamma auto" in line[0] and "draft forwards" in line[0] and "acceptance" in line[0]


def test_sampling_with_a_seed_is_repeatable(model_dirs, capsys):
    args = ["generate", "abc", "--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"],
            "--temperature", "1", "--seed", "7", "--max-new-tokens", "12", "--top-k", "8", "--top-p", "0.9", *EXACT]
    first, second = cli_json(capsys, *args), cli_json(capsys, *args)
    check_stats(first)
    assert first["tokens"] == second["tokens"] and first["text"] == second["text"]
    assert len(first["tokens"]) == 12


def test_stop_string(model_dirs, capsys, plain_greedy):
    text = plain_greedy["text"]
    stop = text[3:5]
    result = cli_json(capsys, "generate", PROMPT, "--target", model_dirs["llama"], "--temperature", "0",
                      "--max-new-tokens", "16", "--stop", stop, *EXACT)
    assert result["finish_reason"] == "stop"
    assert result["text"] == text[: text.index(stop)]


# ----------------------------------------------------------------------------- argparse errors (exit 2)


@pytest.mark.parametrize("gamma", ["0", "-1", "x", "1.5"])
def test_bad_gamma_is_an_argparse_error(model_dirs, capsys, gamma):
    code, err = argparse_exit(capsys, "generate", "abc", "--target", model_dirs["llama"], "--prompt-lookup", "--gamma", gamma)
    assert code == 2
    assert "--gamma" in err and "positive integer or 'auto'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "drafters",
    [["--draft", "D", "--prompt-lookup"], ["--draft", "D", "--ngram", "N"], ["--ngram", "N", "--prompt-lookup"]],
    ids=lambda d: "+".join(a for a in d if a.startswith("--")),
)
def test_two_drafters_without_staging_are_refused(model_dirs, capsys, drafters):
    """With a fixed gamma; under the default policy a draft model and prompt lookup share one tree."""
    code, _, err = cli(capsys, "generate", "abc", "--target", model_dirs["llama"], "--gamma", "3", *drafters)
    assert code == 1 and "choose at most one" in error_line(err)


def test_plain_refuses_drafter_flags(model_dirs, capsys):
    code, _, err = cli(capsys, "generate", "abc", "--target", model_dirs["llama"], "--plain", "--prompt-lookup")
    assert code == 1 and "--plain decodes without a drafter" in error_line(err)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tree", "4"], "drafted by a draft model"),
        (["--tree", "4", "--ngram", "N"], "drafted by a draft model"),
        (["--depth", "3"], "add --tree NODES"),
        (["--tree-children", "top"], "add --tree NODES"),
        (["--inner-gamma", "2"], "add --staged"),
        (["--staged"], "needs a draft model and a draft²"),
        (["--staged", "--draft", "D"], "needs a draft model and a draft²"),
        (["--staged", "--prompt-lookup"], "needs a draft model and a draft²"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else "",
)
def test_meaningless_tree_and_staged_combinations_are_refused(model_dirs, capsys, argv, message):
    code, _, err = cli(capsys, "generate", "abc", "--target", model_dirs["llama"], *argv)
    assert code == 1 and message in error_line(err)


@pytest.mark.parametrize("argv", [["--tree", "0"], ["--tree", "x"], ["--tree-width", "-1"], ["--depth", "0"], ["--inner-gamma", "0"], ["--tree-children", "all"]])
def test_bad_tree_numbers_are_argparse_errors(capsys, argv):
    code, err = argparse_exit(capsys, "generate", "abc", *argv)
    assert code == 2 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--draft", "{llama-near}", "--tree", "6", "--depth", "3"],
        ["--draft", "{llama-near}", "--tree", "6", "--tree-children", "top"],
        ["--draft", "{llama-near}", "--staged", "--prompt-lookup", "--inner-gamma", "3"],
        ["--draft", "{llama-near}", "--staged", "--prompt-lookup", "--tree", "5", "--depth", "4"],
    ],
    ids=["tree", "tree-top", "staged", "staged-tree"],
)
@pytest.mark.parametrize("temperature", ["0", "1"])
def test_tree_and_staged_generate(model_dirs, capsys, argv, temperature):
    argv = [a.format(**model_dirs) for a in argv]
    result = cli_json(capsys, "generate", PROMPT, "--target", model_dirs["llama"], *argv, *EXACT,
                      "--temperature", temperature, "--seed", "3", "--max-new-tokens", "24")
    stats = result["stats"]
    assert len(result["tokens"]) == 24 and stats["generated_tokens"] == 24
    assert len(stats["tree_nodes"]) == stats["iterations"] == stats["target_forwards"]
    if "--tree" in argv:
        budget = int(argv[argv.index("--tree") + 1])
        assert max(stats["tree_nodes"]) <= budget and max(stats["tree_nodes"]) > 1
    if "--staged" in argv:  # at most one draft-model forward per spine token; greedy text repeats, so fewer
        assert stats["draft_forwards"] <= sum(stats["tree_nodes"])
        assert temperature == "1" or stats["draft_forwards"] < stats["iterations"] * int(argv[argv.index("--depth") + 1] if "--depth" in argv else 4)
    if temperature == "0":
        plain = cli_json(capsys, "generate", PROMPT, "--target", model_dirs["llama"], *EXACT,
                         "--temperature", "0", "--max-new-tokens", "24")
        assert result["tokens"] == plain["tokens"]


def test_missing_arguments(capsys):
    assert argparse_exit(capsys)[0] == 2
    code, err = argparse_exit(capsys, "ngram", "build", "x.txt", "--tokenizer", "t")  # -o is required
    assert code == 2 and "-o" in err


def test_no_target_uses_the_demo_pair_with_its_draft(model_dirs, tmp_path, monkeypatch, capsys):
    import specdec.demo

    monkeypatch.setattr(specdec.demo, "DEMO_DIR", tmp_path / "demo")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert main(["generate", "abc"]) == 1
    assert "demo pair is not installed" in capsys.readouterr().err
    shutil.copytree(model_dirs["llama"], tmp_path / "demo" / "target")
    shutil.copytree(model_dirs["llama-near"], tmp_path / "demo" / "draft")
    assert main(["generate", "abc"]) == 1  # the default backend makes GGUF files of the demo, which this tokenizer cannot give
    assert "not a byte-level BPE tokenizer" in capsys.readouterr().err
    assert main(["generate", "abc", "--temperature", "0", "--max-new-tokens", "12", "--json", "--backend", "transformers"]) == 0
    demo = json.loads(capsys.readouterr().out)
    assert demo["stats"]["draft_forwards"] > 0
    assert main(["generate", "abc", "--temperature", "0", "--max-new-tokens", "12", "--json", "--target", model_dirs["llama"]]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == demo["tokens"]


# ----------------------------------------------------------------------------- library errors (exit 1)


BAD_GENERATE = {
    "empty-prompt": (["", "--target", "{llama}"], r"the prompt is empty"),
    "long-prompt": (["a" * 64, "--target", "{llama}"], r"the prompt has 64 tokens; the context holds 64"),
    "negative-temperature": (["abc", "--target", "{llama}", "--temperature", "-1"], r"temperature must be >= 0"),
    "top-p-zero": (["abc", "--target", "{llama}", "--top-p", "0"], r"top_p must be in \(0, 1\]"),
    "top-p-above-one": (["abc", "--target", "{llama}", "--top-p", "1.01"], r"top_p must be in \(0, 1\]"),
    "negative-top-k": (["abc", "--target", "{llama}", "--top-k", "-3"], r"top_k must be an integer >= 0"),
    "negative-max-new-tokens": (["abc", "--target", "{llama}", "--max-new-tokens", "-1"], r"max_new_tokens must be an integer >= 0"),
    "empty-stop": (["abc", "--target", "{llama}", "--stop", ""], r"stop strings must be non-empty"),
    "unknown-dtype": (["abc", "--target", "{llama}", "--dtype", "int8"], r"unknown dtype 'int8'"),
    "missing-target": (["abc", "--target", "{tmp}/nowhere"], r"model not found: .*nowhere"),
    "missing-draft": (["abc", "--target", "{llama}", "--draft", "{tmp}/nodraft"], r"model not found: .*nodraft"),
    "no-config": (["abc", "--target", "{noconfig}"], r"noconfig has no config\.json"),
    "invalid-config": (["abc", "--target", "{badjson}"], r"config\.json is not valid JSON"),
    "pickled-weights": (["abc", "--target", "{pickled}"], r"no \.safetensors weights \(found pytorch_model\.bin: pickled weights are never loaded"),
    "truncated-weights": (["abc", "--target", "{truncated}"], r"could not load the model in .*truncated"),
    "no-tokenizer": (["abc", "--target", "{notokenizer}"], r"has no tokenizer files"),
    "corrupt-draft": (["abc", "--target", "{llama}", "--draft", "{truncated}"], r"could not load the model in .*truncated"),
    "mismatched-draft": (["abc", "--target", "{llama}", "--draft", "{swapped}"],
                         r"draft model .*tokenizer does not match the target's: token 'a' has id 1 in the target but has id 2"),
    "missing-ngram": (["abc", "--target", "{llama}", "--ngram", "{tmp}/none.safetensors"], r"n-gram model file not found"),
    "foreign-ngram": (["abc", "--target", "{llama}", "--ngram", "{foreign_ngram}"], r"built with another tokenizer than the target's"),
}


@pytest.fixture(scope="module")
def foreign_ngram(swapped_dir, text_files, tmp_path_factory) -> Path:
    """An n-gram file built with the swapped tokenizer: same size, another fingerprint."""
    out = tmp_path_factory.mktemp("foreign") / "foreign.safetensors"
    assert main(["ngram", "build", str(text_files[0]), "--tokenizer", str(swapped_dir), "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize("case", list(BAD_GENERATE))
def test_bad_input_exits_1_with_the_message(model_dirs, broken_dirs, swapped_dir, foreign_ngram, tmp_path, capsys, case):
    argv, match = BAD_GENERATE[case]
    names = {"llama": model_dirs["llama"], "tmp": tmp_path, "swapped": swapped_dir, "foreign_ngram": foreign_ngram,
             **broken_dirs}
    argv = [a.format(**names) for a in argv]
    if "--max-new-tokens" not in argv:
        argv += ["--max-new-tokens", "4"]
    code, out, err = cli(capsys, "generate", *argv, "--device", "cpu")
    assert code == 1
    assert out == ""
    assert re.search(match, error_line(err)), err


def test_ngram_build_reports_and_the_file_drafts(model_dirs, text_files, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    code, stdout, err = cli(capsys, "ngram", "build", *text_files, "--tokenizer", model_dirs["llama"], "-o", out)
    assert code == 0, err
    assert f"wrote {out} (vocabulary {len(VOCAB)})" in err
    assert out.is_file()
    model = specdec.load(model_dirs["llama"], ngram=str(out), device="cpu").drafter.model
    assert model.vocab_size == len(VOCAB)
    a, b = VOCAB["a"], VOCAB["b"]
    assert model.top_token([a, b]) == VOCAB["c"]  # "abc" dominates the corpus


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing-text", r"text file not found: .*missing\.txt"),
        ("missing-tokenizer", r"could not load a tokenizer from .*notok"),
    ],
    ids=["missing-text", "missing-tokenizer"],
)
def test_ngram_build_errors(model_dirs, text_files, tmp_path, capsys, case, match):
    files = [text_files[0], tmp_path / "missing.txt"] if case == "missing-text" else text_files
    tokenizer = tmp_path / "notok" if case == "missing-tokenizer" else model_dirs["llama"]
    code, out, err = cli(capsys, "ngram", "build", *files, "--tokenizer", tokenizer, "-o", tmp_path / "out.safetensors")
    assert code == 1
    assert re.search(match, error_line(err)), err
    assert not (tmp_path / "out.safetensors").exists()


def test_ngram_build_into_a_missing_directory(model_dirs, text_files, tmp_path, capsys):
    out = tmp_path / "no-such-dir" / "model.safetensors"
    code, _, err = cli(capsys, "ngram", "build", text_files[0], "--tokenizer", model_dirs["llama"], "-o", out)
    assert code == 1
    assert re.search(r"cannot write n-gram model to .*no-such-dir", error_line(err))


# ----------------------------------------------------------------------------- real subprocesses


def test_python_m_specdec_subprocess(model_dirs, capsys, tmp_path):
    """The installed module entry: a successful run and an error run, side by side to save wall time."""
    env = dict(os.environ)
    repo = str(Path(specdec.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
    base = [sys.executable, "-m", "specdec", "generate", "abc", "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"]
    ok = subprocess.Popen([*base, "--target", model_dirs["llama"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=tmp_path)
    bad = subprocess.Popen([*base, "--target", str(tmp_path / "missing-model")], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    ok_out, ok_err = ok.communicate(timeout=120)
    bad_out, bad_err = bad.communicate(timeout=120)

    assert ok.returncode == 0, ok_err
    expected = cli_json(capsys, "generate", "abc", "--target", model_dirs["llama"], "--temperature", "0",
                        "--max-new-tokens", "8", "--device", "cpu")
    assert ok_out == with_newline(expected["text"])
    assert any(line.startswith("[specdec] 8 tokens") for line in ok_err.splitlines()), ok_err
    assert "Traceback" not in ok_err

    assert bad.returncode == 1
    assert bad_out == ""
    assert "Traceback" not in bad_err
    lines = bad_err.strip().splitlines()
    assert len(lines) == 1, bad_err
    assert re.fullmatch(r"specdec: error: model not found: .*missing-model", lines[0])


ANSWERED_AT_ONCE = """
import contextlib, io, json, socket, sys
from specdec.cli import main

listening = socket.create_server(("127.0.0.1", 0))
cases = [["--help"], ["--version"], ["generate", "x", "--temprature", "1"], ["generate", "x", "--temperature", "-1"],
         ["generate", "x", "--top-p", "2"], ["generate"], ["generate", "x", "--target", "Qwen/Qwen2.5-0.5B-Instruct"],
         ["serve", "--port", str(listening.getsockname()[1])], ["serve", "--target", "Qwen/Qwen2.5-0.5B-Instruct"],
         ["verify", "--temperature", "-2"], ["train", "--help"]]
answers = []
for argv in cases:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    answers.append([code, out.getvalue() + err.getvalue()])
print(json.dumps({"answers": answers, "torch": "torch" in sys.modules}))
"""


def test_the_cli_answers_before_it_imports_torch(tmp_path):
    """Help, the version, a misspelt flag, bad values, a missing prompt, a hub id, a port in use: a
    fresh interpreter answers each without importing torch (it took 5-55 s behind the imports)."""
    env = dict(os.environ, PYTHONPATH=str(Path(specdec.__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", ANSWERED_AT_ONCE], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    (help_, version, misspelt, temperature, top_p, no_prompt, hub, port, serve_hub, verify, train_help) = report["answers"]
    assert help_[0] == 0 and "generate" in help_[1] and version == [0, f"specdec {specdec.__version__}\n"]
    assert misspelt[0] == 2 and "unrecognized arguments: --temprature" in misspelt[1]
    assert temperature == [1, "specdec: error: temperature must be >= 0, got -1.0\n"]
    assert top_p[0] == 1 and "top_p must be in (0, 1]" in top_p[1] and verify[0] == 1
    assert no_prompt[0] == 1 and "--prompt-file" in no_prompt[1]
    for answer in (hub, serve_hub):
        assert answer[0] == 1 and "never downloads" in answer[1] and "huggingface-cli download" in answer[1]
    assert port[0] == 1 and "cannot listen on 127.0.0.1" in port[1] and "serving" not in port[1]
    assert train_help[0] == 0 and "--holdout" in train_help[1]
    assert not report["torch"], "torch was imported before the answers"


def test_the_prompt_from_stdin_or_a_file(model_dirs, tmp_path, capsys, monkeypatch):
    args = ["--target", model_dirs["llama"], "--plain", "--temperature", "0", "--max-new-tokens", "4", "--device", "cpu"]
    expected = cli_json(capsys, "generate", "abc", *args)["tokens"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("abc"))
    assert cli_json(capsys, "generate", "-", *args)["tokens"] == expected
    (tmp_path / "prompt.txt").write_text("abc", encoding="utf-8")
    assert cli_json(capsys, "generate", "--prompt-file", tmp_path / "prompt.txt", *args)["tokens"] == expected
    code, out, err = cli(capsys, "generate", "abc", "--prompt-file", tmp_path / "prompt.txt", *args)
    assert code == 1 and "one of them" in err


def test_the_package_exports_on_first_use():
    import importlib

    import specdec.params

    assert specdec.SamplingParams is specdec.params.SamplingParams and "SamplingParams" in dir(specdec)
    assert specdec.runtime is importlib.import_module("specdec.runtime"), "a submodule, as an attribute"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        specdec.nothing
