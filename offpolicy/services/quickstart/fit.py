"""Whether the quickstart's learner fits its GPU: the memory plan `offpolicy config check` makes, asked
before anything starts, a refusal naming the flags that make it fit.

The learner refuses at start a plan above 90 % of its GPU (learner/plan/memory.py `check`, the `auto`
settings resolved by learner/plan/auto.py `choose`); with `--gpus` the quickstart asks the same of the
config it will write, on the learner's GPUs (the first half of `--gpus`: FSDP2 over two or more), so a model
that cannot fit is named before Redis, a download or an engine starts. The fixes are tried on the same plan
and named with what they plan: `--lora` (the frozen model and an adapter), more GPUs for the learner, a
smaller `--model`; lower token budgets (`micro_batch_tokens`) are a learner config of your own, named when
they could make the plan fit. Without `--gpus` (vLLM and the learner on CPU) there is no GPU to fit, and
with the tiny model nothing to refuse: nothing is checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_LEARNER_GPUS = 8
"""The most learner GPUs the refusal looks for a fit on (one node's)."""
LEAST_TOKENS = 1024
"""The token budgets (`micro_batch_tokens`, `logprob_chunk_tokens`) the refusal tries as the lowest."""


def learner_gpu_gib(gpus: list[int]) -> float | None:
    """The memory of the smallest of the learner's GPUs (`gpus`, CUDA indices), in GiB; None without CUDA
    here (then nothing is checked: the learner's own check at start stays)."""
    import torch

    from offpolicy.learner.plan.memory import GIB

    if not torch.cuda.is_available() or max(gpus) >= torch.cuda.device_count():
        return None
    return min(torch.cuda.get_device_properties(g).total_memory for g in gpus) / GIB


class LearnerPlans:
    """The quickstart's learner config for `model` (with and without `--lora`) and its plans on CUDA ranks
    of `limit` bytes: what the learner resolves at start (`choose`), the model's shape read once."""

    def __init__(self, model: str, limit: int) -> None:
        from transformers import AutoConfig

        self.hf, self.model, self.limit = AutoConfig.from_pretrained(model), model, limit
        self._shapes: dict[bool, Any] = {}

    def config(self, lora: bool) -> Any:
        from offpolicy.learner.config import LearnerConfig
        from offpolicy.services.quickstart.configs import learner_config

        # the run's folder, Redis and id do not change the plan
        written = learner_config(Path("runs/plan"), self.model, "redis://localhost:6379/0", "plan", lora=lora)
        return LearnerConfig.model_validate(written)

    def shape(self, lora: bool) -> Any:
        from offpolicy.learner.plan.memory import ModelShape

        if lora not in self._shapes:
            self._shapes[lora] = ModelShape.of(self.hf, self.config(lora).lora)
        return self._shapes[lora]

    def settings(self, ranks: int, lora: bool) -> Any:
        from offpolicy.learner.plan.auto import choose

        return choose(self.config(lora), self.shape(lora), ranks, ranks > 1, True, self.limit)

    def fits(self, ranks: int, lora: bool) -> float | None:
        """The plan's GiB per rank when it fits, else None."""
        from offpolicy.learner.plan.memory import GIB

        plan = self.settings(ranks, lora).plan
        return plan.total / GIB if plan.total <= self.limit else None


def refusal(model: str, learner_gpus: int, lora: bool, gpu_gib: float) -> str | None:
    """Why the quickstart's learner for `model` on `learner_gpus` GPUs of `gpu_gib` GiB each does not fit
    (the memory plan's parts, and the fixes with their plans), or None when it fits."""
    from offpolicy.learner.errors import MemoryPlanError
    from offpolicy.learner.plan.memory import GIB, HEADROOM, check, estimate

    limit = int(HEADROOM * gpu_gib * GIB)
    plans = LearnerPlans(model, limit)
    config, settings = plans.config(lora), plans.settings(learner_gpus, lora)
    try:  # the learner's own check at start
        check(settings.plan, limit, config, learner_gpus, settings.checkpointed_layers, settings.layers)
    except MemoryPlanError:
        pass
    else:
        return None
    plan = settings.plan
    parts = ", ".join(
        f"{k} {v:.1f}" for k, v in plan.as_dict().items() if v and k not in ("total", "host_offloaded")
    )
    fixes = []
    if not lora and (gib := plans.fits(learner_gpus, True)) is not None:
        fixes.append(f"--lora (a LoRA adapter on the frozen model: {gib:.1f} GiB)")
    for ranks in range(learner_gpus + 1, MAX_LEARNER_GPUS + 1):
        if (gib := plans.fits(ranks, lora)) is not None:
            fixes.append(
                f"more GPUs for the learner: {2 * ranks - 1} or more in --gpus (the learner takes the first "
                f"half, rounded up: {ranks} GPUs, FSDP2, {gib:.1f} GiB each)"
            )
            break
    shape = plans.shape(lora)
    fixes.append(f"a smaller --model (this one has {shape.params:,} parameters)")
    # the least lower token budgets can do: micro-batches and log-prob chunks of 1,024 tokens, every
    # layer checkpointed
    small = config.model_copy(
        update={"micro_batch_tokens": LEAST_TOKENS, "logprob_chunk_tokens": LEAST_TOKENS}
    )
    least = estimate(small, shape, learner_gpus, learner_gpus > 1, True, True)
    tokens = (
        f"lower token budgets (micro_batch_tokens, now {config.micro_batch_tokens}; logprob_chunk_tokens, "
        f"now {config.logprob_chunk_tokens})"
    )
    if least.total <= limit:
        fixes.append(
            f"{tokens} in a learner config of your own ({LEAST_TOKENS:,} each plans {least.total / GIB:.1f} "
            f"GiB), checked by `offpolicy config check LEARNER_YAML --gpus {learner_gpus} --gpu-memory-gib "
            f"{gpu_gib:g}`"
        )
        cannot = ""
    else:
        cannot = f". Not {tokens}: at {LEAST_TOKENS:,} each the plan is {least.total / GIB:.1f} GiB"
    return (
        f"the learner's memory plan needs ~{plan.total / GIB:.1f} GiB per GPU ({parts} GiB) on "
        f"{learner_gpus} GPU(s) of {gpu_gib:g} GiB, {limit / GIB:.1f} GiB of each usable "
        f"({HEADROOM:.0%}): the learner would refuse it at start. Fixes: {'; '.join(fixes)}{cannot}"
    )
