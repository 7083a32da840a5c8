"""Expert parallelism against the one-process learner: `ep_max_abs_weight_diff`, for benchmarks/moe.py.

Two runs train the same tiny random Qwen3-MoE (`make_tiny_moe_model`: 4 experts, top-2, head_dim 64) on the
same synthetic groups, in the same order (embedded Redis, FIFO, each group used once), `steps` learner
steps of one optimizer step each, publishing every step, fp32 on the CPU:

    single   the one-process learner (`python -m offpolicy.learner.launch`, no torchrun, no FSDP)
    ep_N     torchrun --nproc-per-node N (gloo), FSDP2 with `fsdp.expert_parallel: ep`

`ep_max_abs_weight_diff` is the largest difference of any published weight (every expert, gathered to
rank 0 and written in the Hugging Face layout) between the two after the last step. Target: <= 1e-5.

    from _expert_parallel import ep_max_abs_weight_diff   # benchmarks/ on sys.path, as for a script there
    ep_max_abs_weight_diff(nproc=2, ep=2, steps=2)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from learner import synthetic_groups
from learner_fsdp import max_diff, train, weights
from offpolicy.buffer.embedded import EmbeddedRedis
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.model.tiny import make_tiny_moe_model


def ep_max_abs_weight_diff(nproc: int = 2, ep: int = 2, steps: int = 2, threads: int = 1) -> dict[str, float]:
    """Train the one-process learner and `nproc` ranks with `fsdp.expert_parallel = ep` for `steps` steps
    on the same groups; `{"ep_max_abs_weight_diff": ..., "ep_moved": ...}` (`ep_moved`: the largest change
    of any weight from the initial model, so a diff is read against it)."""
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis.start(Path(d) / "redis") as redis:
        tmp = Path(d)
        model_dir = make_tiny_moe_model(tmp / "model", hidden_size=128, num_heads=2, num_experts=4)
        initial = weights(model_dir)
        groups = [g for i in range(steps) for g in synthetic_groups(4, 4, 6, 6, 60, seed=i)]
        runs = {}
        for name, ranks in (("single", None), (f"ep_{nproc}", nproc)):
            cfg = LearnerConfig(
                model_path=str(model_dir), device="cpu", precision="fp32", redis_url=redis.url, run_id=name,
                groups_per_step=4, micro_batch_size=3, optimizer={"lr": 1e-3},
                rollout_correction="decoupled_token_is", max_steps=steps,
                buffer={"sampler": "fifo", "max_times_sampled": 1}, sample_timeout_s=5.0,
                torch_threads=threads,
                publish={"weights_dir": str(tmp / name / "w"), "publish_every": 1, "keep_versions": 1},
                checkpoint={"checkpoint_dir": None}, metrics_jsonl=str(tmp / name / "metrics.jsonl"),
                fsdp={"expert_parallel": ep if ranks else 1},
            )  # fmt: skip
            with ReplayBuffer(redis.url, cfg.run_id, cfg.buffer) as buf:
                buf.insert_many(groups)
            runs[name] = train(name, ranks, cfg, tmp, threads)["_weights"]
        if "expert parallelism: " not in (tmp / f"ep_{nproc}.0.log").read_text():
            raise SystemExit(f"ep_{nproc}: the learner did not log its expert-parallel mesh")
    single, many = runs["single"], runs[f"ep_{nproc}"]
    return {"ep_max_abs_weight_diff": max_diff(single, many), "ep_moved": max_diff(single, initial)}


if __name__ == "__main__":
    print(ep_max_abs_weight_diff())
