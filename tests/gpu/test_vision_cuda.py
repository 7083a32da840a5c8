"""A vision-language learner on CUDA (skipped without a GPU; `make test-gpu` runs these): a tiny Qwen2.5-VL
trains on groups that show images through a real buffer, their pixels on the device with the batch; the
language model moves, the vision tower does not; and the log-probs on CUDA equal the CPU's."""

from __future__ import annotations

import pytest
import torch

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.batch import collate
from offpolicy.learner.model import LogProbs, load_model, load_tokenizer
from offpolicy.learner.model.vision import load_image_processor, process_images
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_vision_step import vl_config, vl_dir, vl_groups  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.redis]


def test_a_vision_language_learner_trains_on_cuda(vl_dir, redis_url, tmp_path):  # noqa: F811
    groups, images = vl_groups(vl_dir, 4)
    pixels = process_images(load_image_processor(str(vl_dir)), images, images)
    batch = collate(groups, load_tokenizer(vl_dir).pad_token_id, pixels)
    with torch.no_grad():
        on_cpu, _ = LogProbs(load_model(vl_dir, "cpu", torch.float32))(batch, chunk_tokens=256)
        on_cuda, _ = LogProbs(load_model(vl_dir, "cuda", torch.float32))(batch.to("cuda"), chunk_tokens=256)
    assert batch.to("cuda").images.pixel_values.is_cuda
    assert float((on_cuda.cpu() - on_cpu).abs().max()) <= 1e-3
    cfg = vl_config(vl_dir, redis_url, tmp_path, device="cuda")
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        assert buf.insert_many(groups, images=images).ok
    learner = Learner(cfg)
    try:
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        learner.step()
        moved = {n for n, p in learner.model.named_parameters() if not torch.equal(before[n], p.detach())}
        assert "lm_head.weight" in moved and not any("visual" in n for n in moved)
    finally:
        learner.close()
