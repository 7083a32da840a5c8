"""Images in prompts (`dataset.vision`): the limits each image is checked against when a dataset is read.

Checked by actors/data/images.py. The model processor's pixel budget (`min_pixels` / `max_pixels`, shared
by the actor and the learner) joins these settings with the multimodal requests that use it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from offpolicy.config.base import ConfigModel

ImageFormat = Literal["PNG", "JPEG", "WEBP", "GIF", "BMP"]
"""The formats read (Pillow's names); others are refused per record."""


class VisionConfig(ConfigModel):
    """What a prompt's images may be (checked per record when the dataset is read: a refused image drops
    its record alone, named with its key and index)."""

    max_image_bytes: int = Field(20 * 2**20, ge=1, le=2**31)
    """The largest encoded image accepted, in bytes (20 MiB); a larger one is refused with its record."""
    max_images: int = Field(16, ge=1, le=1024)
    """The most images one prompt may carry; a record with more is refused."""
    formats: list[ImageFormat] = Field(default_factory=lambda: ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
    """The encodings accepted; an image in another (TIFF, an SVG, a video) is refused with its record."""
