"""The learner's `lora` section: train a LoRA adapter (peft) on the frozen base model instead of the full
weights; each version publishes only the adapter (docs/lora.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from offpolicy.config.base import FROZEN, ConfigModel


class LoraConfig(ConfigModel):
    """A LoRA adapter on the policy (peft's `inject_adapter_in_model`, adapter name `default`): W x + (alpha
    / rank) B A x on each targeted linear layer, A (rank x in) Kaiming-initialised from the run's `seed`, B
    (out x rank) zero, so version 0 is the base model. Only A and B (and `modules_to_save`) are trained,
    held by AdamW, checkpointed and published; the base weights stay frozen in the compute dtype's masters.
    The KL loss's reference is the same model with the adapter disabled (no second copy) unless
    `reference.model_path` names another model."""

    rank: int = Field(16, ge=1, le=1024, json_schema_extra=FROZEN)
    """r: the adapter's inner dimension (the actors' `engine.lora.max_rank` must be at least this)."""
    alpha: float = Field(32.0, gt=0.0, json_schema_extra=FROZEN)
    """The scale numerator: the update is (alpha / rank) B A x (peft's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0, json_schema_extra=FROZEN)
    """Dropout on the adapter's input in the training forward passes only (pi_old, the reference and the
    actors never drop); > 0 makes pi_theta a noisy estimate of pi_old even on-policy."""
    target_modules: Literal["all-linear"] | list[str] = Field("all-linear", json_schema_extra=FROZEN)
    """Which linear layers get an adapter: `all-linear` (every linear layer of the decoder, the LM head
    excluded, as peft defines it) or module names matched as peft does (`q_proj`, `v_proj`, ... : a name
    matches a module whose path ends with it)."""
    modules_to_save: list[str] = Field(default_factory=list, json_schema_extra=FROZEN)
    """Whole modules trained along with the adapter and published with it (peft's `modules_to_save`,
    e.g. `lm_head`); empty = the adapter alone."""

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and (not v or any(not s or not s.strip() for s in v)):
            raise ValueError("target_modules must be `all-linear` or a non-empty list of module names")
        return v

    def peft(self, vision: bool = False) -> Any:
        """peft's `LoraConfig` of this section (bias none, the causal-LM task): what the learner injects
        (learner/model/lora.py) and the memory plan counts (learner/plan/memory.py). `vision`: a
        vision-language model, whose tower (`model.visual`) the adapter leaves out: it covers the language
        model, as vLLM serves it."""
        from peft import LoraConfig as PeftLoraConfig

        targets = self.target_modules
        return PeftLoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets if isinstance(targets, str) else list(targets),
            exclude_modules=r"(.*\.)?visual\..*" if vision else None,
            modules_to_save=list(self.modules_to_save) or None,
            bias="none",
            task_type="CAUSAL_LM",
        )
