"""Images in prompts (`dataset.vision`): the limits each image is checked against, the processor's pixels.

Checked when a dataset is read (actors/data/images.py); the pixel budget is that of the model's processor
(Qwen2.5-VL's `min_pixels` / `max_pixels`), for the actor and the learner alike."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from offpolicy.config.base import ConfigModel

ImageFormat = Literal["PNG", "JPEG", "WEBP", "GIF", "BMP"]
"""The formats read (Pillow's names); others are refused per record."""


class VisionConfig(ConfigModel):
    """What a prompt's images may be (checked per record when the dataset is read: a refused image drops
    its record alone, named with its key and index) and the pixels the processor gives the model."""

    min_pixels: int = Field(4 * 28 * 28, ge=1, le=2**31)
    """The processor's lower bound on an image's pixels (Qwen2.5-VL's default, 3,136): smaller images are
    scaled up to it."""
    max_pixels: int = Field(16384 * 28 * 28, ge=1, le=2**31)
    """The processor's upper bound (Qwen2.5-VL's default, 12,845,056): larger images are scaled down to it,
    so they cost at most this many pixels' vision tokens."""
    max_image_bytes: int = Field(20 * 2**20, ge=1, le=2**31)
    """The largest encoded image accepted, in bytes (20 MiB); a larger one is refused with its record."""
    max_images: int = Field(16, ge=1, le=1024)
    """The most images one prompt may carry; a record with more is refused."""
    formats: list[ImageFormat] = Field(default_factory=lambda: ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
    """The encodings accepted; an image in another (TIFF, an SVG, a video) is refused with its record."""

    @model_validator(mode="after")
    def _bounds(self) -> VisionConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")
        return self
