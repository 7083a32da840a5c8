"""`offpolicy config check`: a learner config and an actor config checked offline, every reason at once.

Nothing is started and no service is called: each file is validated (field paths), the actor's reward,
environment and evaluation reward are imported by their dotted paths, the dataset's first records are read
with the configured keys (a known layout read with the wrong keys is named: `dataset.preset: verl`), and
the learner's memory plan per rank is estimated for `--gpus` (`offpolicy.learner.plan.memory.estimate`,
the plan the learner refuses to start above), against `--gpu-memory-gib` when given; a mixture-of-experts
model's plan counts its experts (total and active parameters, the routed experts' weights, gradients and
AdamW state per rank, their routed activations); a model folder holding weights but no tokenizer is
named with the files to copy. Only local files are
read: a model or dataset that is not on this machine (a hub id not in the cache) is a reason, not a
download. The configs' in-container paths are replaced by this machine's with `--model-dir` (the model
folder: `OFFPOLICY_MODEL_PATH`), `--data` (a dataset file, or a folder holding each dataset's file by
its name: `OFFPOLICY_DATASET__PATH`, `OFFPOLICY_EVAL__DATASET__PATH`) and `--code` (the reward's folder, on
the import path as compose mounts it); the check says which overrides it read.
Exit codes: 0 every check passed, 1 at least one failed (each reason on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

FIRST_ROWS = 5
"""Dataset records read and turned into prompts."""


class Report:
    """What the checks found: lines to print, and the reasons the check fails."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.reasons: list[str] = []

    def fail(self, where: str, message: str) -> None:
        self.reasons.append(f"{where}: {message}")


def _load(kind: str, path: Path, report: Report, environ: Mapping[str, str]) -> Any:
    """The config at `path` (with `OFFPOLICY_*` of `environ`), or None with each invalid field a reason."""
    if kind == "learner":
        from offpolicy.learner.config import load_config
    else:
        from offpolicy.actors.config import load_config
    try:
        config = load_config(path, environ)
    except ValidationError as e:
        for err in e.errors(include_url=False):
            field = ".".join(str(part) for part in err["loc"]) or "(top level)"
            report.fail(str(path), f"{field}: {err['msg']}")
        return None
    except (OSError, ValueError, yaml.YAMLError) as e:
        report.fail(str(path), str(e))
        return None
    report.lines.append(f"{path}: a valid {kind} config")
    return config


def _imports(actor: Any, where: str, report: Report) -> None:
    """The actor's reward, environment and evaluation reward, imported by their dotted paths."""
    from offpolicy.actors.rollout.episodes import resolve_environment
    from offpolicy.actors.rollout.rewards import resolve_reward, signature_of

    rewards = [("reward", actor.reward)]
    if actor.eval is not None and actor.eval.reward is not None:
        rewards.append(("eval.reward", actor.eval.reward))
    for field, reward in rewards:
        if reward.remote is not None:
            report.lines.append(f"{field}: remote {reward.remote.url} (not called)")
            continue
        try:
            signature = signature_of(resolve_reward(reward.name), reward.signature)
        except ValueError as e:
            report.fail(where, f"{field}.name: {e}")
            continue
        report.lines.append(f"{field}: {reward.name} (signature {signature})")
    if actor.environment is not None:
        try:
            resolve_environment(actor.environment.name)
        except ValueError as e:
            report.fail(where, f"environment.name: {e}")
        else:
            report.lines.append(f"environment: {actor.environment.name}")


def _dataset(dataset: Any, field: str, where: str, report: Report) -> None:
    """The dataset's first records read with its keys; a known layout read with the wrong keys fails."""
    from offpolicy.actors.data.preview import layout_hint
    from offpolicy.actors.data.prompts import load_prompts, text_only
    from offpolicy.actors.errors import DatasetError

    if not Path(dataset.path).exists():
        report.fail(where, f"{field}.path: {dataset.path} is not a file or folder here (no hub read offline)")
        return
    try:
        hint = layout_hint(dataset, FIRST_ROWS)
        if hint is not None:
            report.fail(where, f"{field}: {hint}")
            return
        refused: list[str] = []
        prompts = text_only(load_prompts(dataset, FIRST_ROWS, refused), dataset.path)
    except DatasetError as e:
        report.fail(where, f"{field}: {e}")
        return
    answered = sum(p.answer is not None for p in prompts)
    report.lines.append(
        f"{field}: {dataset.path}: the first {len(prompts)} records read, {answered} with an answer "
        f"(`{dataset.answer_key}`)"
        + (f"; {len(refused)} left out for their images (the first: {refused[0]})" if refused else "")
    )


def _model_shape(path: str, lora: Any = None) -> Any:
    """The `ModelShape` of a local model folder (or one in the Hugging Face cache), with the LoRA adapter
    of `lora` counted; no download."""
    from transformers import AutoConfig

    from offpolicy.learner.plan.memory import ModelShape

    return ModelShape.of(AutoConfig.from_pretrained(path, local_files_only=True), lora)


