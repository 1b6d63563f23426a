"""The README and the docs: the README stays a front page, docs/README.md indexes every doc, every link
resolves, no file speaks of sessions, and every command a doc shows names a command and flags that exist.

The command check reads the shell blocks (```bash, ```sh, ```console or a bare ```) of README.md,
docs/*.md and launch/*.md. A `python -m atma_titan.<x>` (or `torchrun ... -m atma_titan.<x>`) must
name a module directly runnable with -m. For the trainer (and the launch scripts, which pass their
arguments to it) `--config FILE` must exist and each `--section.key` must be a key of JobConfig; for
every other command each `--flag` must appear in its `--help`. Paths under train_configs/ and launch/,
and benchmark scripts, that a command names must exist. Fast: nothing trains; all the --help texts come
from one subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300

SHELL_INFO = {"", "bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FLAG = re.compile(r"--([A-Za-z][\w.-]*)(=.*)?", re.S)
MODULE = re.compile(r"atma_titan(\.\w+)+")
CHECKED_PATHS = ("train_configs/", "launch/")
TRAIN = "atma_titan.train"
LAUNCH_TRAIN = ("launch/train_local.sh", "launch/train_slurm.sbatch")  # their arguments go to the trainer
SEPARATORS = {"&&", "||", ";", "|", "&"}


def documents() -> list[Path]:
    """Every page whose commands are checked."""
    return [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "launch").glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ---------------------------------------------------------------------------------------------
# The front page, the index and the links


def test_readme_is_a_front_page():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md: {lines} lines, at most {README_MAX_LINES} (reference goes in docs/)"


def test_docs_index_links_every_doc():
    index = DOCS / "README.md"
    linked = {(index.parent / target.split("#")[0]).resolve() for target in links(index)}
    missing = [rel(doc) for doc in sorted(DOCS.glob("*.md")) if doc != index and doc.resolve() not in linked]
    assert not missing, f"docs/README.md does not link {', '.join(missing)}"


@pytest.mark.parametrize("page", documents(), ids=rel)
def test_every_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL (https:, mailto:)
        path, _, anchor = target.partition("#")
        file = (page.parent / path) if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{rel(page)} has broken links: {', '.join(dict.fromkeys(broken))}"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(page):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def links(page: Path) -> list[str]:
    """Link targets of a markdown page, outside its code blocks."""
    return [m.group(1) for _, line in prose_lines(page) for m in LINK.finditer(line)]


def prose_lines(page: Path):
    in_block = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_block = not in_block
        elif not in_block:
            yield number, line


# ---------------------------------------------------------------------------------------------
# No sessions


def test_what_the_readme_commands_write_is_ignored_by_git():
    """The debug run's outputs/ and the export's exports/ are a user's files, never the repository's."""
    written = ["outputs/debug/config.toml", "exports/atma_370m/model.safetensors", ".venv-ci/bin/python"]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == written, ignored.stdout + ignored.stderr


def test_no_file_mentions_a_session():
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    found = []
    for name in filter(None, listed.split("\0")):
        text = text_of(ROOT / name)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if re.search(r"session [0-9]", line, re.I):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "history belongs in git, not in files:\n" + "\n".join(found)


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file or one listed but deleted from the working tree."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


# ---------------------------------------------------------------------------------------------
# Commands


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    module: str  # atma_titan.<x>, or the trainer for a launch script
    args: tuple[str, ...]
    text: str

    def where(self) -> str:
        return f"{rel(self.page)}:{self.line}"


def shell_lines(page: Path):
    """(line number, logical line) of the shell blocks, continuation lines joined."""
    in_block, shell, pending, start = False, False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            in_block = not in_block
            shell = in_block and fence.group(2).lower() in SHELL_INFO
            continue
        if not shell:
            continue
        stripped = line.strip()
        if stripped.startswith("$ "):
            stripped = stripped[2:]
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + stripped
        pending = ""


def simple_commands(text: str) -> list[list[str]]:
    """The words of each simple command of a shell line (comments dropped, split at && || ; | &)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, words = [], []
    for word in lexer:
        if word in SEPARATORS:
            commands.append(words)
            words = []
        else:
            words.append(word)
    return [c for c in [*commands, words] if c]


