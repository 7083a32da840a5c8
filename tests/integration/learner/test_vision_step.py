"""The learner's step on groups that show images, through a real buffer: a tiny Qwen2.5-VL learner reads
each group's images back from the buffer, trains its language model (the vision tower frozen) and publishes
the whole model; a text-only learner sets a group that shows images aside as a dead letter (`images`)."""

from __future__ import annotations

import hashlib
import io
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from offpolicy.buffer.keys import BufferKeys
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.model import load_tokenizer, make_tiny_vl_model
from offpolicy.learner.model.vision import load_image_processor, process_images
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, tiny_dir  # noqa: F401

pytestmark = pytest.mark.redis


def png(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "model")


def vl_groups(model: Path, k: int, seed: int = 0) -> tuple[list[TrajectoryGroup], dict[str, bytes]]:
    """`k` groups of 3 completions, each showing one of two images (the prompt widened as vLLM does)."""
    tok = load_tokenizer(model)
    blobs = {
        hashlib.sha256(b).hexdigest(): b for b in (png((200, 20, 20), (56, 56)), png((20, 20, 200), (84, 56)))
    }
    shas = list(blobs)
    grids = process_images(load_image_processor(str(model)), blobs, shas)
    pad, start, end = (
        tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(k):
        sha = shas[i % 2]
        ids = [
            *tok("user: ", add_special_tokens=False)["input_ids"],
            start,
            *[pad] * (int(grids[sha][1].prod()) // 4),
            end,
        ]
        ids += tok("colour?\nassistant: ", add_special_tokens=False)["input_ids"]
        trs = [
            Trajectory(
                rng.integers(5, 100, 6, dtype=np.int32), np.full(6, -4.6, np.float32), float(j), "stop"
            )
            for j in range(3)
        ]
        groups.append(
            TrajectoryGroup(
                uuid.uuid4().hex, f"p{i}", np.asarray(ids, np.int32), 0, "a", 0.0, SamplingParams(), trs, {},
                None, images=[sha],
            )
        )  # fmt: skip
    return groups, blobs


def vl_config(vl_dir: Path, redis_url: str, tmp_path: Path, **kw):
    """One step of 4 groups in bypass mode at a large learning rate, no checkpoints."""
    return config(
        vl_dir, redis_url, tmp_path, groups_per_step=4, rollout_correction="bypass_ppo_clip",
        optimizer={"lr": 1e-2}, buffer={"sampler": "fifo", "max_times_sampled": 1},
        checkpoint={"checkpoint_dir": None}, **kw,
    )  # fmt: skip


def test_a_vision_language_learner_trains_its_language_model_on_groups_showing_images(
    vl_dir, redis_url, tmp_path
):
    groups, blobs = vl_groups(vl_dir, 4)
    cfg = vl_config(vl_dir, redis_url, tmp_path, packing=True)
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many(groups, images=blobs).ok
    learner = Learner(cfg)
    try:
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        metrics = learner.step()
        assert np.isfinite(metrics["loss"])
        after = dict(learner.model.named_parameters())
        moved = {n for n in before if not torch.equal(before[n], after[n].detach())}
        assert any(n.startswith("model.language_model.") for n in moved) and "lm_head.weight" in moved
        assert not any(".visual." in n or n.startswith("model.visual") for n in moved)  # frozen
        stats = learner.buffer.stats()
        assert stats.size == 0 and stats.images == 0  # acked: the groups and their images left the buffer
    finally:
        learner.close()
    folder = max((tmp_path / "weights").glob("v*"))
    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    assert any("visual" in n for n in names) and any(
        "language_model" in n or n.startswith("model.layers") for n in names
    )


def test_vision_train_trains_the_tower_too_and_is_refused_with_lora(vl_dir, redis_url, tmp_path):
    """`vision.train: true`: the same step moves the vision tower's weights as well (the default run
    above leaves them); with `lora` it is refused (the adapter covers the language model)."""
    groups, blobs = vl_groups(vl_dir, 4)
    cfg = vl_config(vl_dir, redis_url, tmp_path, vision={"train": True})
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many(groups, images=blobs).ok
    learner = Learner(cfg)
    try:
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        assert np.isfinite(learner.step()["loss"])
        after = dict(learner.model.named_parameters())
        moved = {n for n in before if not torch.equal(before[n], after[n].detach())}
        assert any(n.startswith("model.visual.blocks.") for n in moved), sorted(moved)[:5]
        assert any(n.startswith("model.language_model.") for n in moved)
    finally:
        learner.close()
    with pytest.raises(ValueError, match=r"vision\.train with lora"):
        vl_config(vl_dir, redis_url, tmp_path, vision={"train": True}, lora={"rank": 4})


def test_a_text_learner_sets_aside_a_group_that_shows_images(tiny_dir, vl_dir, redis_url, tmp_path):  # noqa: F811
    shown, blobs = vl_groups(vl_dir, 1)
    text = TrajectoryGroup(
        **{
            **{f: getattr(shown[0], f) for f in shown[0].__dataclass_fields__},
            "group_id": uuid.uuid4().hex,
            "images": [],
        }
    )
    text.prompt_ids = np.minimum(text.prompt_ids, 90).astype(np.int32)  # ids the text model has
    for t in text.trajectories:
        t.response_ids = np.minimum(t.response_ids, 90).astype(np.int32)
    shown[0].prompt_ids = text.prompt_ids
    shown[0].trajectories = text.trajectories
    cfg = config(
        tiny_dir, redis_url, tmp_path, groups_per_step=2, rollout_correction="bypass_ppo_clip",
        buffer={"sampler": "fifo", "max_times_sampled": 1}, checkpoint={"checkpoint_dir": None},
    )  # fmt: skip
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many([shown[0], text], images=blobs).ok
    learner = Learner(cfg)
    try:
        learner.step()
        dead = learner.buffer.dead_letters()
        assert [(d["group_id"], d["field"]) for d in dead] == [(shown[0].group_id, "images")]
        assert learner.buffer.stats().images == 0  # set aside: its image left with it
    finally:
        learner.close()


def test_a_group_whose_images_do_not_fit_its_prompt_is_set_aside_and_the_rest_trains(
    vl_dir, redis_url, tmp_path
):
    """Another pixel budget than the actor's (or a prompt built by hand) gives a prompt whose image tokens
    its images do not fill; an image deleted behind the buffer's back is gone: each such group is a dead
    letter (`images`), the step trains the others."""
    groups, blobs = vl_groups(vl_dir, 6, seed=5)
    short, gone = groups[0], groups[1]
    short.prompt_ids = np.delete(short.prompt_ids, int(np.flatnonzero(short.prompt_ids == _pad(vl_dir))[0]))
    lone = png((1, 2, 3), (56, 56))
    gone.images = [hashlib.sha256(lone).hexdigest()]
    cfg = vl_config(vl_dir, redis_url, tmp_path)
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many(groups, images={**blobs, gone.images[0]: lone}).ok
        buf._client.delete(BufferKeys.for_run(cfg.run_id).image(gone.images[0]))  # behind the buffer's back
    learner = Learner(cfg)
    try:
        metrics = learner.step()
        assert np.isfinite(metrics["loss"])
        dead = {d["group_id"]: d for d in learner.buffer.dead_letters()}
        assert set(dead) == {short.group_id, gone.group_id}
        assert {d["field"] for d in dead.values()} == {"images"}
        assert (
            "image tokens" in dead[short.group_id]["reason"]
            and "not in the buffer" in dead[gone.group_id]["reason"]
        )
    finally:
        learner.close()


def _pad(model: Path) -> int:
    return int(load_tokenizer(model).convert_tokens_to_ids("<|image_pad|>"))
