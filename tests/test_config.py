"""Configurations (specdec/config.py): one reader of options for the CLI and Ray Serve's builder,
names that cannot drift from the dataclasses and the parser, and the drafter each combination of
drafter flags means."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

import pytest

from specdec import config
from specdec.cli import build_parser
from specdec.cli.arguments import config_options
from specdec.config import DEFAULT_BATCH, DecoderConfig, DrafterSpec, Options, ServeConfig, serve_config
from specdec.drafters import TreeShape
from specdec.errors import SpecDecError
from specdec.runtime import RuntimeConfig


def flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest for a in sub._actions if a.option_strings}


def test_every_runtime_field_is_an_option_and_every_option_a_flag_of_serve():
    assert set(config.RUNTIME_OPTIONS) == {f.name for f in fields(RuntimeConfig)}
    assert {*config.RUNTIME_OPTIONS, *config.DRAFTER_OPTIONS, *config.SERVE_OPTIONS, "target"} <= flags("serve")
    assert {*config.RUNTIME_OPTIONS, *config.DRAFTER_OPTIONS, "target"} <= flags("generate")


def test_options_left_out_take_the_dataclass_defaults(monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    monkeypatch.delenv("SPECDEC_METRICS_KEY", raising=False)
    parsed = serve_config(config_options(build_parser().parse_args(["serve"])))
    demo_template = config.read_template(config.DEMO_CHAT_TEMPLATE)  # no target: the demo pair, with its template
    assert parsed == replace(ServeConfig(), decoder=replace(ServeConfig().decoder, chat_template=demo_template)), \
        "the CLI's defaults are the dataclasses' own"
    assert parsed.decoder.prefix_cache == config.SERVER_PREFIX_TOKENS and parsed.decoder.drafter == DrafterSpec("auto")
    argv = ["serve", "--threads", "2", "--gamma", "3", "--draft", "d", "--max-batch", "8", "--share-history"]
    from_argv = serve_config(config_options(build_parser().parse_args(argv)))
    from_builder = serve_config({"threads": "2", "gamma": "3", "draft": "d", "max_batch": 8, "share_history": "true"})
    assert from_argv == from_builder and from_argv.decoder.drafter == DrafterSpec("model", draft="d")


def test_the_metrics_key_is_the_operators_alone(monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    monkeypatch.setenv("SPECDEC_METRICS_KEY", "op")
    assert serve_config({"api_key": ["a"]}).metrics_key == "op"
    assert serve_config({"api_key": ["a"], "metrics_key": "given"}).metrics_key == "given", "the flag over the variable"
    with pytest.raises(SpecDecError, match="must not be a tenant's API key"):
        serve_config({"api_key": ["a", "op"]})
    with pytest.raises(SpecDecError, match="not both"):
        serve_config({"public_metrics": True})
    with pytest.raises(SpecDecError, match="printable ASCII"):
        ServeConfig(metrics_key="with space")


def test_the_batch_has_one_rule():
    assert ServeConfig().batch(on_gpu=False) == DEFAULT_BATCH["cpu"] and ServeConfig().batch(on_gpu=True) == DEFAULT_BATCH["gpu"]
    assert ServeConfig(max_batch=5).batch(on_gpu=True) == 5


@pytest.mark.parametrize("given, expected", [
    (dict(), DrafterSpec("auto")),
    (dict(target_given=True), DrafterSpec("auto", demo_draft=False)),
    (dict(prompt_lookup=True), DrafterSpec("auto", demo_draft=False)),  # the demo pair's target, prompt lookup alone
    (dict(gamma=4), DrafterSpec("model")),
    (dict(target_given=True, gamma=4), DrafterSpec("plain")),
    (dict(target_given=True, draft="d", gamma=4), DrafterSpec("model", draft="d")),
    (dict(target_given=True, ngram="n", gamma=4), DrafterSpec("ngram", ngram="n")),
    (dict(target_given=True, ngram="n"), DrafterSpec("ngram", ngram="n")),
    (dict(target_given=True, prompt_lookup=True, gamma=2), DrafterSpec("lookup")),
    (dict(staged=True), DrafterSpec("model", inner="ngram")),
    (dict(target_given=True, draft="d", prompt_lookup=True, staged=True), DrafterSpec("model", draft="d", inner="lookup")),
    (dict(target_given=True, draft="d", tree=TreeShape(4)), DrafterSpec("model", draft="d", tree=TreeShape(4))),
    (dict(plain=True), DrafterSpec("plain")),
])
def test_drafter_flags_choose_a_spec(given, expected):
    assert DrafterSpec.choose(**{"target_given": False, **given}) == expected


@pytest.mark.parametrize("given, message", [
    (dict(plain=True, draft="d"), "--plain decodes without a drafter"),
    (dict(ngram="n", prompt_lookup=True), "at most one of an n-gram file and prompt lookup"),
    (dict(target_given=True, draft="d", ngram="n"), "choose at most one drafter"),
    (dict(target_given=True, staged=True, draft="d"), "staged drafting needs"),
    (dict(target_given=True, tree=TreeShape(4)), "token trees are drafted by a draft model"),
])
def test_drafter_flags_that_mean_nothing_are_refused(given, message):
    with pytest.raises(SpecDecError, match=message):
        DrafterSpec.choose(**{"target_given": False, **given})


def test_bad_values_are_refused_wherever_they_come_from():
    with pytest.raises(SpecDecError, match="unknown backend"):
        RuntimeConfig(backend="onnx")
    with pytest.raises(SpecDecError, match="gamma must be a positive integer"):
        DecoderConfig(gamma=0)
    with pytest.raises(SpecDecError, match="unknown drafter"):
        DrafterSpec("medusa")
    with pytest.raises(SpecDecError, match="--tree-width.*add --tree"):
        config.decoder_config(Options({"tree_width": 2}))
    options = Options({"threads": 1, "colour": "blue"})
    config.runtime_config(options)
    with pytest.raises(SpecDecError, match="unknown option.*--colour"):
        options.finish()
