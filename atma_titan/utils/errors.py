"""The one error type for bad input, and the import of optional integrations.

Every command catches `InputError` only: its message names the file, key or value and what is
allowed, and the command exits with status 2 without a traceback. Anything else is a bug and keeps
its traceback. The more specific errors (ConfigError, ShardError, TokenizerError, ...) subclass it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from atma_titan.utils.redact import redact_text

__all__ = ["ConfigError", "InputError", "MissingExtraError", "import_optional"]


class InputError(ValueError):
    """Bad input from the user (a config value, a file, a command-line option): exit status 2.

    The message is redacted (atma_titan.utils.redact): a URL it names loses its credentials, so an error
    about `s3://KEY:SECRET@bucket/...` or a pre-signed URL prints no secret."""

    def __init__(self, *args) -> None:
        super().__init__(*(redact_text(a) if isinstance(a, str) else a for a in args))


class ConfigError(InputError):
    """A configuration problem (a TOML file, a `--section.key` flag, a model hyper-parameter)."""


class MissingExtraError(InputError, ImportError):
    """An optional integration was asked for, but its package is not installed."""


def import_optional(module: str, extra: str, feature: str, package: str | None = None) -> ModuleType:
    """Import `module` for `feature` (e.g. "metrics.wandb = true"), or say which extra installs it.

    The message is one line: "<feature> needs the <package> package: pip install 'atma_titan[<extra>]'".
    `package` is the distribution's name where it is not the module's first component.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = package or module.split(".")[0]
        raise MissingExtraError(
            f"{feature} needs the {package} package: pip install 'atma_titan[{extra}]' (or pip install {package})"
        ) from error
