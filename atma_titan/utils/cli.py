"""What every command shares: its parser and --help, the checkpoint flags, and how it ends.

A command is `python -m atma_titan.<noun>`: a module directly under atma_titan/ or a package's
`__main__.py`, whose `main(argv=None) -> int` is wrapped in `command`. Bad input (InputError) ends it
with "error: <message>" on stderr and exit status 2, no traceback; anything else is a bug and keeps
its traceback. Torch-free, so the commands that need no torch (compare, sweep list) stay light.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, Mapping

from atma_titan.utils.errors import InputError
from atma_titan.utils.known_warnings import silence_known_warnings

__all__ = ["BAD_INPUT", "INTERRUPTED", "HelpFormatter", "add_checkpoint_arguments", "command", "command_parser"]

BAD_INPUT = 2  # argparse's own status for a bad flag, so every kind of bad input exits alike
INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for Ctrl-C

Main = Callable[[list[str] | None], int]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default shown once: not again where its help states it, not for a required option."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or "(default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class VerbatimHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The description as written (a docstring's usage lines keep their layout), and each default once."""


def command_parser(noun: str, description: str, *, verbatim: bool = False, **kwargs) -> argparse.ArgumentParser:
    """The parser of `python -m atma_titan.<noun>`; `verbatim` keeps the description's line breaks."""
    return argparse.ArgumentParser(
        prog=f"python -m atma_titan.{noun}",
        description=description,
        formatter_class=VerbatimHelpFormatter if verbatim else HelpFormatter,
        **kwargs,
    )


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """--checkpoint, --config and --step: what atma_titan.checkpoint.open.open_checkpoint takes."""
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="a DCP step folder, a run's checkpoint folder, a run folder, an exported .safetensors file or an "
        "exported Hugging Face folder",
    )
    parser.add_argument(
        "--config", metavar="FILE.toml", help="the run's TOML config (default: config.toml of the run folder)"
    )
    parser.add_argument(
        "--step", type=int, metavar="N", help="the step to load from a folder (default: its newest complete one)"
    )


def command(main: Main | None = None, *, statuses: Mapping[type[Exception], int] | None = None):
    """Decorate a command's `main(argv=None) -> int`: the known warnings silenced, then `main` run.

    An InputError prints "error: <message>" on stderr and returns 2; each exception type in `statuses`
    (checked first) does the same with its own status; Ctrl-C returns 130 without a traceback.
    Use as `@command` or `@command(statuses={NonFiniteLoss: 3})`.
    """
    if main is None:
        return functools.partial(command, statuses=statuses)
    failures = {**(statuses or {}), InputError: BAD_INPUT}

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        silence_known_warnings()
        try:
            return main(argv)
        except tuple(failures) as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return next(status for kind, status in failures.items() if isinstance(error, kind))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            return INTERRUPTED

    return run
