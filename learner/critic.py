"""The value model for GAE: the policy's backbone architecture with a scalar head, and its loss.

Deliberately simple: the critic is a separate copy of the backbone (as in verl's PPO critic), trained by its
own AdamW at a constant LR once per policy optimizer step, on the same micro-batches, in the policy's
precision. The reward of a completion is placed on its last sampled token (whatever rejection sampling
masks out of the policy loss); there is no KL-in-reward penalty.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel

from learner.batching import Batch


class ValueModel(nn.Module):
    """Backbone (`AutoModel`) + `Linear(hidden, 1)`: V(s_t) at every response position."""

    def __init__(
        self,
        path_or_id: str | Path,
        device: torch.device | str,
        dtype: torch.dtype,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.backbone = AutoModel.from_pretrained(str(path_or_id), dtype=dtype)
        if gradient_checkpointing:
            self.backbone.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.head = nn.Linear(self.backbone.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.to(device).train()

    def forward(self, batch: Batch) -> torch.Tensor:
        """Values of the states before each response token: (B, R), 0 on padding."""
        out = self.backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        R = batch.response_ids.shape[1]
        hidden = out.last_hidden_state[:, batch.prompt_width - 1 : batch.prompt_width - 1 + R]  # (B, R, H)
        return self.head(hidden).squeeze(-1).float() * batch.sampled_mask  # (B, R)


def token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) rewards placed on each row's last valid response token: (B, R)."""
    last = (response_mask.cumsum(-1) == response_mask.sum(-1, keepdim=True)) & (response_mask > 0)  # (B, R)
    first_last = last & (last.cumsum(-1) == 1)
    return first_last.float() * rewards[:, None]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    denominator: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss summed over `mask` and divided by `denominator` (the mini-batch's sampled
    tokens, so micro-batch losses add up to the mini-batch's token-mean whatever the split); returns
    (loss, metrics: 0-d tensors, this call's token-means)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    l1, l2 = (values - returns) ** 2, (clipped - returns) ** 2
    n = mask.sum().clamp(min=1.0)
    total = 0.5 * (torch.maximum(l1, l2) * mask).sum()
    loss = total / denominator
    metrics = {
        "critic/vf_loss": total.detach() / n,
        "critic/vf_clipfrac": ((l2 > l1).float() * mask).sum() / n,
        "critic/values_mean": (values.detach() * mask).sum() / n,
    }
    return loss, metrics
