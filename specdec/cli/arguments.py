"""The options the subcommands share, declared once, and argv into configurations.

Options that become a configuration (`specdec.config`) default to *not given* (argparse.SUPPRESS):
the configuration's own field holds the default, and `decoder_config` / `serve_config` read only
what the user gave, exactly as Ray Serve's builder reads its key=value options.
"""

from __future__ import annotations

import argparse
from typing import Callable

from specdec import config
from specdec.config import DecoderConfig, Options
from specdec.params import SamplingParams

GIVEN = argparse.SUPPRESS  # an option left out is absent from the namespace: the configuration's default applies
CONFIG_OPTIONS = {*config.MODEL_OPTIONS, *config.RUNTIME_OPTIONS, *config.DRAFTER_OPTIONS, *config.SERVE_OPTIONS,
                  *config.CHAT_OPTIONS}


def argument_type(parse: Callable) -> Callable:
    """A `specdec.config` parser as an argparse type (its ValueError becomes a usage error)."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


positive = argument_type(config.parse_positive)


def config_options(args: argparse.Namespace) -> dict:
    """The options of `args` that make a configuration, as given."""
    return {name: value for name, value in vars(args).items() if name in CONFIG_OPTIONS}


def decoder_config(args: argparse.Namespace, **defaults) -> DecoderConfig:
    """The command's decoder configuration, its model paths checked to exist (before anything loads)."""
    options = Options(config_options(args))
    decoder = config.decoder_config(options, **defaults)
    options.finish()
    config.check_model_paths(decoder)
    return decoder


def add_options(parser, options: dict[str, config.Option], names=None) -> None:
    """Flags for `options` (those in `names`, in its order; default all), as `specdec.config` declares them."""
    for name in names or options:
        option, flag = options[name], "--" + name.replace("_", "-")
        shown = dict(default=GIVEN, help=option.help, metavar=option.metavar)
        if option.parse is config.parse_flag:
            parser.add_argument(flag, action="store_true", default=GIVEN, help=option.help)
        elif option.parse is config.parse_words:
            parser.add_argument(flag, action="extend" if option.repeat else None, nargs="+", **shown)
        elif option.choices is not None:
            parser.add_argument(flag, choices=option.choices, **shown)
        else:
            parser.add_argument(flag, type=argument_type(option.parse), **shown)


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """How the models run: `RuntimeConfig`."""
    add_options(parser.add_argument_group("how the models run"), config.RUNTIME_OPTIONS)


def add_model_paths(parser: argparse.ArgumentParser) -> None:
    add_options(parser, config.MODEL_OPTIONS)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Models, drafter and how they run (`DecoderConfig`): shared by generate, verify, profile and serve."""
    add_model_paths(parser)
    add_options(parser.add_argument_group("drafting"), config.DRAFTER_OPTIONS)
    add_runtime_arguments(parser)


def add_sampling_arguments(parser: argparse.ArgumentParser, temperature: float = 1.0) -> None:
    """How tokens are chosen (`SamplingParams`; `sampling_params` reads them), by default at `temperature`."""
    parser.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature:g})")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")


def sampling_params(args: argparse.Namespace, **more) -> SamplingParams:
    """The sampling flags as one value, checked before any model loads; `more`: fields the command
    sets itself (a seed)."""
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, **more)
