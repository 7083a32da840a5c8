"""A prompt's images as datasets hold them: read, checked and described, never decoded into the record.

A record's images (`dataset.image_key`: one value or a list) may each be

- bytes (a `datasets` / TRL `Image` column stored raw),
- `{"bytes": ..., "path": ...}` (how `datasets` writes an `Image` feature to parquet, as verl's multimodal
  preprocessing does): the bytes when present, else the path,
- a path: absolute, or relative to the dataset's folder (jsonl with image files beside it),
- a `data:image/<type>;base64,...` URL.

Remote URLs are refused (nothing is fetched while a dataset is read). Each image is checked against
`dataset.vision` (config/vision.py): its encoded size, its format, and that Pillow decodes it whole (a
truncated or corrupt file fails here, not in the engine); a record whose image fails is refused with the
image's key and index (`ImageRefused`), the rest of the dataset is read on. An image is kept as its bytes
and its sha256 (the address the buffer will store it under, once), with its format and size.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offpolicy.config.vision import VisionConfig


class ImageRefused(ValueError):
    """A record's image that cannot be used: `key` and `index` name it."""

    def __init__(self, key: str, index: int, reason: str) -> None:
        super().__init__(f"`{key}` image {index}: {reason}")
        self.key, self.index, self.reason = key, index, reason


@dataclass(frozen=True, slots=True)
class PromptImage:
    """One image of a prompt: its encoded bytes, their sha256, the format and size Pillow read."""

    data: bytes
    sha256: str
    format: str
    width: int
    height: int

    def describe(self) -> dict[str, Any]:
        """What `offpolicy data preview` shows of it."""
        return {
            "format": self.format,
            "width": self.width,
            "height": self.height,
            "bytes": len(self.data),
            "sha256": self.sha256[:12],
        }


def read_images(value: Any, key: str, base: Path, vision: VisionConfig) -> tuple[PromptImage, ...]:
    """The images at a record's `key` (None: none); `ImageRefused` names the first that fails."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(items) > vision.max_images:
        raise ImageRefused(key, vision.max_images, f"{len(items)} images > dataset.vision.max_images")
    return tuple(check_image(_bytes(item, key, i, base), key, i, vision) for i, item in enumerate(items))


def _bytes(item: Any, key: str, i: int, base: Path) -> bytes:
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, Mapping):
        if item.get("bytes") is not None:
            return _bytes(item["bytes"], key, i, base)
        if item.get("path"):
            return _bytes(str(item["path"]), key, i, base)
        raise ImageRefused(key, i, "an image object with neither `bytes` nor `path`")
    if isinstance(item, str):
        if item.startswith("data:"):
            try:
                return decode_data_url(item)
            except ValueError as e:
                raise ImageRefused(key, i, str(e)) from e
        if item.startswith(("http://", "https://")):
            raise ImageRefused(key, i, f"a remote URL ({item[:80]}): download the images next to the dataset")
        path = Path(item) if Path(item).is_absolute() else base / item
        try:
            return path.read_bytes()
        except OSError as e:
            raise ImageRefused(key, i, f"cannot read {path}: {e.strerror or e}") from e
    raise ImageRefused(
        key, i, f"expected bytes, a path, a data URL or {{bytes, path}}, got {type(item).__name__}"
    )


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:<type>;base64,...` URL; `ValueError` saying what is wrong with it."""
    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise ValueError("a data URL that is not base64 (`data:image/png;base64,...`)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise ValueError(f"a data URL whose base64 does not decode: {e}") from e


def check_image(data: bytes, key: str, i: int, vision: VisionConfig) -> PromptImage:
    """`data` checked against `vision` (size, format, a whole decode): the image, or `ImageRefused`."""
    from PIL import Image

    if len(data) > vision.max_image_bytes:
        raise ImageRefused(
            key, i, f"{len(data)} bytes > dataset.vision.max_image_bytes {vision.max_image_bytes}"
        )
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, (width, height) = im.format, im.size
            if fmt not in vision.formats:
                raise ImageRefused(
                    key, i, f"format {fmt} is not one of dataset.vision.formats {vision.formats}"
                )
            im.load()  # decodes every pixel: a truncated or corrupt file fails here
    except ImageRefused:
        raise
    except Exception as e:  # Pillow raises many kinds (UnidentifiedImageError, OSError, DecompressionBomb)
        raise ImageRefused(key, i, f"not an image Pillow can decode: {type(e).__name__}: {e}") from e
    return PromptImage(data, hashlib.sha256(data).hexdigest(), fmt, width, height)


def decoded_images(prompt: Any) -> list[Any]:
    """A prompt's images decoded (RGB PIL images), in order: what the engine is sent."""
    from PIL import Image

    out = []
    for im in prompt.images:
        with Image.open(io.BytesIO(im.data)) as img:
            out.append(img.convert("RGB"))
    return out
