"""Remote data over fsspec: the back-end check, clear errors, and retries for reads during training.

`url_to_fs` opens the filesystem of a URL. http(s)://, s3:// and gs:// need fsspec back-ends
(aiohttp, s3fs, gcsfs: the `remote` extra); a missing one is a one-line `MissingExtraError` naming
`pip install 'atma_titan[remote]'` instead of fsspec's ImportError on first use.

`retrying` runs one remote operation. A transient failure (connection refused or reset, a timeout,
HTTP 5xx / 408 / 429) is retried with exponential backoff, so a long run survives a server restart
or a network blip; a permanent one (404, 401/403, a server without range requests) and a transient
one that outlasts the retries become a `RemoteDataError` (an InputError: exit status 2) naming the
URL and what to do. Messages are redacted (see atma_titan.utils.redact): no credential is printed.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from typing import Callable, TypeVar

import fsspec

from atma_titan.utils.errors import InputError, MissingExtraError, import_optional
from atma_titan.utils.redact import redact_text

__all__ = ["RemoteDataError", "check_range_support", "is_http", "retrying", "url_to_fs"]

T = TypeVar("T")

# Protocol -> the package of its fsspec back-end (all in the `remote` extra).
BACKENDS = {"http": "aiohttp", "https": "aiohttp", "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}

# Backoff between the attempts of one remote operation: 6 attempts over about a minute (plus the
# requests' own time). Long enough to ride out a server restart or a load balancer failing over;
# short enough that a dead server stops the job with a clear error instead of hanging it for hours.
RETRY_DELAYS_S = (2.0, 4.0, 8.0, 16.0, 30.0)
# HTTP: a connection that does not open, or a response that stalls, counts as a transient failure
# after this long instead of aiohttp's default of 5 minutes for the whole request.
HTTP_CONNECT_TIMEOUT_S = 30.0
HTTP_READ_TIMEOUT_S = 60.0


class RemoteDataError(InputError):
    """Remote data that cannot be read: not found, access denied, no range requests, or a server that stays down."""


def _protocol(url: str) -> str:
    """The protocol fsspec uses for `url` (the last of a chain like simplecache::s3://), 'file' for a path."""
    head, sep, _ = url.partition("://")
    return head.split("::")[-1].lower() if sep else "file"


def url_to_fs(url: str, what: str = "data URL"):
    """(filesystem, path) of `url`; a missing back-end is a MissingExtraError naming the extra to install."""
    protocol = _protocol(url)
    package = BACKENDS.get(protocol)
    if package:  # fsspec itself would import it only on first use, with a message naming no extra
        import_optional(package, "remote", f"the {what} {url}")
    try:
        return fsspec.core.url_to_fs(url, **_storage_options(protocol))
    except ImportError as e:  # a protocol outside the remote extra (az://, hf://, ...)
        raise MissingExtraError(
            f"the {what} {url} needs the fsspec back-end for {protocol}:// ({e}); install it "
            f"(http(s), s3 and gs come with pip install 'atma_titan[remote]')"
        ) from None
    except ValueError as e:  # an unknown protocol
        raise RemoteDataError(f"the {what} {url}: {e}") from None


def _storage_options(protocol: str) -> dict:
    if protocol not in ("http", "https"):
        return {}  # s3fs and gcsfs bring their own timeouts and retries
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=HTTP_CONNECT_TIMEOUT_S, sock_read=HTTP_READ_TIMEOUT_S)
    return {"client_kwargs": {"timeout": timeout}}


def is_http(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("http", "https") for p in protocols)


