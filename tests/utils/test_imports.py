"""Every import the package makes is declared in pyproject.toml, and optional integrations import lazily.

A package installed by hand on a machine hides a missing dependency (safetensors once did): these tests
read the imports from the source and check them against the declared dependencies, then import every
module in a subprocess where the optional extras cannot be imported. The only modules allowed to need an
extra to import are the few that exist to integrate it (INTEGRATIONS): they import it through
`import_optional` at module level, so without it they fail with the one-line error naming the extra.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import atma_titan

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "atma_titan"
# Import names whose distribution is named otherwise, for distributions not installed here.
NOT_INSTALLED_DISTRIBUTIONS = {"fla": "fla-core"}
# Modules that exist to integrate one extra (they subclass its classes), with that extra: the only ones
# that may call import_optional at module level, and so need the extra to import.
INTEGRATIONS = {"atma_titan.hf.configuration": "hf", "atma_titan.hf.modeling": "hf"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalise(re.split(r"[ ;<>=!~\[]", requirement, maxsplit=1)[0])


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """(core distributions, {extra: distributions}) from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    return core, extras


@functools.cache
def _installed_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution_of(import_name: str) -> str:
    found = _installed_distributions().get(import_name)
    if found:
        return _normalise(found[0])
    return _normalise(NOT_INSTALLED_DISTRIBUTIONS.get(import_name, import_name))


def third_party_imports(path: Path) -> tuple[set[str], set[str], set[str]]:
    """(imports at module level, imports inside functions, import_optional calls at module level) of one file,
    third-party top-level names only.

    `import_optional("module", ...)` calls count as lazy imports of their module (or `package=`); those made
    at module level are also in the third set."""
    tree = ast.parse(path.read_text())
    module_level, lazy, optional_at_import = set(), set(), set()

    def add(names: set[str], module: str) -> None:
        top = module.split(".")[0]
        if top and top not in sys.stdlib_module_names and top != "atma_titan" and top != "__future__":
            names.add(top)

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            target = lazy if inside else module_level
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(target, alias.name)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                add(target, child.module)
            elif isinstance(child, ast.Call) and getattr(child.func, "id", None) == "import_optional":
                # positional constants only; a module named by a variable is checked where it is spelled
                args = [a.value if isinstance(a, ast.Constant) else None for a in child.args]
                package = args[3] if len(args) > 3 else None
                if package or args[0]:
                    add(lazy, package or args[0])
                    if not inside:
                        add(optional_at_import, package or args[0])
            visit(child, inside)

    visit(tree, False)
    return module_level, lazy, optional_at_import


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_import_is_declared_and_optional_ones_are_lazy():
    core, extras = declared()
    optional = set().union(*extras.values())
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module_level, lazy, optional_at_import = third_party_imports(path)
        where = path.relative_to(ROOT)
        if optional_at_import and module_name(path) not in INTEGRATIONS:
            problems.append(
                f"{where}: calls import_optional at module level ({', '.join(sorted(optional_at_import))}), so it "
                "cannot import without that extra; import it inside the function that needs it"
            )
        for name in sorted(module_level):
            if distribution_of(name) not in core:
                problems.append(
                    f"{where}: imports {name} at module level, but {distribution_of(name)} is no core dependency"
                )
        for name in sorted(lazy):
            if distribution_of(name) not in core | optional:
                problems.append(f"{where}: imports {name}, which no dependency list of pyproject.toml declares")
    assert not problems, "\n".join(problems)
    assert "safetensors" in core  # export and load_safetensors are core features


def test_dev_extra_installs_every_optional_integration_for_the_tests():
    _, extras = declared()
    dev = extras["dev"]
    spelled = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"])
    included = set()
    for requirement in spelled:  # "atma_titan[data,wandb,...]" pulls those extras in
        match = re.fullmatch(r"atma_titan\[(.*)\]", requirement.replace(" ", ""))
        if match:
            included |= set(match.group(1).split(","))
    assert {"data", "wandb", "tensorboard", "eval"} <= included, spelled
    assert "pytest" in dev


