"""The seams docs/design.md promises ("What drafters, runtimes and requests declare"), kept by tests
rather than by memory: nothing outside drafters/ asks a drafter's class, nothing outside runtime/
compares a backend's name, configuration imports nothing of specdec's but its errors, every line
fits in 120 characters; and what drafters declare is what they do."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import specdec
from specdec import AutoDrafter, ModelDrafter, NgramDrafter, PromptLookupDrafter, SpeculativeDecoder
from specdec.config import TreeShape
from specdec.errors import SpecDecError, check_integer
from specdec.katz import KatzTrigram
from specdec.params import Limits, SamplingParams, request_options

PACKAGE = Path(specdec.__file__).resolve().parent
DRAFTER_CLASSES = {"AutoDrafter", "ModelDrafter", "NgramDrafter", "PromptLookupDrafter", "ContextDrafter"}
BACKEND_NAMES = {"llamacpp", "transformers"}


def modules(outside: str | None = None):
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if outside is None or not relative.startswith(outside + "/"):
            yield relative, ast.parse(path.read_text(encoding="utf-8"))


def isinstance_class_names(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            for name in ast.walk(node.args[1]):
                if isinstance(name, (ast.Name, ast.Attribute)):
                    yield node.lineno, getattr(name, "id", None) or name.attr


def test_no_module_outside_drafters_asks_a_drafters_class():
    found = [f"{module}:{line} {name}" for module, tree in modules(outside="drafters")
             for line, name in isinstance_class_names(tree) if name in DRAFTER_CLASSES]
    assert not found, "ask the drafter what it declares (`Drafter`), not its class: " + ", ".join(found)


def test_no_module_outside_runtime_compares_a_backends_name():
    found = []
    for module, tree in modules(outside="runtime"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                constants = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                found += [f"{module}:{node.lineno} {c!r}" for c in constants if c in BACKEND_NAMES]
    assert not found, "ask the runtime what it declares (`CausalLM`), not its backend's name: " + ", ".join(found)


def test_configuration_is_the_bottom_layer():
    tree = ast.parse((PACKAGE / "config.py").read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {name for name in imported if name.split(".")[0] == "specdec"} == {"specdec.errors"}


def test_every_line_fits_in_120_characters():
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501", "--line-length", "120",
                           "--output-format", "concise", "--no-cache", str(PACKAGE)], capture_output=True, text=True)
    assert ruff.returncode == 0, ruff.stdout[-3000:] + ruff.stderr[-1000:]


# ---------------------------------------------------------------- what drafters declare


@pytest.fixture(scope="module")
def models(model_dirs):
    target = specdec.load_model(model_dirs["llama"], device="cpu")
    return target, specdec.load_model(model_dirs["llama-near"], device="cpu")


def test_each_drafter_declares_what_it_is(models):
    target, near = models
    tree = ModelDrafter(near, tree=TreeShape(nodes=5, width=2))
    declared = {  # draft model, takes chains, keyed draws, shaped by nodes, tree, sequence ids
        "auto": (AutoDrafter(ModelDrafter(near), PromptLookupDrafter()), (near, True, True, True, None, 4)),
        "lookup alone": (AutoDrafter(None, PromptLookupDrafter()), (None, True, True, True, None, 4)),
        "chain": (ModelDrafter(near), (near, False, False, False, None, 1)),
        "tree": (tree, (near, False, False, False, TreeShape(nodes=5, width=2), 6)),
        "lookup": (PromptLookupDrafter(), (None, False, False, False, None, 1)),
    }
    for name, (drafter, expected) in declared.items():
        got = (drafter.draft_model, drafter.takes_chains, drafter.keyed_draws, drafter.shaped_by_nodes, drafter.tree,
               drafter.sequence_ids)
        assert got == expected, name
        assert drafter.reads_target_states is False, name


def test_what_a_drafter_declares_decides_what_a_decoder_allows(models):
    target, near = models
    fixed = SpeculativeDecoder(target, ModelDrafter(near), gamma=2)
    with pytest.raises(SpecDecError, match="prediction is drafted by the default"):
        fixed.request("def f(x):", max_new_tokens=4, prediction="return x")
    with pytest.raises(SpecDecError, match="history is drafted from by the default"):
        SpeculativeDecoder(target, ModelDrafter(near), gamma=2, history=specdec.History())
    auto = SpeculativeDecoder(target, AutoDrafter(ModelDrafter(near), PromptLookupDrafter()), share_acceptance=True)
    assert auto.shared_acceptance is not None and auto.history is not None and auto.draft_model is near
    assert fixed.shared_acceptance is None and fixed.history is None and fixed.draft_model is near


def test_a_drafter_refuses_a_target_it_cannot_fit(models):
    target, near = models
    wrong = NgramDrafter(KatzTrigram.build([[1, 2, 3]], target.vocab_size + 1))
    for drafter in (wrong, ModelDrafter(near, inner=wrong)):  # staged: its draft² must fit too
        with pytest.raises(SpecDecError, match=f"covers {target.vocab_size + 1} tokens"):
            SpeculativeDecoder(target, drafter, gamma=2)


# ---------------------------------------------------------------- a request's values


def test_a_request_carries_its_sampling_and_limits_whole(models):
    target, near = models
    decoder = SpeculativeDecoder(target, ModelDrafter(near), gamma=2)
    whole = decoder.generate("def f(x):", SamplingParams(temperature=0.8, top_k=5, seed=3), Limits(max_new_tokens=6))
    shorthand = decoder.generate("def f(x):", max_new_tokens=6, temperature=0.8, top_k=5, seed=3)
    assert whole.tokens == shorthand.tokens and len(whole.tokens) <= 6
    over = decoder.generate("def f(x):", SamplingParams(temperature=0.8, top_k=5, seed=3), max_new_tokens=6)
    assert over.tokens == whole.tokens
    with pytest.raises(TypeError, match="temprature"):
        decoder.generate("def f(x):", temprature=0)


@pytest.mark.parametrize("make, message", [
    (lambda: Limits(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
    (lambda: Limits(stop=("",)), "stop strings must be non-empty"),
    (lambda: Limits(logprobs=21), "logprobs must be an integer from 0 to 20"),
    (lambda: SamplingParams(seed=-1), "seed must be an integer >= 0"),
    (lambda: SamplingParams(top_k=2.5), "top_k must be an integer >= 0"),
    (lambda: check_integer(True, "slots"), "slots must be a positive integer, got True"),
])
def test_bad_values_are_refused_by_one_check(make, message):
    with pytest.raises(SpecDecError, match=message):
        make()


def test_limits_take_one_stop_string_or_several():
    assert Limits(stop="\n").stop == ("\n",) and Limits(stop=["a", "b"]).stop == ("a", "b")
    sampling, limits = request_options(SamplingParams(temperature=0.5), None, {"max_new_tokens": 3, "seed": 1})
    assert (sampling.temperature, sampling.seed, limits.max_new_tokens) == (0.5, 1, 3)
