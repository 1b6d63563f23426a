"""Credentials out of URLs before they are written or printed.

A data URL may carry a secret: userinfo (``s3://KEY:SECRET@bucket/x``, ``https://user:pw@host/x``) or
a query parameter (a pre-signed URL's ``X-Amz-Signature``, an Azure SAS ``sig``, ``?token=...``).
Every place a config, a path or an error message leaves the process (config.toml, the printed config,
the metric sinks, error messages) passes it through `redact_text`, which replaces the userinfo and
the values of sensitive query parameters with ``***`` and leaves everything else as it was::

    https://user:pw@host/x.bin?X-Amz-Signature=abc&part=1  ->  https://***@host/x.bin?X-Amz-Signature=***&part=1

Redaction is idempotent and leaves text without a ``scheme://`` untouched, so it is safe to apply
twice or to anything. The job itself keeps the real URL: only what is shown is redacted.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

__all__ = ["MASK", "is_sensitive_parameter", "redact_config", "redact_text", "redact_url"]

MASK = "***"

# Query parameters whose value is a secret, by exact (lower-cased) name ...
_SECRET_NAMES = {"sig", "key", "auth", "authorization", "pwd", "pass", "awsaccesskeyid"}
# ... or by a part of the name: token, access_token, X-Amz-Security-Token, X-Goog-Signature, client_secret,
# password, X-Amz-Credential, api_key, ...
_SECRET_PARTS = ("token", "secret", "passw", "signature", "credential", "apikey", "api_key", "api-key", "accesskey")

# A URL inside free text: a scheme, "://", then up to whitespace or a quote (messages quote paths with repr).
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
_TRAILING = ".,;:)]}"  # sentence punctuation after a URL in a message, not part of it


def is_sensitive_parameter(name: str) -> bool:
    """Whether a query parameter called `name` holds a secret (case-insensitive)."""
    name = unquote(name).strip().lower()
    return name in _SECRET_NAMES or any(part in name for part in _SECRET_PARTS)


def redact_url(url: str) -> str:
    """`url` with its userinfo and the values of sensitive query parameters replaced by ``***``.

    Not a URL (no ``scheme://``): returned as is. Glob characters, the path and harmless query
    parameters are kept, so the redacted URL still says which data it names.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", scheme.split("::")[-1] if scheme else ""):
        return url
    end = _first_of(rest, "/?#")  # the authority ends at the first of these
    _, colon, after = rest[:end].rpartition(":")
    if colon and "@" not in rest[:end] and not after.isdigit():
        # "s3://KEY:SE/CRET@bucket": an unencoded "/" in a secret key (common in AWS keys) ends the
        # authority too early; "user:<not a port>" then "@" before the query is still userinfo.
        at = rest.find("@", 0, _first_of(rest, "?#"))
        end = _first_of(rest, "/?#", start=at) if at > 0 else end
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:  # userinfo@host: the last "@" ends the userinfo (a password may hold one)
        authority = MASK + authority[authority.rindex("@") :]
    path, qmark, query = tail.partition("?")
    if qmark:
        query, hash_, fragment = query.partition("#")
        query = "&".join(_redact_parameter(p) for p in query.split("&")) + hash_ + fragment
    return f"{scheme}://{authority}{path}{qmark}{query}"


def _first_of(text: str, chars: str, start: int = 0) -> int:
    """Index of the first of `chars` in `text` at or after `start`, else len(text)."""
    found = [i for i in (text.find(c, start) for c in chars) if i >= 0]
    return min(found, default=len(text))


def _redact_parameter(parameter: str) -> str:
    name, eq, value = parameter.partition("=")
    return f"{name}={MASK}" if eq and value and is_sensitive_parameter(name) else parameter


def redact_text(text: str) -> str:
    """`text` (a path, a URL, a message) with every URL in it redacted (see `redact_url`)."""
    if "://" not in text:
        return text

    def one(match: re.Match) -> str:
        url = match.group(0)
        kept = url.rstrip(_TRAILING)
        return redact_url(kept) + url[len(kept) :]

    return _URL.sub(one, text)


def redact_config(value: Any) -> Any:
    """A copy of a nested dict / list config with every string redacted (other values as they are)."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_config(v) for v in value)
    return value
