"""`offpolicy quickstart`: the embedded default: Redis, tiny model, learner + actor children, live progress.

Everything runs on this machine with no Docker: an embedded `redis-server`, a tiny random Llama built
locally, the learner and one actor service as child processes (stopped by handle on exit or Ctrl-C), the
target-token toy task (reward = share of one token in the completion; with `--environment
offpolicy.actors.rollout.environments.calculator`, a dataset of small sums instead). It prints one progress
line per
learner step and stops when the reward has clearly risen or at `max_steps`, then writes
`runs/<id>/metrics.jsonl` and `runs/<id>/progress.png`.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from offpolicy.services.children import ServiceProcess, start_service
from offpolicy.services.common.errors import ChildProcessFailed
from offpolicy.services.quickstart_report import (
    RewardTracker,
    format_eval,
    format_progress,
    plot_run,
    summary_lines,
)

# --- the toy run's settings


@dataclass(frozen=True)
class QuickstartOptions:
    """What `offpolicy quickstart` was asked to do."""

    model: str | None = None
    """Model folder or hub id; None = build the tiny local model."""
    dataset: Path | None = None
    """Prompt file; None = write the toy dataset of the task (`toy_dataset`)."""
    redis_url: str | None = None
    """Redis to use; None = start the embedded one in the run folder."""
    max_steps: int = 60
    """Stop after this many learner steps even if the reward has not risen yet."""
    runs_dir: Path = Path("runs")
    """Parent of the run folder `runs/<id>/`."""
    timeout_s: float = 540.0
    """Give up (and stop everything) after this many seconds."""
    environment: str | None = None
    """Dotted path of an environment (e.g. `offpolicy.actors.rollout.environments.guessing_game`): multi-turn
    episodes
    instead of one generation per completion; None = the single-turn toy task."""
    transport: str = "files"
    """How weights reach the actor: `files` (a file generation per version) or `gloo` (vLLM's
    weight-transfer engine over the project's gloo pair, a file generation every 10 versions)."""
    reward: str | None = None
    """The reward that scores `dataset` (a built-in or `pkg.mod.fn`); required with `dataset`, refused
    without it (the toy task has its own)."""
    preset: str | None = None
    """The layout of `dataset` (`plain`, `verl`, `trl`: `DatasetConfig.preset`); None = the default keys."""
    gpus: tuple[int, ...] | None = None
    """GPUs by index (`--gpus 0,1`): the learner on the first half, the actor on the rest (each child's
    CUDA_VISIBLE_DEVICES), with GPU engine settings; None = vLLM on CPU."""

    def refusal(self) -> str | None:
        """Why these options cannot run as asked (a flag the quickstart would otherwise ignore), or None."""
        if self.dataset is not None and self.reward is None:
            return (
                "--dataset needs --reward: the toy task's reward (target_token_share) means nothing on your "
                "prompts; name yours (exact_match, math_answer, or pkg.module.fn)"
            )
        if self.dataset is None and self.reward is not None:
            return "--reward scores --dataset: the toy task has its own reward; pass --dataset too"
        if self.environment is not None and self.reward is not None:
            return "--reward is not used with --environment: the environment scores its episodes"
        if self.preset is not None and self.dataset is None:
            return "--preset names the layout of --dataset: pass --dataset too"
        if self.gpus is not None and (len(self.gpus) < 2 or len(set(self.gpus)) != len(self.gpus)):
            return "--gpus needs two or more distinct GPUs: the learner and the actor never share one"
        return None

    def gpu_split(self) -> tuple[list[int], list[int]] | None:
        """The learner's GPUs (the first half, rounded up) and the actor's (the rest); None on CPU."""
        if self.gpus is None:
            return None
        half = (len(self.gpus) + 1) // 2
        return list(self.gpus[:half]), list(self.gpus[half:])

    def child_env(self) -> tuple[dict[str, str], dict[str, str]]:
        """The learner's and the actor's extra environment: their CUDA_VISIBLE_DEVICES (none on CPU)."""
        split = self.gpu_split()
        if split is None:
            return {}, {}
        learner, actor = split
        return (
            {"CUDA_VISIBLE_DEVICES": ",".join(map(str, learner))},
            {"CUDA_VISIBLE_DEVICES": ",".join(map(str, actor))},
        )


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


def learner_config(
    run_dir: Path, model: str, redis_url: str, run_id: str, transport: str = "files", lr: float = 3e-3
) -> dict[str, Any]:
    """The learner's config for the toy task: small batches, a high learning rate, staleness bound 2;
    `transport` `gloo` / `gloo_m2n`: every version sent over vLLM's weight-transfer engine (that backend),
    files every 10."""
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
            | (
                {"transport": "vllm", "persist_every": 10, "transfer": _transfer(transport)}
                if transport in TRANSPORTS
                else {}
            ),
            "checkpoint": {"checkpoint_dir": str(run_dir / "checkpoints"), "checkpoint_every": None},
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
) -> dict[str, Any]:
    """The actor's config for the toy task: vLLM on CPU (float32, eager, 1 GiB KV cache), 4 completions
    of up to 32 tokens per prompt at temperature 0.7, reward = share of the target character (or
    `reward`, for a user's dataset). `max_model_len`: a user's model's (None = the tiny model's 512).
    With an `environment`, 4 episodes per prompt of up to 80 tokens (the policy's turns and the
    environment's). With `eval_dataset`, the held-out prompts are evaluated every 3 versions (inline).
    A user's dataset (`reward` given) is read with `preset`'s keys and the model's chat template when it
    has one. `gpus`: vLLM on that many GPUs (bfloat16, CUDA graphs, tensor parallel over them) instead of
    the CPU engine."""
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
    if transport in TRANSPORTS:  # receives every version in place (reload.mode inflight, the default)
        extra["reload"] = {"transport": "vllm", "transfer": _transfer(transport)}
    config = ActorConfig.cpu_tiny(
        model, str(dataset), redis_url=redis_url, run_id=run_id, buffer=TOY_BUFFER, **extra
    )
    if (
        reward is not None
    ):  # a user's dataset: its layout's keys, the tokenizer's chat template when it has one
        users = DatasetConfig(path=str(dataset), preset=preset)
        config = ActorConfig.model_validate(config.model_dump() | {"dataset": users.model_dump()})
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


