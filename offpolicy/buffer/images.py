"""A batch's images on the insert and read paths: which bytes are not what their name says, which images a
chunk of groups sends, and the answer of `images()` (the Lua side is scripts/insert.lua and lib.lua)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from offpolicy.buffer.errors import ImagesMissing


def bad_images(images: Mapping[str, bytes]) -> dict[str, str]:
    """The images whose bytes do not hash to their name (sha256 hex), with why."""
    bad: dict[str, str] = {}
    for sha, data in images.items():
        if not isinstance(data, bytes | bytearray | memoryview):
            bad[sha] = f"the image sent as {sha} is {type(data).__name__}, not bytes"
        elif (real := hashlib.sha256(data).hexdigest()) != sha:
            bad[sha] = f"the bytes sent as image {sha} hash to {real}"
    return bad


def found_images(names: list[str], values: list[bytes | None], missing_ok: bool = False) -> dict[str, bytes]:
    """`images`' answer: each image's bytes, read with one MGET; raises `ImagesMissing` naming the absent
    (`missing_ok`: leaves them out)."""
    missing = tuple(sha for sha, v in zip(names, values, strict=True) if v is None)
    if missing and not missing_ok:
        raise ImagesMissing(missing)
    return {sha: v for sha, v in zip(names, values, strict=True) if v is not None}


def chunk_images(entries: list[tuple], images: Mapping[str, bytes] | None) -> dict[str, bytes]:
    """The images of `images` the chunk's groups name (sent with it; a stored one is not written again)."""
    if not images:
        return {}
    named = {sha for e in entries if e[4] for sha in e[4].split()}
    return {sha: bytes(data) for sha, data in images.items() if sha in named}