def commands_of(page: Path) -> tuple[list[Command], list[str]]:
    """The atma_titan commands a page shows, and the problems found while reading them (paths, quoting)."""
    found, problems = [], []
    for number, text in shell_lines(page):
        try:
            parts = simple_commands(text)
        except ValueError as e:
            if re.search(r"-m\s+atma_titan|launch/", text):
                problems.append(f"{rel(page)}:{number}: cannot read the command ({e}): {text}")
            continue
        for words in parts:
            for word in words:
                path = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
                named = path.startswith(CHECKED_PATHS) or (path.startswith("benchmarks/") and path.endswith(".py"))
                if named and not (ROOT / path).exists():
                    problems.append(f"{rel(page)}:{number}: {path} does not exist")
            command = atma_command(page, number, words, text)
            if command is not None:
                found.append(command)
    return found, problems


def atma_command(page: Path, number: int, words: list[str], text: str) -> Command | None:
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words) and MODULE.fullmatch(words[i + 1]):
            return Command(page, number, words[i + 1], tuple(words[i + 2 :]), text)
        if word in LAUNCH_TRAIN:
            args = words[i + 1 :]
            if args and not args[0].startswith("-"):
                args = ["--config", *args]  # the scripts' first argument is the config
            return Command(page, number, TRAIN, tuple(args), text)
    return None