def run_quickstart(options: QuickstartOptions) -> int:
    """Run the embedded default end to end; 0 when the reward rose, 1 when it did not, 130 on Ctrl-C."""
    refusal = options.refusal()
    if refusal is not None:
        print(f"[quickstart] {refusal}", file=sys.stderr)
        return 2
    try:
        max_model_len = None if options.model is None else _model_len(options.model, options.gpus is not None)
    except (OSError, ValueError) as exc:  # not a model folder, an unknown hub id
        print(f"[quickstart] --model {options.model}: {exc}", file=sys.stderr)
        return 2
    run_id = time.strftime("qs-%Y%m%d-%H%M%S")
    run_dir = (options.runs_dir / run_id).resolve()
    run_dir.mkdir(parents=True)
    print(f"[quickstart] run {run_id}: everything goes to {run_dir}")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    stoppable: list[Any] = []  # stopped in reverse order, each by its handle
    try:
        redis_url = options.redis_url or _start_redis(run_dir, stoppable)
        model = options.model or _build_tiny_model(run_dir)
        dataset = options.dataset or _write_dataset(run_dir, options.environment)
        learner, actor = _start_services(
            run_dir,
            model,
            dataset,
            redis_url,
            run_id,
            stoppable,
            options.environment,
            eval_dataset=options.dataset is None,  # the toy task's held-out prompts; a user's: none
            reward=options.reward,
            max_model_len=max_model_len,
            transport=options.transport,
            options=options,
        )
        tracker = _follow(run_dir, learner, actor, options)
        for line in summary_lines(tracker, run_dir):
            print(line)
        plot_run(tracker.records, run_dir / "progress.png")
        print(f"[quickstart] plot: {run_dir / 'progress.png'}")
        return 0 if tracker.risen() else 1
    except KeyboardInterrupt:
        print("\n[quickstart] interrupted: stopping every child process")
        return 130
    except ChildProcessFailed as exc:
        print(f"[quickstart] {exc}")
        return 1
    finally:
        for thing in reversed(stoppable):
            thing.stop()
        signal.signal(signal.SIGTERM, previous)
        print("[quickstart] stopped")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _start_redis(run_dir: Path, stoppable: list[Any]) -> str:
    from offpolicy.buffer.embedded import EmbeddedRedis

    redis = EmbeddedRedis.start(run_dir / "redis")
    stoppable.append(redis)
    print(f"[quickstart] embedded redis-server {redis.version()} at {redis.url}")
    return redis.url


def _build_tiny_model(run_dir: Path) -> str:
    from offpolicy.learner.model import make_tiny_model

    path = make_tiny_model(run_dir / "model")
    print(f"[quickstart] tiny model (random Llama, char tokenizer) at {path}")
    return str(path)


QUICKSTART_MAX_MODEL_LEN = 2048
"""The longest context the quickstart gives a user's model on CPU (its KV cache is 1 GiB)."""


GPU_MAX_MODEL_LEN = 4096
"""The longest context the quickstart gives a user's model with `--gpus`."""