def _plan(learner: Any, where: str, gpus: int, gpu_memory_gib: float | None, report: Report) -> None:
    """The learner's memory plan per rank on `gpus` GPUs (bf16 on CUDA), against the GPU's memory."""
    from offpolicy.learner.errors import MemoryPlanError
    from offpolicy.learner.plan.auto import choose
    from offpolicy.learner.plan.memory import GIB, HEADROOM, check, estimate, expert_state

    try:
        shape = _model_shape(str(learner.model_path), learner.lora)
        ref_path = learner.reference.model_path
        reference = _model_shape(str(ref_path)) if learner.kl_loss_coef > 0 and ref_path else None
        teacher_path = learner.teacher.model_path
        teacher = _model_shape(str(teacher_path)) if teacher_path else None
    except (OSError, ValueError) as e:
        report.fail(where, f"model_path: its config.json cannot be read here, so no memory plan: {e}")
        return
    limit = None if gpu_memory_gib is None else int(HEADROOM * gpu_memory_gib * GIB)
    if limit is None:
        checkpointing: bool | int = learner.gradient_checkpointing is not False
        plan = estimate(
            learner, shape, gpus, gpus > 1, checkpointing, cuda=True, reference=reference, teacher=teacher
        )
    else:  # the `auto` settings as the learner will resolve them on this GPU
        settings = choose(learner, shape, gpus, gpus > 1, True, limit, reference, teacher)
        plan, checkpointing = settings.plan, settings.checkpointed_layers
        report.lines.append(f"settings the memory plan chooses: {settings.as_dict()}")
    parts = ", ".join(f"{k} {v:.1f}" for k, v in plan.as_dict().items() if k != "total")
    report.lines.append(
        f"memory plan: {plan.total / GIB:.1f} GiB per rank on {gpus} GPU(s) "
        f"({'FSDP2' if gpus > 1 else 'one process'}, {shape.params:,} parameters; {parts} GiB)"
    )
    if shape.moe is not None:
        moe, state = shape.moe, expert_state(learner, shape, gpus, gpus > 1, cuda=True)
        report.lines.append(
            f"experts: {moe.routed} routed, top {moe.top_k}, in {moe.moe_layers} of {shape.layers} layers; "
            f"{shape.params:,} parameters, {shape.active_params:,} active per token, "
            f"{shape.expert_params:,} in routed experts, whose weights {state['weights'] / GIB:.1f}, "
            f"gradients {state['gradients'] / GIB:.1f} and AdamW state {state['optimizer'] / GIB:.1f} GiB "
            f"per rank are in the plan (FSDP over {gpus} rank(s)), with the routed activations of "
            f"top_k x {moe.width} per token and MoE layer"
        )
    if gpu_memory_gib is not None and limit is not None:
        try:
            check(plan, limit, learner, gpus, checkpointing, shape.layers)
        except MemoryPlanError as e:
            report.fail(where, f"memory plan: {e}")
        else:
            report.lines.append(f"memory plan: fits {HEADROOM:.0%} of {gpu_memory_gib:g} GiB per GPU")


def _host_paths(
    actor_path: Path | None, environ: Mapping[str, str], model_dir: Path | None, data: Path | None
) -> dict[str, str]:
    """The `OFFPOLICY_*` overrides that put this machine's model folder and dataset in the configs'
    places: a `data` folder keeps each dataset's file name (compose mounts the folder)."""
    out: dict[str, str] = {}
    if model_dir is not None:
        out["OFFPOLICY_MODEL_PATH"] = str(model_dir.expanduser())
    if data is None:
        return out
    data = data.expanduser()
    if not data.is_dir():
        out["OFFPOLICY_DATASET__PATH"] = str(data)
        return out
    names = {"OFFPOLICY_DATASET__PATH": "train.parquet"}
    if actor_path is not None:
        from offpolicy.actors.config import load_config

        try:
            actor = load_config(actor_path, environ)
        except (ValidationError, OSError, ValueError, yaml.YAMLError):
            actor = None  # its reasons come with the check itself
        if actor is not None and actor.dataset is not None:
            names["OFFPOLICY_DATASET__PATH"] = Path(actor.dataset.path).name
        if actor is not None and actor.eval is not None:
            names["OFFPOLICY_EVAL__DATASET__PATH"] = Path(actor.eval.dataset.path).name
    return out | {key: str(data / name) for key, name in names.items()}


def _read_overrides(environ: Mapping[str, str], given: Mapping[str, str], report: Report) -> None:
    """Which `OFFPOLICY_*` variables the configs took: the flags' (with their values) and the
    environment's (names only: a value may be a secret)."""
    from offpolicy.actors.config import ActorConfig
    from offpolicy.config.loader import ENV_NESTING, ENV_PREFIX
    from offpolicy.learner.config import LearnerConfig

    fields = set(LearnerConfig.model_fields) | set(ActorConfig.model_fields)
    read = sorted(
        key
        for key in environ
        if key.startswith(ENV_PREFIX) and key not in given
        and key[len(ENV_PREFIX) :].lower().split(ENV_NESTING)[0] in fields
    )  # fmt: skip
    flags = ", ".join(f"{key}={value}" for key, value in given.items())
    report.lines.append(
        f"overrides read: {flags or 'none from flags'}; from the environment: {', '.join(read) or 'none'}"
    )


