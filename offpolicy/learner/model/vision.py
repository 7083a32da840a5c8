"""Vision-language policies (the Qwen2-VL family: Qwen2.5-VL, Qwen3-VL): the images of a batch as the vision
tower takes them, and the decoder's forward over rows that show them.

`process_images` turns each image's bytes into its pixel values and patch grid with the model's own image
processor (the checkpoint's `preprocessor_config.json`: the same pixel budget as the actor's vLLM, which
reads the same file). `decoder_states` runs a batch whose rows show images: the vision tower once per
distinct image (a group's n completions share it; frozen by default: no gradients, no activations kept),
its outputs placed at each row's prompt image tokens in placeholder order (an image token sampled in a
response stays text, as in the engine), the 3-row rotary positions computed
from the grids and the attention mask (left padding included), then the language model on the merged
embeddings (Qwen3-VL: with the tower's deepstack features, added to the image tokens' states in its first
layers). Rows are padded (`Batch`); the packed layout does not carry 3-row positions yet, so the
policy's forward takes the padded one for such a batch (learner/model/policy.py).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from offpolicy.learner.errors import BatchError
from offpolicy.weights.processor import is_vision_checkpoint, is_vision_language

__all__ = [
    "Pixels",
    "decoder_states",
    "freeze_vision",
    "image_problem",
    "is_vision_checkpoint",
    "is_vision_language",
    "load_image_processor",
    "process_images",
]

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from offpolicy.learner.batch import Batch

Pixels = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""Each image's (pixel values (patches, D), grid (3,) long) by sha256."""


def freeze_vision(model: PreTrainedModel) -> None:
    """Freeze the vision tower (and its merger): the language model alone trains."""
    for p in model.model.visual.parameters():
        p.requires_grad_(False)


def load_image_processor(model_path: str, **budget: Any) -> Any:
    """The checkpoint's image processor (without torchvision: the PIL one, weights/processor.py), with a
    pixel budget (`min_pixels`, `max_pixels`: `ImagePixels.processor_kwargs`) over the checkpoint's."""
    from transformers import AutoImageProcessor

    from offpolicy.weights.processor import images_without_torchvision

    images_without_torchvision()
    return AutoImageProcessor.from_pretrained(model_path, **budget)


def process_images(image_processor: Any, blobs: Mapping[str, bytes], shas: Iterable[str]) -> Pixels:
    """Pixel values and grid of each image `shas` names, from its encoded bytes in `blobs`; an image that is
    missing or does not decode raises `BatchError` naming it."""
    from PIL import Image, UnidentifiedImageError

    out: Pixels = {}
    for sha in dict.fromkeys(shas):
        data = blobs.get(sha)
        if data is None:
            raise BatchError(f"image {sha} is not among the images read")
        try:
            with Image.open(io.BytesIO(data)) as img:
                rgb = img.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise BatchError(f"image {sha} does not decode: {e}") from e
        enc = image_processor(images=[rgb], return_tensors="pt")
        out[sha] = (enc["pixel_values"], enc["image_grid_thw"][0].long())
    return out


def image_problem(
    image_processor: Any, image_token_id: int, group: Any, blobs: Mapping[str, bytes]
) -> str | None:
    """Why a group's images cannot be trained with its prompt (an image missing or that does not decode, or
    image tokens in the prompt other than its images make: another pixel budget than the actor's, a prompt
    built by hand), or None. Each image is decoded, and its tokens counted from its size by the processor's
    own resize rule (`get_number_of_image_patches`): the pixels themselves are made once, by the step."""
    from PIL import Image, UnidentifiedImageError

    merge = int(getattr(image_processor, "merge_size", 2))
    want = 0
    for sha in group.images:
        data = blobs.get(sha)
        if data is None:
            return f"image {sha} is not among the images read"
        try:
            with Image.open(io.BytesIO(data)) as img:
                img.load()
                width, height = img.size
        except (UnidentifiedImageError, OSError, ValueError) as e:
            return f"image {sha} does not decode: {e}"
        want += image_processor.get_number_of_image_patches(height, width, {}) // merge**2
    have = int((np.asarray(group.prompt_ids) == image_token_id).sum())
    if want != have:
        return f"the prompt holds {have} image tokens, its images make {want}"
    return None


def decoder_states(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """The language model's last hidden states over `batch`'s padded rows, images merged in: (B, L, H).

    Only a prompt's image tokens take image features: an image token the policy sampled in a response is
    text to the engine (its embedding, a text position), and so it is here."""
    images = batch.images
    assert images is not None
    inner = model.model  # Qwen2_5_VLModel: .visual, .language_model
    tower = inner.visual
    frozen = not any(p.requires_grad for p in tower.parameters())
    with torch.no_grad() if frozen else nullcontext():
        out = inner.get_image_features(images.pixel_values.to(tower.dtype), images.grid_thw, return_dict=True)
    encoded = out.pooler_output  # one (tokens, H) per distinct image
    deepstack = getattr(out, "deepstack_features", None)  # Qwen3-VL: per tower layer, one per image
    order = [i for row in images.rows for i in row]  # every row's images, in placeholder order
    image_tokens = batch.input_ids == model.config.image_token_id
    image_tokens[:, batch.prompt_width :] = False  # sampled in a response: text
    wanted = int(image_tokens.sum())
    have = sum(int(encoded[i].shape[0]) for i in order)
    if wanted != have:
        raise BatchError(f"the rows' prompts hold {wanted} image tokens, their images make {have}")
    embeds = inner.get_input_embeddings()(batch.input_ids)  # (B, L, H)
    if order:  # row after row, each row's placeholders in order: masked_scatter's own order
        features = torch.cat([encoded[i] for i in order]).to(embeds.dtype)
        embeds = embeds.masked_scatter(image_tokens.unsqueeze(-1), features)
    position_ids, _ = inner.get_rope_index(
        batch.input_ids,
        mm_token_type_ids=image_tokens.int(),
        image_grid_thw=images.grid_thw[order],
        attention_mask=batch.attention_mask,
    )  # (3, B, L)
    extra: dict[str, Any] = {}
    if deepstack:  # Qwen3-VL adds each tower layer's features to the image tokens' states of early layers
        extra["visual_pos_masks"] = image_tokens
        extra["deepstack_visual_embeds"] = [
            torch.cat([layer[i] for i in order]).to(embeds.dtype) for layer in deepstack
        ]
    return inner.language_model(
        inputs_embeds=embeds,
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **extra,
    ).last_hidden_state
