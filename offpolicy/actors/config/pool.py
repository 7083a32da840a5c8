"""Which runs one actor pool may serve: one base model, LoRA adapters past one run, room for their adapters.

One vLLM engine holds one base model. Several runs share it only as LoRA adapters on that base
(`engine.lora`): each run's learner publishes its own adapters, and each request carries its run's newest.
A full-weight run owns the engine's weights, so a pool of full weights serves one run. The engine must
hold two adapters per run (the newest, and the one it supersedes while that one's requests finish:
`runs x 2 <= engine.lora.max_cpu_loras`), and batch one per run (`runs <= engine.lora.max_loras`: past it
a run's requests would wait for a batch slot while the others run). `run_refusal` is the one check, used by
`ActorConfig.runs` at start and by the pool (actors/rollout/pool.py) for runs added while it runs.
"""

from __future__ import annotations

from collections.abc import Collection

from offpolicy.actors.config.engine import EngineConfig

POOL_FIELDS = ("model_path", "engine")
"""A run's fields that are the pool's (one engine, one base model): a run's config may leave them out."""
INHERITED_FIELDS = (*POOL_FIELDS, "redis_url")
"""What a run's config takes from the pool's when it leaves it out: the pool's fields, and its Redis (a URL
holds the password, which comes from the environment: `OFFPOLICY_REDIS_URL` reaches the first run alone)."""


def run_refusal(
    pool_model_path: str,
    pool_engine: EngineConfig,
    served: Collection[str],
    run_id: str,
    model_path: str,
    engine: EngineConfig,
) -> str | None:
    """Why run `run_id` (its `model_path` and `engine`) cannot join a pool on `pool_model_path` with
    `pool_engine` that serves the runs `served`, with the fix; None when it can."""
    if run_id in served:
        return (
            f"run {run_id!r} is already served by this actor pool (remove it first, or pick another run_id)"
        )
    if model_path != pool_model_path:
        return (
            f"run {run_id!r}: model_path {model_path!r} is not this pool's base model {pool_model_path!r}: "
            "one engine serves one base model (run it on an actor pool of its own)"
        )
    if pool_engine.lora is not None and engine.lora is None:
        return (
            f"run {run_id!r} trains full weights (no engine.lora) and this pool serves LoRA adapters on its "
            "base model: full-weight and adapter runs cannot share a pool (one base model)"
        )
    if engine != pool_engine:
        differ = sorted(k for k in EngineConfig.model_fields if getattr(engine, k) != getattr(pool_engine, k))
        fields = ", ".join(f"engine.{k}" for k in differ)
        return (
            f"run {run_id!r}: {fields} differ from this pool's engine: one engine serves every run (leave "
            "`engine` out of the run's config, or give the pool's)"
        )
    if pool_engine.lora is None:
        return None if not served else _FULL_WEIGHTS
    return capacity_refusal(pool_engine, len(served) + 1)


_FULL_WEIGHTS = (
    "this actor pool serves full weights (no engine.lora): one run, the one it holds the weights of; several "
    "runs on one pool need engine.lora (each run a LoRA adapter on the one base model)"
)


def capacity_refusal(engine: EngineConfig, runs: int) -> str | None:
    """Why an engine serving LoRA adapters has no room for `runs` runs, with the fix; None when it has."""
    lora = engine.lora
    assert lora is not None
    if runs * 2 > lora.max_cpu_loras:
        return (
            f"{runs} runs need 2 adapters each in the engine (the newest, and the one it supersedes while "
            f"its requests finish), but engine.lora.max_cpu_loras={lora.max_cpu_loras}: set max_cpu_loras >= "
            f"{runs * 2} and restart the actor, or serve fewer runs"
        )
    if runs > lora.max_loras:
        return (
            f"{runs} runs, but engine.lora.max_loras={lora.max_loras} adapters per batch: a run's requests "
            f"would wait for a batch slot while the others run; set max_loras >= {runs} and restart the "
            "actor, or serve fewer runs"
        )
    return None
