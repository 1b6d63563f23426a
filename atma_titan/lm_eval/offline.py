"""Task data when the Hugging Face Hub is out of reach: read the cache at once, or fail in one line.

The harness's built-in tasks load their data with `datasets.load_dataset` from the Hub. With no
network that retries for about 40 s and then raises a ConnectionError under some 40 lines of
traceback. `hub_or_cache` probes the Hub's address once before the tasks load (one TCP connect, a few
seconds at most) and, when nothing answers or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE say so, runs the
evaluation in the Hub's offline mode: data in the local cache loads at once and missing data fails at
once. `missing_task_data` turns that failure into one line naming the task, its data set and the ways out.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import traceback
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

__all__ = ["PROBE_TIMEOUT_S", "Offline", "hub_or_cache", "missing_task_data", "offline_mode", "unreachable"]

PROBE_TIMEOUT_S = 3.0
DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub and datasets read as true


def _offline_setting() -> tuple[bool | None, str]:
    """The user's choice of offline mode (None: no choice) and the variable that makes it.

    datasets reads HF_DATASETS_OFFLINE when set, else huggingface_hub's HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value:
            return value.upper() in _TRUE, name
    return None, ""


def _cache_folder() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.environ.get("HF_HOME") or default


def _hub_address() -> tuple[str, int]:
    """Where a request to the Hub goes first: its host, or the proxy that the environment names for it."""
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        proxied = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return proxied.hostname or host, proxied.port or (443 if proxied.scheme == "https" else 80)
    return host, endpoint.port or (443 if endpoint.scheme == "https" else 80)


def unreachable(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the Hub cannot be reached ("huggingface.co:443: <the socket error>"), or None when it answers."""
    host, port = _hub_address()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:  # no DNS, refused, unreachable, timed out
        return f"{host}:{port}: {error}"
    return None


def _imported(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


@contextmanager
def offline_mode() -> Iterator[None]:
    """The Hub's offline mode for the block: in the environment, and in huggingface_hub and datasets.

    Both read their flag once, when imported: they are imported first, so that the flags are set and
    restored here rather than read from the environment inside the block and kept after it."""
    saved_env = {name: os.environ.get(name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    flags = [
        (_imported("huggingface_hub.constants"), "HF_HUB_OFFLINE"),
        (_imported("datasets.config"), "HF_HUB_OFFLINE"),
        (_imported("datasets.config"), "HF_DATASETS_OFFLINE"),
    ]
    saved_flags = [(module, name, getattr(module, name)) for module, name in flags if hasattr(module, name)]
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # for subprocesses
    for module, name, _ in saved_flags:
        setattr(module, name, True)
    try:
        yield
    finally:
        for module, name, value in saved_flags:
            setattr(module, name, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass(frozen=True)
class Offline:
    """Why the tasks read the local cache only: the Hub does not answer, or a variable asks for it."""

    reason: str  # "the Hub cannot be reached (...)" or "HF_HUB_OFFLINE=1 is set"
    variable: str = ""  # the environment variable that asked for offline mode, if one did


@contextmanager
def hub_or_cache(timeout: float = PROBE_TIMEOUT_S) -> Iterator[Offline | None]:
    """Run the block online, or in offline mode when the user asks for it or the Hub does not answer.

    Yields why the block is offline, or None when it may use the Hub. A user who sets an offline
    variable to false is never probed.
    """
    chosen, variable = _offline_setting()
    if chosen is False:
        yield None
        return
    if chosen:
        offline = Offline(f"{variable}={os.environ[variable]} is set", variable)
    else:
        failure = unreachable(timeout)
        if failure is None:
            yield None
            return
        offline = Offline(f"the Hub cannot be reached ({failure})")
        print(f"the Hugging Face Hub cannot be reached ({failure}): task data comes from the local cache", flush=True)
    with offline_mode():
        yield offline


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.gaierror]  # OfflineModeIsEnabled too
    for module, name in (
        ("requests.exceptions", "ConnectionError"),
        ("httpx", "TransportError"),
        ("huggingface_hub.errors", "LocalEntryNotFoundError"),
    ):
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None:
            errors.append(kind)
    return tuple(errors)


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _loading_task(error: BaseException):
    """The harness task whose data was being loaded where `error` was raised, or None."""
    task_class = getattr(sys.modules.get("lm_eval.api.task"), "Task", None)
    if task_class is None:
        return None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, task_class):
            return candidate
    return None


def missing_task_data(error: BaseException, offline: Offline | None) -> str | None:
    """One line for a network failure while a task loaded its data (None for any other error).

    `offline` is what `hub_or_cache` yielded: offline, such a failure means the data is not in the cache.
    """
    if not any(isinstance(e, _network_errors()) for e in _chain(error)):
        return None
    task = _loading_task(error)
    if task is None:
        return None
    name = getattr(getattr(task, "config", None), "task", None) or type(task).__name__
    path, subset = getattr(task, "DATASET_PATH", None), getattr(task, "DATASET_NAME", None)
    data = f"the Hugging Face data set {path!r}" if path else "files from the Hugging Face Hub"
    if path and subset not in (None, "default"):
        data += f" (subset {subset!r})"
    local_task = "or write the task as a YAML over local files and pass --include-path DIR"
    if offline is None:
        return (
            f"task {name!r} could not download {data} ({type(error).__name__}: {error}): check the network and run "
            f"again, {local_task}"
        )
    online = f"online without {offline.variable}" if offline.variable else "online"
    return (
        f"task {name!r} needs {data}, which is not in the local cache ({_cache_folder()}), and {offline.reason}. "
        f"Run this command once {online} to fetch it (later runs read the cache, offline too), {local_task}"
    )
