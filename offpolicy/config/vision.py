"""Images in prompts (`dataset.vision`): the limits each image is checked against when a dataset is read.

Checked by actors/data/images.py. The model processor's pixel budget (`ImagePixels`: `min_pixels` /
`max_pixels`) is the actor's engine's and the learner's alike (`engine.image_pixels`, `image_pixels`)."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator

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


MAX_PIXELS = 2**28
"""The largest pixel budget accepted (16384 x 16384)."""


class ImagePixels(ConfigModel):
    """The pixels of each image a vision-language model sees: its processor resizes an image so that its area
    lies in [`min_pixels`, `max_pixels`] (the Qwen2-VL family: each side a multiple of 28, one token per
    28 x 28). None = the checkpoint's `preprocessor_config.json`. The actor's engine (`engine.image_pixels`,
    vLLM's `mm_processor_kwargs`) and the learner (`image_pixels`) must use the same budget: an image's
    tokens in the prompt the actor sampled from are the learner's input. A learner that finds a group whose
    image tokens its images do not fill sets it aside as a dead letter (`images`)."""

    min_pixels: int | None = Field(None, ge=28 * 28, le=MAX_PIXELS)
    """The smallest area an image is resized to, in pixels."""
    max_pixels: int | None = Field(None, ge=28 * 28, le=MAX_PIXELS)
    """The largest area an image is resized to, in pixels (a larger image is scaled down: fewer tokens)."""

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}")
        return self

    def processor_kwargs(self) -> dict[str, Any]:
        """The image processor's keyword arguments for this budget (none for the checkpoint's own)."""
        return {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v}


class VisionTraining(ConfigModel):
    """What a vision-language policy's learner trains (the learner's `vision` section)."""

    train: bool = False
    """Train the vision tower (and its merger) with the language model. False (the default, as verl,
    AReaL and prime-rl start): the tower is frozen, the language model alone trains; its weights are
    still published whole, so the actors serve the same tower."""