def module_exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def flags(args: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """(--name, value given with '=' or None) of every word that is a flag."""
    out = []
    for word in args:
        m = FLAG.fullmatch(word)
        if m:
            out.append((f"--{m.group(1)}", m.group(2)[1:] if m.group(2) else None))
    return out


def config_keys() -> dict[str, set[str]]:
    from atma_titan.config import JobConfig

    config = JobConfig()
    return {
        section.name: {key.name for key in dataclasses.fields(getattr(config, section.name))}
        for section in dataclasses.fields(config)
    }


def train_problems(command: Command, keys: dict[str, set[str]]) -> list[str]:
    problems, args = [], list(command.args)
    for flag, inline in flags(command.args):
        if flag in ("--help", "--config"):
            if flag == "--config":
                value = inline if inline is not None else next_value(args, "--config")
                if value is None or not (ROOT / value).is_file():
                    problems.append(f"--config {value}: no such file")
            continue
        section, _, key = flag[2:].replace("-", "_").partition(".")
        if section not in keys:
            problems.append(f"{flag}: no config section [{section}]")
        elif key not in keys[section]:
            problems.append(f"{flag}: [{section}] has no key {key!r}")
    return problems


def next_value(args: list[str], flag: str) -> str | None:
    i = args.index(flag)
    return args[i + 1] if i + 1 < len(args) else None


HELP_RUNNER = """
import contextlib, io, json, runpy, sys
requests, target, out = json.loads(sys.argv[1]), sys.argv[2], {}
for argv in requests:
    buffer = io.StringIO()
    sys.argv = [argv[0], *argv[1:], "--help"]
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    except BaseException as e:
        buffer.write(f"\\n--help failed: {type(e).__name__}: {e}")
    out[" ".join(argv)] = buffer.getvalue()
with open(target, "w") as f:
    json.dump(out, f)
"""


def help_texts(requests: set[tuple[str, ...]], tmp: Path) -> dict[tuple[str, ...], str]:
    """`python -m <module> [subcommand] --help` of each request, all in one process (torch imports once)."""
    if not requests:
        return {}
    ordered = sorted(requests)
    result = tmp / "help.json"
    proc = subprocess.run(
        [sys.executable, "-c", HELP_RUNNER, json.dumps(ordered), str(result)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.exists(), f"collecting --help failed:\n{proc.stdout}\n{proc.stderr}"
    texts = json.loads(result.read_text())
    return {argv: texts[" ".join(argv)] for argv in ordered}


def subcommands(help_text: str) -> set[str]:
    """The choices of a command whose usage line is `usage: ... {run,list,...} ...` (a positional, not the
    choices of a flag such as `[--haystack {filler,data}]`)."""
    usage = help_text.split("\n\n", 1)[0]
    for m in re.finditer(r"\{([\w,-]+)\}", usage):
        if not re.search(r"-[\w-]+\s+$", usage[: m.start()]):
            return set(m.group(1).split(","))
    return set()


def command_problems(pages: list[Path], tmp: Path) -> dict[Path, list[str]]:
    """Every page's problems: paths, quoting, modules, and flags checked against the config or --help."""
    read = {page: commands_of(page) for page in pages}
    shown = [c for found, _ in read.values() for c in found if c.module != TRAIN and module_exists(c.module)]
    top = help_texts({(c.module,) for c in shown}, tmp)

    def help_key(command: Command) -> tuple[str, ...]:
        choices = subcommands(top[(command.module,)])
        if not choices:
            return (command.module,)
        if command.args and command.args[0] in choices:
            return (command.module, command.args[0])
        default = re.search(r"defaults to (\w+)", top[(command.module,)])  # e.g. the sweep's `run`
        return (command.module, default.group(1)) if default else (command.module,)

    keyed = {c: help_key(c) for c in shown}
    helps = {**top, **help_texts({k for k in keyed.values() if len(k) > 1}, tmp)}
    keys = config_keys()
    out = {}
    for page, (found, problems) in read.items():
        for command in found:
            if not module_exists(command.module):
                problems.append(f"{command.where()}: python -m {command.module}: no such module (or no __main__.py)")
            elif command.module == TRAIN:
                problems.extend(f"{command.where()}: {TRAIN}: {b}" for b in train_problems(command, keys))
            else:
                problems.extend(f"{command.where()}: {b}" for b in help_problems(command, helps[keyed[command]]))
        out[page] = problems
    return out


def help_problems(command: Command, help_text: str) -> list[str]:
    shown = f"`python -m {command.module} --help`"
    if not help_text.strip():
        return [f"{shown} prints nothing"]
    return [
        f"{flag} is not in {shown}"
        for flag, _ in flags(command.args)
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text)
    ]


@pytest.fixture(scope="module")
def problems_of_pages(tmp_path_factory):
    return command_problems(documents(), tmp_path_factory.mktemp("help"))


@pytest.mark.parametrize("page", documents(), ids=rel)
def test_commands_run_as_shown(page, problems_of_pages):
    problems = problems_of_pages[page]
    assert not problems, f"{rel(page)} shows commands that do not run as written:\n" + "\n".join(problems)


def test_a_command_that_cannot_run_is_named(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "python -m atma_titan.eval --checkpoint x --gapz 2K\n"
        "python -m atma_titan.sweep plan --out s --factorz a=1,2\n"
        "python -m atma_titan.sweep --out s --jobs 3 --base b.toml\n"  # the sweep's default command, `run`
        "python -m atma_titan.nosuch --x\n"
        "launch/train_local.sh train_configs/nope.toml --training.steps 3\n"
        "```\n"
    )
    problems = command_problems([page], tmp_path)[page]
    assert problems == [
        f"{page}:6: train_configs/nope.toml does not exist",
        f"{page}:2: --gapz is not in `python -m atma_titan.eval --help`",
        f"{page}:3: --factorz is not in `python -m atma_titan.sweep --help`",
        f"{page}:5: python -m atma_titan.nosuch: no such module (or no __main__.py)",
        f"{page}:6: {TRAIN}: --config train_configs/nope.toml: no such file",
    ]


def test_the_readers_see_what_a_shell_and_github_see(tmp_path):
    """The readers themselves: continuation lines, comments, separators, env prefixes, torchrun; anchors."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 -m atma_titan.train --config x.toml \\\n"
        "    --training.steps 3   # a comment --not.a_flag\n"
        "python -m atma_titan.eval --checkpoint a && python -m atma_titan.sweep list --out s\n"
        "```\n"
        "```toml\n"
        "python -m atma_titan.nothing --here\n"
        "```\n"
    )
    lines = list(shell_lines(page))
    assert [n for n, _ in lines] == [2, 4]
    words = [w for text in (t for _, t in lines) for w in simple_commands(text)]
    assert words[0][-4:] == ["--config", "x.toml", "--training.steps", "3"]
    assert [w[:3] for w in words[1:]] == [["python", "-m", "atma_titan.eval"], ["python", "-m", "atma_titan.sweep"]]
    command = atma_command(page, 2, words[0], "")
    assert command.module == TRAIN and flags(command.args) == [("--config", None), ("--training.steps", None)]
    assert train_problems(command, {"training": {"steps"}}) == ["--config x.toml: no such file"]
    page.write_text("# A page\n## Parallelism: FSDP2 and HSDP\n```bash\n# not a heading\n```\n## Notes\n## Notes\n")
    assert anchors(page) == {"a-page", "parallelism-fsdp2-and-hsdp", "notes", "notes-1"}
    assert subcommands("usage: python -m x [-h] [--haystack {filler,data}]\n\noptions:") == set()
    assert subcommands("usage: python -m x [-h] {run,list} ...\n\nmore") == {"run", "list"}
    bad = Command(page, 2, TRAIN, ("--config", "train_configs/debug_model.toml", "--training.stpes", "3"), "")
    assert train_problems(bad, config_keys()) == ["--training.stpes: [training] has no key 'stpes'"]
