"""The actor's `engine` section: how vLLM is started, and `lora`, serving the learner's LoRA adapters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from offpolicy.config.base import MAX_BATCH, MAX_BYTES, MAX_SEQ_TOKENS, ConfigModel
from offpolicy.config.vision import ImagePixels


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
    at least `max_loras`. Before one more, the requests of the oldest superseded adapters are aborted
    (generated again) and those adapters removed. Past it vLLM evicts the least recently used one and
    reads it again if a request still needs it: from the engine's own copy (`files_dir`), which the
    learner's pruning of its version folders cannot take away."""
    files_dir: str | None = None
    """Where the engine keeps its own copy of each adapter it holds (deleted with the adapter, and all of
    it when the engine closes). On the weights volume's filesystem the copy is hard links (no bytes
    written); elsewhere a copy of the adapter's files (at most `max_cpu_loras` adapters). None: the
    system's temporary folder."""
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
    max_model_len: int = Field(4096, ge=16, le=MAX_SEQ_TOKENS)
    """Prompt + completion tokens per sequence, in tokens."""
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_BATCH)
    """GPUs the engine shards the model over (vLLM tensor parallelism); 1 on CPU."""
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of accelerator memory vLLM may take (weights + KV cache); small on CPU."""
    cpu_kv_cache_gib: float | None = Field(None, gt=0.0, le=MAX_BYTES / 2**30)
    """KV cache size on CPU in GiB (exported as `VLLM_CPU_KVCACHE_SPACE` before the engine starts);
    None = leave the variable as the process environment has it."""
    enforce_eager: bool = False
    """True = no CUDA graphs / compilation (required on CPU, faster start-up for tests)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the n completions of a group share their prompt)."""
    max_num_seqs: int | None = Field(None, ge=1, le=MAX_BATCH)
    """Sequences scheduled together; None = vLLM's default."""
    seed: int = Field(0, ge=0, lt=2**31)
    """Seed of vLLM's sampler (each actor adds its `actor_index`, so actors do not repeat each other)."""
    return_routed_experts: bool = False
    """Capture each token's routed experts (MoE models; vLLM's `enable_return_routed_experts`) and send
    them with its trajectory (`routed_experts`, uint8 up to 256 experts: layers x top_k bytes a token), for
    the learner to replay the actor's routing. Refused for a dense model; needs `enable_prefix_caching` and
    vLLM's Model Runner V2 (CUDA/ROCm with Triton: vllm-cpu refuses it)."""
    max_images_per_prompt: int | None = Field(None, ge=0, le=1024)
    """A vision-language model (Qwen2.5-VL): the most images one prompt may show (vLLM's
    `limit_mm_per_prompt`; video inputs are off). None = vLLM's default; set it for a vision model whose
    prompts show more than one image."""
    image_pixels: ImagePixels = ImagePixels()
    """A vision-language model's pixel budget per image (vLLM's `mm_processor_kwargs`); the learner's
    `image_pixels` must be the same (offpolicy/config/vision.py)."""
    lora: LoraEngineConfig | None = None
    """Serve the learner's published LoRA adapters (records of kind `lora`) on the base model `model_path`;
    None = full weights (records of kind `full`). A record of the other kind is refused (logged, counted
    as `reload_failures{reason="kind"}`), and the actor keeps what it holds."""

    @model_validator(mode="after")
    def _check_routing(self) -> Self:
        if self.return_routed_experts and not self.enable_prefix_caching:
            raise ValueError(
                "engine.return_routed_experts needs engine.enable_prefix_caching (vLLM keeps the routing of "
                "cached prompt blocks with them)"
            )
        return self

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
