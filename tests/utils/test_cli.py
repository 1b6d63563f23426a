"""Every command is `python -m atma_titan.<noun>`, its --help shows each default once, and the shared
wrapper (atma_titan.utils.cli.command) ends bad input with one line and exit status 2."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from atma_titan.sweep.cli import COMMANDS as SWEEP_COMMANDS
from atma_titan.utils.cli import HelpFormatter, add_checkpoint_arguments, command, command_parser
from atma_titan.utils.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "atma_titan"
COMMANDS = {"train", "generate", "export", "eval", "compare", "lm_eval", "sweep", "prepare", "profiling", "config"}


def _runs_as_main(path: Path) -> bool:
    return re.search(r"^if __name__ == .__main__.:", path.read_text(), re.MULTILINE) is not None


def test_every_command_is_a_module_of_the_package_or_a_packages_main():
    """One place per command: atma_titan/<noun>.py or atma_titan/<noun>/__main__.py, and no other module runs."""
    nouns = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__main__.py" and not _runs_as_main(path):
            continue
        where = path.relative_to(PACKAGE)
        top_module = len(where.parts) == 1
        package_main = len(where.parts) == 2 and path.name == "__main__.py"
        assert top_module or package_main, f"{where} runs as a command outside the rule"
        assert _runs_as_main(path), f"{where} does nothing when run"
        nouns.add(where.parts[0].removesuffix(".py"))
    assert nouns == COMMANDS


HELP_COMMANDS = sorted(COMMANDS) + [f"sweep {name}" for name in SWEEP_COMMANDS]


@pytest.mark.parametrize("command_line", HELP_COMMANDS)
def test_every_command_help_exits_zero_and_shows_each_default_once(command_line):
    noun, *sub = command_line.split()
    env = {**os.environ, "COLUMNS": "1000"}  # one line per option: its help and its default together
    proc = subprocess.run(
        [sys.executable, "-m", f"atma_titan.{noun}", *sub, "--help"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
    twice = [line for line in proc.stdout.splitlines() if line.count("(default") > 1]
    assert not twice, twice


def test_help_shows_a_default_once_and_none_for_a_required_option():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--stated", help="where (default: beside the run)")
    p.add_argument("--plain", default=7, help="how many")
    p.add_argument("--needed", required=True, help="what")
    text = " ".join(p.format_help().split())
    assert "where (default: beside the run) --plain" in text
    assert "how many (default: 7)" in text
    assert text.endswith("what")


def test_the_checkpoint_flags_are_the_ones_open_checkpoint_takes():
    p = command_parser("x", "a command")
    add_checkpoint_arguments(p)
    args = p.parse_args(["--checkpoint", "run/", "--step", "4"])
    assert (args.checkpoint, args.config, args.step) == ("run/", None, 4)
    assert p.prog == "python -m atma_titan.x"
    with pytest.raises(SystemExit):  # --checkpoint is required
        p.parse_args([])


class Diverged(RuntimeError):
    pass


@command
def passes(argv: list[str] | None = None) -> int:
    return len(argv or [])


@command(statuses={Diverged: 3})
def fails(argv: list[str] | None = None) -> int:
    kind, message = argv
    raise {"input": InputError, "diverged": Diverged, "bug": KeyError, "ctrl-c": KeyboardInterrupt}[kind](message)


def test_command_returns_main_s_status():
    assert passes(["a", "b"]) == 2 and passes() == 0
    assert passes.__name__ == "passes"


def test_bad_input_is_one_line_on_stderr_and_status_2(capsys):
    assert fails(["input", "--gaps 9x: expected sizes like 2K"]) == 2
    out, err = capsys.readouterr()
    assert err == "error: --gaps 9x: expected sizes like 2K\n" and out == ""


def test_a_command_s_own_failures_keep_their_status(capsys):
    assert fails(["diverged", "the loss is NaN at step 7"]) == 3
    assert capsys.readouterr().err == "error: the loss is NaN at step 7\n"


def test_ctrl_c_is_status_130_without_a_traceback(capsys):
    assert fails(["ctrl-c", ""]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_bug_keeps_its_traceback():
    with pytest.raises(KeyError):
        fails(["bug", "x"])


def test_the_known_warnings_are_silenced():
    @command
    def warns(argv: list[str] | None = None) -> int:
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized", UserWarning)
        return 0

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning that gets through fails the test
        assert warns() == 0