def _model_len(model: str, gpu: bool = False) -> int:
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


def _write_held_out(run_dir: Path, environment: str | None) -> Path:
    """16 held-out prompts of the toy task (another seed than the training prompts)."""
    from offpolicy.actors.data.toy import write_sums_dataset, write_target_token_dataset

    path = run_dir / "held_out.jsonl"
    if environment == CALCULATOR:
        return write_sums_dataset(path, num_prompts=16, seed=1)
    return write_target_token_dataset(path, num_prompts=16, seed=1)


def _write_dataset(run_dir: Path, environment: str | None) -> Path:
    path = toy_dataset(run_dir / "dataset.jsonl", environment)
    kind = "sums" if environment == CALCULATOR else "target-token"
    print(f"[quickstart] {kind} toy dataset at {path}")
    return path


def _start_services(
    run_dir: Path,
    model: str,
    dataset: Path,
    redis_url: str,
    run_id: str,
    stoppable: list[Any],
    environment: str | None = None,
    eval_dataset: bool = False,
    reward: str | None = None,
    max_model_len: int | None = None,
    transport: str = "files",
    options: QuickstartOptions | None = None,
) -> tuple[ServiceProcess, ServiceProcess]:
    options = options or QuickstartOptions()
    split = options.gpu_split()
    learner_env, actor_env = options.child_env()
    lr = 3e-3 if options.model is None else 1e-6  # the toy model's, or a real model's fine-tuning rate
    learner_yaml = run_dir / "learner.yaml"
    learner_yaml.write_text(yaml.safe_dump(learner_config(run_dir, model, redis_url, run_id, transport, lr)))
    actor_yaml = run_dir / "actor.yaml"
    held_out = _write_held_out(run_dir, environment) if eval_dataset else None
    actor_yaml.write_text(
        yaml.safe_dump(
            actor_config(
                model,
                dataset,
                redis_url,
                run_id,
                environment,
                held_out,
                reward=reward,
                max_model_len=max_model_len,
                transport=transport,
                preset=options.preset,
                gpus=None if split is None else len(split[1]),
            )
        )
    )
    ranks = [] if split is None or len(split[0]) == 1 else ["--nproc-per-node", str(len(split[0]))]
    learner = start_service("learner", learner_yaml, run_dir / "learner.log", env=learner_env, args=ranks)
    stoppable.append(learner)
    actor = start_service("actor", actor_yaml, run_dir / "actor.log", env=actor_env)
    stoppable.append(actor)
    print(f"[quickstart] learner service {learner.url} (log {learner.log_path.name})")
    print(f"[quickstart] actor service   {actor.url} (log {actor.log_path.name}); vLLM starts in ~1 min")
    learner.wait_ready(timeout_s=180)
    actor.wait_ready(timeout_s=300)
    print("[quickstart] both services ready; training")
    return learner, actor


def _follow(
    run_dir: Path, learner: ServiceProcess, actor: ServiceProcess, options: QuickstartOptions
) -> RewardTracker:
    """Read the learner's per-step lines as they appear, add the actor's status, print, and decide."""
    steps_file = run_dir / "learner_steps.jsonl"
    tracker = RewardTracker()
    deadline = time.monotonic() + options.timeout_s
    offset = 0
    with (run_dir / "metrics.jsonl").open("a") as out:
        while time.monotonic() < deadline:
            for child in (learner, actor):
                if child.proc.poll() is not None:
                    raise ChildProcessFailed(f"{child.name} exited:\n{child.log_tail()}")
            new_lines, offset = _read_new_lines(steps_file, offset)
            actor_status = _get_json(f"{actor.url}/v1/status") if new_lines else {}
            for line in new_lines:
                record = {**json.loads(line), "actor": actor_status, "t": time.time()}
                tracker.add(record)
                out.write(json.dumps(record) + "\n")
                print(format_progress(record, tracker))
                if (line := format_eval(record)) is not None:
                    print(line)
            out.flush()
            if tracker.risen() or tracker.steps >= options.max_steps:
                return tracker
            time.sleep(0.5)
    print(f"[quickstart] timed out after {options.timeout_s:.0f} s")
    return tracker


def _read_new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    if not path.exists():
        return [], offset
    with path.open() as fh:
        fh.seek(offset)
        text = fh.read()
    complete, _, _ = text.rpartition("\n")
    if not complete:
        return [], offset
    return complete.splitlines(), offset + len(complete) + 1


def _get_json(url: str) -> dict[str, Any]:
    try:
        return httpx.get(url, timeout=2.0).json()
    except httpx.TransportError:
        return {}  # the next step's line will carry a fresh status