# ---------------------------------------------------------------------------------------- errors


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from (fsspec wraps a back-end's error in FileNotFoundError)."""
    out: list[BaseException] = []
    while error is not None and all(error is not e for e in out):
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


def http_status(error: BaseException) -> int | None:
    """The HTTP status behind `error`, if a back-end recorded one (aiohttp, gcsfs, botocore)."""
    for e in _chain(error):
        for attr in ("status", "code", "status_code"):
            value = getattr(e, attr, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
        response = getattr(e, "response", None)  # botocore.exceptions.ClientError
        if isinstance(response, dict):
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(value, int):
                return value
    return None


def is_transient(error: BaseException) -> bool:
    """A failure worth retrying: the server or the network, not the request."""
    status = http_status(error)
    if status is not None:
        return status >= 500 or status in (408, 429)
    network: tuple[type, ...] = (ConnectionError, TimeoutError, asyncio.TimeoutError)
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:  # its connection errors are not all builtin ConnectionErrors
        network += (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
    return any(isinstance(e, network) for e in _chain(error))


def _no_range_support(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, ValueError) and ("range requests" in text or "Cannot seek streaming HTTP" in text)


def permanent_error(url: str, doing: str, error: BaseException) -> RemoteDataError | None:
    """A clear error for a failure that retrying cannot fix, or None (transient, or not a remote failure)."""
    status = http_status(error)
    if status == 404 or (status is None and isinstance(error, FileNotFoundError) and not is_transient(error)):
        http = " (HTTP 404)" if status == 404 else ""
        return RemoteDataError(f"{url} not found{http} while {doing}: check the URL (and the glob pattern)")
    if status in (401, 403) or (status is None and isinstance(error, PermissionError)):
        http = f" (HTTP {status})" if status else ""
        return RemoteDataError(
            f"access to {url} denied{http} while {doing}: give credentials the server accepts (s3: AWS_ACCESS_KEY_ID "
            "/ AWS_SECRET_ACCESS_KEY or AWS_PROFILE; gs: GOOGLE_APPLICATION_CREDENTIALS; https: a URL the server "
            "authorises, e.g. a fresh pre-signed URL)"
        )
    if _no_range_support(error):
        return RemoteDataError(
            f"the server of {url} does not support HTTP range requests (it answered a ranged read with the whole "
            "file), and shards are read window by window with ranged reads: serve them from a server that supports "
            "Range (nginx, Apache, caddy, S3 / GCS), or download them and give data.path the local copy"
        )
    if status is not None and status >= 400 and not is_transient(error):
        return RemoteDataError(f"{url}: the server answered HTTP {status} while {doing}")
    return None


def _describe(error: BaseException) -> str:
    """The error for a message: the back-end's, not fsspec's FileNotFoundError wrapped around it."""
    error = next((e for e in _chain(error) if not isinstance(e, FileNotFoundError)), error)
    return redact_text(f"{type(error).__name__}: {str(error) or repr(error)}")


# ---------------------------------------------------------------------------------------- retries


def retrying(url: str, doing: str, attempt: Callable[[], T], *, on_retry: Callable[[], None] | None = None) -> T:
    """`attempt()`, retried on transient failures with exponential backoff (RETRY_DELAYS_S).

    `doing` says what the call does, for messages ("reading token 1200"); `on_retry` runs before each
    retry (e.g. drop an open file whose buffer the failed read left unknown). Permanent failures, and
    transient ones after the last attempt, raise RemoteDataError naming the URL. An error that is not
    a remote failure (a bug, an InputError) is raised as it is.
    """
    began = time.monotonic()
    delays = RETRY_DELAYS_S
    for tried in range(1, len(delays) + 2):
        try:
            return attempt()
        except InputError:
            raise
        except Exception as error:
            permanent = permanent_error(url, doing, error)
            if permanent is not None:
                raise permanent from None
            if not is_transient(error):
                raise
            if tried > len(delays):
                raise RemoteDataError(
                    f"{url}: {doing} failed {tried} times over {time.monotonic() - began:.0f} s, last with "
                    f"{_describe(error)}; the server or the network stays down: check it, then run the same "
                    "command again (a run resumes from its last checkpoint)"
                ) from None
            delay = delays[tried - 1] * random.uniform(1.0, 1.25)  # jitter: ranks do not retry in lockstep
            retry = f"retry {tried} of {len(delays)} in {delay:.1f} s"
            print(
                redact_text(f"warning: {url}: {doing} failed ({_describe(error)}); {retry}"),
                file=sys.stderr,
                flush=True,
            )
            if on_retry is not None:
                on_retry()
            time.sleep(delay)
    raise AssertionError("unreachable")


def check_range_support(fs, path: str, url: str) -> None:
    """HTTP: one small ranged read away from the start of `path`.

    A server that ignores Range answers with the whole file; this read fails on the response's
    headers without downloading the body (a header read at offset 0 would not notice, and reading
    a shard's header batch through such a server would download every shard whole)."""
    if not is_http(fs):
        return  # object stores always serve ranges

    def probe() -> None:
        # size: the probe needs none, and a HEAD request to learn it may fail on servers that serve GETs fine
        with fs.open(path, "rb", block_size=16, cache_type="none", size=64) as f:
            f.seek(8)
            f.read(4)

    retrying(url, "checking that the server supports range requests", probe)
