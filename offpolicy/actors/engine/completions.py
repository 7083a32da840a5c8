"""A sampled completion (`Completion`) as read out of vLLM's output: tokens, behaviour log-probs, versions.

vLLM's `CompletionOutput.logprobs` becomes `behavior_logprobs` here, the name the record, the buffer and the
learner's loss use (docs/glossary.md).

With `logprobs=0` and `flat_logprobs=True` (`VLLMEngine.sampling_params`, engine/vllm.py) vLLM returns
exactly the sampled token's log-prob at each position; the policy version of each token comes from vLLM's
weight-version spans (`CompletionOutput.weight_versions`), or, for a LoRA request, from its adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from offpolicy.actors.errors import EngineError


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled completion."""

    token_ids: np.ndarray  # int32[R]
    behavior_logprobs: np.ndarray  # float32[R]: behaviour log-prob of each sampled token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str  # detokenized completion (what reward functions read)
    versions: np.ndarray | None = None  # int32[R]: policy version that sampled each token; None = unknown
    policy_mask: np.ndarray | None = (
        None  # bool[R]: False on an episode's environment tokens; None = all policy
    )
    routed_experts: np.ndarray | None = None  # uint8|uint16[R, L, K] (engine.return_routed_experts)
    num_experts: int | None = None  # experts per MoE layer, with `routed_experts`
    prompt_ids: np.ndarray | None = None  # int32[P']: the prompt as the engine ran it, where that differs
    # from the ids sent (a prompt with images: each image's placeholder widened to its tokens); else None


def _versions(c, n_tokens: int) -> np.ndarray | None:
    """Per-token versions from vLLM's weight-version spans (labels are our integer versions)."""
    spans = getattr(c, "weight_versions", None)
    if not spans:
        return None
    out = np.empty(n_tokens, dtype=np.int32)  # (R,)
    covered = 0
    for span in spans:
        out[span.start : span.end] = int(span.version)
        covered += span.end - span.start
    if covered != n_tokens or spans[0].start != 0:
        raise EngineError(f"vLLM's weight-version spans cover {covered} of {n_tokens} tokens")
    return out


def _completion(c, version: int | None = None, routed: np.ndarray | None = None, experts: int | None = None):
    """Our `Completion` of vLLM's output `c`. `version` (LoRA: the request's adapter) stamps every token;
    None = vLLM's weight-version spans do. `routed`: its checked routed experts (engine/routing.py) of
    a model of `experts` experts."""
    ids = np.asarray(c.token_ids, dtype=np.int32)  # (R,)
    flat = c.logprobs  # FlatLogprobs: with logprobs=0, exactly the sampled token at each position
    if len(ids) and (
        flat is None or len(flat.logprobs) != len(ids) or not np.array_equal(flat.token_ids, ids)
    ):
        raise EngineError(f"vLLM returned no or mismatched log-probs for {len(ids)} sampled tokens")
    versions = None
    if len(ids):
        versions = _versions(c, len(ids)) if version is None else np.full(len(ids), version, np.int32)
    return Completion(
        token_ids=ids,
        behavior_logprobs=np.asarray([] if flat is None else flat.logprobs, dtype=np.float32),  # (R,)
        finish_reason=str(c.finish_reason),
        text=c.text,
        versions=versions,  # (R,) or None
        routed_experts=routed,  # (rows, L, K) or None
        num_experts=None if routed is None else experts,
    )