def run_check(
    learner_path: Path,
    actor_path: Path | None,
    gpus: int = 1,
    gpu_memory_gib: float | None = None,
    environ: Mapping[str, str] | None = None,
    model_dir: Path | None = None,
    data: Path | None = None,
    code: Path | None = None,
) -> Report:
    """Every check of the module docstring; the report of what passed and why the rest failed."""
    environ = os.environ if environ is None else environ
    report = Report()
    given = _host_paths(actor_path, environ, model_dir, data)
    environ = {**environ, **given}
    _read_overrides(environ, given, report)
    if code is not None:
        folder = str(code.expanduser().resolve())
        if not Path(folder).is_dir():
            report.fail("--code", f"{folder} is not a folder here")
        elif folder not in sys.path:
            sys.path.insert(0, folder)
            report.lines.append(f"--code: {folder} on the import path (the actor's PYTHONPATH)")
    learner = _load("learner", learner_path, report, environ)
    if learner is not None:
        _plan(learner, str(learner_path), gpus, gpu_memory_gib, report)
        from offpolicy.learner.model.load import missing_tokenizer

        weights = Path(learner.model_path).is_dir() and any(Path(learner.model_path).glob("*.safetensors"))
        if weights and (why := missing_tokenizer(learner.model_path)) is not None:  # (a config alone: sizing)
            report.fail(str(learner_path), f"model_path: {why}")
    actor = None if actor_path is None else _load("actor", actor_path, report, environ)
    if learner is not None:  # the cadences in versions and learner steps (a version = an optimizer step)
        every = actor.eval.every_versions if actor is not None and actor.eval is not None else None
        from offpolicy.learner.config.units import units

        report.lines.append(f"units: {units(learner, every)}")
    if actor_path is None or actor is None:
        return report
    # an actor pool: each of its runs (`runs`) checked as the file's own
    runs = [(str(actor_path), actor), *((f"{actor_path} runs.{i}", r) for i, r in enumerate(actor.runs))]
    for where, run in runs:
        _imports(run, where, report)
        if run.dataset is not None:
            _dataset(run.dataset, "dataset", where, report)
        if run.eval is not None:
            _dataset(run.eval.dataset, "eval.dataset", where, report)
    if learner is not None:
        served = [run.run_id for _, run in runs]
        if str(learner.model_path) != str(actor.model_path):
            theirs, ours = actor.model_path, learner.model_path
            report.fail(str(actor_path), f"model_path: {theirs!r} differs from the learner's {ours!r}")
        if learner.run_id not in served:
            theirs = repr(served[0]) if len(served) == 1 else f"none of the pool's runs {served}"
            report.fail(str(actor_path), f"run_id: {theirs} differs from the learner's {learner.run_id!r}")
    return report


def _check(args: argparse.Namespace) -> int:
    report = run_check(
        args.learner, args.actor, args.gpus, args.gpu_memory_gib,
        model_dir=args.model_dir, data=args.data, code=args.code,
    )  # fmt: skip
    print("\n".join(report.lines))
    if report.reasons:
        print(f"{len(report.reasons)} problem(s):", file=sys.stderr)
        print("\n".join(f"- {reason}" for reason in report.reasons), file=sys.stderr)
        return 1
    print("ok: every check passed")
    return 0


def add_check_parser(config_sub: argparse._SubParsersAction) -> None:
    """`offpolicy config check LEARNER [ACTOR] [--gpus N] [--gpu-memory-gib M] [--model-dir D] [--data P]
    [--code D]`."""
    check = config_sub.add_parser(
        "check",
        help="check a learner (and an actor) config offline: fields, imports, dataset, memory plan",
        description=__doc__.split("\n\n", 1)[1].split("Exit codes")[0].strip(),
    )
    check.add_argument("learner", type=Path, metavar="LEARNER_YAML", help="the learner's config")
    check.add_argument("actor", type=Path, nargs="?", metavar="ACTOR_YAML", help="the actor's config")
    check.add_argument("--gpus", type=int, default=1, help="learner GPUs (ranks) to plan for (default 1)")
    check.add_argument("--gpu-memory-gib", type=float, help="memory of one GPU; the plan must fit 90%% of it")
    check.add_argument(
        "--model-dir", type=Path, help="the model folder on this machine (OFFPOLICY_MODEL_PATH)"
    )
    check.add_argument(
        "--data", type=Path,
        help="a dataset file here, or the folder holding each dataset's file by its name (train and eval)",
    )  # fmt: skip
    check.add_argument("--code", type=Path, help="the reward's folder here, put on the import path")
    check.set_defaults(func=_check)
