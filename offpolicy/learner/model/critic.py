"""The value model for GAE: the policy's backbone architecture with a scalar head (its loss: rl/losses.py).

Deliberately simple: the critic is a separate copy of the backbone (as in verl's PPO critic), trained by its
own AdamW at a constant LR once per policy optimizer step, on the same micro-batches, in the policy's
precision. The reward of a completion is placed on its last sampled token (whatever rejection sampling
masks out of the policy loss); there is no KL-in-reward penalty.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import AutoModel

from offpolicy.learner.model.policy import sampled_states, unpack

if TYPE_CHECKING:
    from offpolicy.learner.batch import Batch


class ValueModel(nn.Module):
    """Backbone (`AutoModel`) + `Linear(hidden, 1)`: V(s_t) at every response position."""

    def __init__(
        self,
        path_or_id: str | Path,
        device: torch.device | str,
        dtype: torch.dtype,
        gradient_checkpointing: bool = False,
        attn_implementation: str | None = None,
        backbone: nn.Module | None = None,
    ) -> None:
        """`backbone`: one built already (the lean start's, its parameters on the meta device: so is the
        head's, zeroed by `zero_head` once allocated); None = loaded from `path_or_id` onto `device`."""
        super().__init__()
        lean = backbone is not None
        self.backbone = backbone or AutoModel.from_pretrained(
            str(path_or_id), dtype=dtype, attn_implementation=attn_implementation
        )
        if gradient_checkpointing:
            self.backbone.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.head = nn.Linear(
            self.backbone.config.hidden_size, 1, dtype=dtype, device="meta" if lean else None
        )
        if lean:
            self.train()
            return
        self.zero_head()
        self.to(device).train()

    def zero_head(self) -> None:
        """V = 0 everywhere at the start: the head's weight and bias zeroed (sharded or not)."""
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.zero_()

    def forward(self, batch: Batch, packed: bool = False) -> torch.Tensor:
        """Values of the states before each response token: (B, R), 0 on padding. `packed`: the backbone
        runs on the packed row (learner/model/policy.py), the head on the sampled tokens alone."""
        if packed:
            states, sampled = sampled_states(self.backbone, batch)  # (N, H), (B, R)
            return unpack(self.head(states).squeeze(-1).float(), sampled) * batch.sampled_mask  # (B, R)
        out = self.backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        R = batch.response_ids.shape[1]
        hidden = out.last_hidden_state[:, batch.prompt_width - 1 : batch.prompt_width - 1 + R]  # (B, R, H)
        return self.head(hidden).squeeze(-1).float() * batch.sampled_mask  # (B, R)