# Every optional extra's import names, blocked in the subprocess below.
BLOCKED = ["datasets", "tiktoken", "tokenizers", "huggingface_hub", "pyarrow", "zstandard", "wandb", "tensorboard",
           "matplotlib", "fla", "lm_eval", "transformers", "accelerate", "aiohttp", "s3fs", "gcsfs"]  # fmt: skip

_IMPORT_ALL = """
import importlib, pkgutil, sys

for name in BLOCKED:  # as if not installed: `import name` fails, importlib.util.find_spec(name) is None
    sys.modules[name] = None
import atma_titan
from atma_titan.utils.errors import MissingExtraError

failed = []
for info in pkgutil.walk_packages(atma_titan.__path__, "atma_titan."):
    extra = INTEGRATIONS.get(info.name)
    try:
        importlib.import_module(info.name)
    except MissingExtraError as e:  # allowed for an integration: one line, naming its extra
        if extra is None or "\\n" in str(e) or f"pip install 'atma_titan[{extra}]'" not in str(e):
            failed.append(f"{info.name}: {type(e).__name__}: {e}")
    except Exception as e:
        failed.append(f"{info.name}: {type(e).__name__}: {e}")
    else:
        if extra is not None:
            failed.append(f"{info.name}: imports without the {extra} extra: drop it from INTEGRATIONS")
print("\\n".join(failed) if failed else "ALL IMPORTED")
"""


def test_every_module_imports_without_the_optional_extras():
    modules = [m.name for m in pkgutil.walk_packages(atma_titan.__path__, "atma_titan.")]
    assert len(modules) > 30 and "atma_titan.train" in modules
    assert set(INTEGRATIONS) <= set(modules)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", f"BLOCKED = {BLOCKED!r}\nINTEGRATIONS = {INTEGRATIONS!r}\n" + _IMPORT_ALL],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ALL IMPORTED", proc.stdout


def _blocked(monkeypatch, *names: str) -> None:
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError


def _gpt2_tokenizer(folder: Path):
    from atma_titan.data.tokenizer import build_tokenizer

    return build_tokenizer("gpt2")


def _hf_dataset(folder: Path):
    from atma_titan.data.documents import HFDataset

    return list(HFDataset("some-org/some-dataset", None, "train", "text").documents(0, 1))


def _wandb_logger(folder: Path):
    from atma_titan.metrics import MetricsLogger

    return MetricsLogger(dump_folder=folder, stdout=False, jsonl=False, wandb=True, wandb_mode="offline")


def _tensorboard_logger(folder: Path):
    from atma_titan.metrics import MetricsLogger

    return MetricsLogger(dump_folder=folder, stdout=False, jsonl=False, tensorboard=True)


def _plot(folder: Path):
    from atma_titan.eval.report import plot_length_curves

    curve = {"lengths": [2, 4], "nll": [1.0, 0.9], "documents": 1}
    return plot_length_curves({"a": {"length_curve": curve}}, folder / "x.png")


@pytest.mark.parametrize(
    "blocked, use, extra",
    [
        (["tiktoken"], _gpt2_tokenizer, "data"),
        (["datasets"], _hf_dataset, "data"),
        (["wandb"], _wandb_logger, "wandb"),
        (["tensorboard", "torch.utils.tensorboard"], _tensorboard_logger, "tensorboard"),
        (["matplotlib"], _plot, "eval"),
    ],
    ids=["tiktoken", "datasets", "wandb", "tensorboard", "matplotlib"],
)
def test_a_missing_extra_is_a_one_line_error_naming_it(tmp_path, monkeypatch, blocked, use, extra):
    from atma_titan.utils.errors import InputError, MissingExtraError

    _blocked(monkeypatch, *blocked)
    with pytest.raises(MissingExtraError) as err:
        use(tmp_path)
    message = str(err.value)
    assert f"pip install 'atma_titan[{extra}]'" in message and "\n" not in message
    assert isinstance(err.value, InputError) and isinstance(err.value, ImportError)
