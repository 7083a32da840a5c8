"""A vision-language policy's forward on CPU (a tiny Qwen2.5-VL, random weights): the images of a batch
once each, rows selected with theirs, left-padded rows equal to each row alone and to transformers' own
forward, the vision tower frozen while the language model trains."""

from __future__ import annotations

import hashlib
import io
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import Images, collate
from offpolicy.learner.errors import BatchError
from offpolicy.learner.model import LogProbs, load_model, load_tokenizer, make_tiny_vl_model
from offpolicy.learner.model.vision import load_image_processor, process_images


def png(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def group(prompt_ids, images: list[str], n: int = 2, seed: int = 0) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    trs = [
        Trajectory(rng.integers(5, 90, 6, dtype=np.int32), np.full(6, -1.0, np.float32), 0.0, "stop")
        for _ in range(n)
    ]
    return TrajectoryGroup(
        uuid.uuid4().hex, "p", np.asarray(prompt_ids, np.int32), 0, "a", 0.0, SamplingParams(), trs, {}, None,
        images=images,
    )  # fmt: skip


def test_images_are_kept_once_and_selected_with_their_rows() -> None:
    pixels = {
        "a": (torch.full((4, 3), 1.0), torch.tensor([1, 2, 2])),
        "b": (torch.full((8, 3), 2.0), torch.tensor([1, 2, 4])),
    }
    groups = [group([1, 2], ["a"], n=2), group([1, 2], ["b", "a"], n=1), group([1, 2], [], n=1)]
    imgs = Images.of(groups, pixels)
    assert imgs is not None and imgs.rows == ((0,), (0,), (1, 0), ())  # four rows, "a" stored once
    assert imgs.pixel_values.shape == (12, 3) and imgs.grid_thw.tolist() == [[1, 2, 2], [1, 2, 4]]
    sub = imgs.select([2, 3])
    assert sub is not None and sub.rows == ((1, 0), ()) and sub.pixel_values[:4].eq(1).all()
    only_b = Images(imgs.pixel_values, imgs.grid_thw, ((1,),)).select([0])
    assert only_b is not None and only_b.pixel_values.shape == (8, 3) and only_b.pixel_values.eq(2).all()
    assert imgs.select([3]) is None and Images.of([group([1], [])], {}) is None
    with pytest.raises(BatchError, match="no pixels"):
        Images.of([group([1], ["c"])], pixels)


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "model")


def test_padded_rows_with_images_equal_transformers_and_the_tower_stays_frozen(vl: Path) -> None:
    tok = load_tokenizer(vl)
    red, blue = png((200, 20, 20), (56, 56)), png((20, 20, 200), (84, 56))
    blobs = {hashlib.sha256(b).hexdigest(): b for b in (red, blue)}
    shas = list(blobs)
    pixels = process_images(load_image_processor(str(vl)), blobs, shas)
    pad, start, end = (
        tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    tokens = {s: int(g.prod()) // 4 for s, (_, g) in pixels.items()}  # 2x2 patches merge into one token

    def prompt(images: list[str], text: str) -> list[int]:
        ids = tok(f"user: {text}", add_special_tokens=False)["input_ids"]
        for s in images:
            ids += [start, *[pad] * tokens[s], end]
        return ids + tok("\nassistant: ", add_special_tokens=False)["input_ids"]

    groups = [
        group(prompt([shas[0]], "colour?"), [shas[0]], seed=1),
        group(prompt(shas, "two"), shas, seed=2),
    ]
    model = load_model(vl, "cpu", torch.float32)
    policy = LogProbs(model)
    batch = collate(groups, tok.pad_token_id, pixels)
    with torch.no_grad():
        together, _ = policy(batch, chunk_tokens=64)
    for i, g in enumerate(groups):  # each row alone (no padding), through transformers' own forward
        for j, t in enumerate(g.trajectories):
            ids = torch.tensor([[*g.prompt_ids.tolist(), *t.response_ids.tolist()]])
            imgs = Images.of([g], pixels)
            with torch.no_grad():
                logits = model(
                    input_ids=ids,
                    pixel_values=imgs.pixel_values,
                    image_grid_thw=imgs.grid_thw[list(imgs.rows[0])],
                    mm_token_type_ids=(ids == pad).int(),
                ).logits[0]
            P = len(g.prompt_ids)
            ref = torch.log_softmax(logits[P - 1 : P - 1 + len(t.response_ids)], -1)
            ref = ref.gather(-1, torch.as_tensor(t.response_ids, dtype=torch.long)[:, None])[:, 0]
            row = 2 * i + j
            assert torch.allclose(together[row, : len(ref)], ref, atol=1e-5), (row, together[row], ref)
    # training: the language model gets gradients, the vision tower none
    out, _ = policy(batch, chunk_tokens=64)
    (-(out * batch.response_mask).sum()).backward()
    assert all(p.grad is None for p in model.model.visual.parameters())
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.model.language_model.parameters())
    # an image token sampled in a response is text (as in the engine): no image feature, no error
    sampled = group(prompt([shas[0]], "colour?"), [shas[0]], n=1, seed=1)
    sampled.trajectories[0].response_ids = np.array([40, 41, pad, 42, 43, 44], np.int32)
    with torch.no_grad():
        lp, _ = policy(collate([sampled], tok.pad_token_id, pixels), chunk_tokens=64)
    assert torch.isfinite(lp).all()
    with pytest.raises(BatchError, match="image tokens"):  # a prompt whose placeholders do not fit its images
        policy(collate([group(prompt([shas[0]], "x")[:-9], [shas[1]])], tok.pad_token_id, pixels), 64)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_intakes_image_check_counts_the_tokens_the_pixels_make(tmp_path: Path, family: str) -> None:
    """`image_problem` counts an image's tokens from its size (no pixels made): for odd sizes, under the
    checkpoint's budget and a smaller one, the count equals what `process_images` makes; a prompt with one
    token fewer, a missing image and a corrupt one are each named."""
    from offpolicy.actors.data.toy import square_png
    from offpolicy.learner.model.vision import image_problem

    path = make_tiny_vl_model(tmp_path / family, family=family)
    token = int(load_tokenizer(path).convert_tokens_to_ids("<|image_pad|>"))
    blobs = {}
    for w, h in ((56, 56), (200, 31), (33, 300), (640, 480), (17, 17)):
        data = square_png((10, 200, 10), w, h)
        blobs[hashlib.sha256(data).hexdigest()] = data
    for budget in ({}, {"max_pixels": 56 * 56}):
        processor = load_image_processor(str(path), **budget)
        merge = int(processor.merge_size)
        pixels = process_images(processor, blobs, blobs)
        for sha, (_, grid) in pixels.items():
            n = int(grid.prod()) // merge**2
            group = SimpleGroup([sha], np.array([1] + [token] * n + [2]))
            assert image_problem(processor, token, group, blobs) is None
            short = SimpleGroup([sha], np.array([1] + [token] * (n - 1) + [2]))
            assert image_problem(processor, token, short, blobs) == (
                f"the prompt holds {n - 1} image tokens, its images make {n}"
            )
    assert "not among the images read" in image_problem(processor, token, SimpleGroup(["0" * 64], []), blobs)
    broken = {"f" * 64: b"\x89PNG\r\n\x1a\nnot really"}
    assert "does not decode" in image_problem(processor, token, SimpleGroup(["f" * 64], []), broken)


class SimpleGroup:
    def __init__(self, images: list[str], prompt_ids) -> None:
        self.images, self.prompt_ids = images, prompt_ids
