"""Secrets out of sight: the Redis URL's password and the API token, redacted in text and URLs.

`redact_url` is what a config shows in place of its `redis_url`; `Redactor.scrub` replaces every known
secret in any text (a response message, a log line). Services build one `Redactor` from their settings
and config and apply it to everything they answer or log (docs/api.md "Secrets").
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

MASK = "***"
"""What a secret is replaced with."""


def url_secrets(url: str) -> list[str]:
    """The secrets a URL carries: its password (as written and percent-decoded) and a `password=` query."""
    parts = urlsplit(url)
    found = []
    if parts.password:
        found += [parts.password, unquote(parts.password)]
    found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "password" and v]
    return [s for s in dict.fromkeys(found) if s]


def redact_url(url: str) -> str:
    """`url` with its password (netloc or `password=` query) replaced by `***`; other parts unchanged.

    `redis://:s3cret@host:6379/0` → `redis://:***@host:6379/0`. A URL without a password is returned
    as it is, so the redacted form of a password-less URL is the URL itself."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:{MASK}@{hostport}"
    query = parts.query
    if "password=" in query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if k == "password" else v) for k, v in pairs], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class Redactor:
    """Replaces each known secret in a text with `***` (longest first, so no part of one survives)."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        self._secrets: list[str] = []
        self.add(*secrets)

    def add(self, *secrets: str | None) -> None:
        """Know these secrets too (None and empty strings are ignored)."""
        known = set(self._secrets) | {s for s in secrets if s}
        self._secrets = sorted(known, key=len, reverse=True)

    def add_url(self, url: str) -> None:
        """Know the secrets of a URL (`url_secrets`)."""
        self.add(*url_secrets(url))

    def scrub(self, text: str) -> str:
        """`text` with every known secret replaced by `***`."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    def scrub_json(self, value: object) -> object:
        """A JSON-like value with `scrub` applied to every string in it (keys included)."""
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub(str(k)): self.scrub_json(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub_json(v) for v in value]
        return value

    def __repr__(self) -> str:
        return f"Redactor({len(self._secrets)} secret(s))"
