"""The value model for GAE: the policy's backbone architecture with a scalar head, its loss, and GAE itself.

Deliberately simple: the critic is a separate copy of the backbone (as in verl's PPO critic), trained by its
own AdamW at a constant LR once per policy optimizer step, on the same micro-batches. The reward of a
completion is placed on its last response token; there is no KL-in-reward penalty.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel

from learner.batching import Batch
from learner.model import pick_device_and_dtype


class ValueModel(nn.Module):
    """Backbone (`AutoModel`) + `Linear(hidden, 1)`: V(s_t) at every response position."""

    def __init__(self, path_or_id: str | Path, device: str | None = None) -> None:
        super().__init__()
        dev, dtype = pick_device_and_dtype(device)
        self.backbone = AutoModel.from_pretrained(str(path_or_id), dtype=dtype)
        self.head = nn.Linear(self.backbone.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.to(dev).train()

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
        return self.head(hidden).squeeze(-1).float() * batch.response_mask  # (B, R)


def token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) rewards placed on each row's last valid response token: (B, R)."""
    last = (response_mask.cumsum(-1) == response_mask.sum(-1, keepdim=True)) & (response_mask > 0)  # (B, R)
    first_last = last & (last.cumsum(-1) == 1)
    return first_last.float() * rewards[:, None]


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the response tokens; returns (whitened advantages, returns), both (B, R), 0 on padding.

    delta_t = r_t + gamma * V_{t+1} - V_t with V = 0 past the last token; A_t = delta_t + gamma*lam*A_{t+1};
    returns = A + V (before whitening); advantages whitened over valid tokens (verl's masked_whiten).
    """
    mask = response_mask.float()
    r = token_rewards(rewards.float(), mask)  # (B, R)
    v = values.float() * mask
    R = mask.shape[1]
    adv = torch.zeros_like(v)
    last_gae = torch.zeros_like(v[:, 0])
    for t in reversed(range(R)):
        next_v = v[:, t + 1] if t + 1 < R else torch.zeros_like(last_gae)
        delta = r[:, t] + gamma * next_v - v[:, t]
        last_gae = (delta + gamma * lam * last_gae) * mask[:, t]
        adv[:, t] = last_gae
    returns = (adv + v) * mask
    n = mask.sum().clamp(min=1.0)
    mean = (adv * mask).sum() / n
    var = (((adv - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1.0)
    return (adv - mean) * torch.rsqrt(var + 1e-8) * mask, returns


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss, token-mean over `mask`; returns (loss, metrics as 0-d tensors)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    l1, l2 = (values - returns) ** 2, (clipped - returns) ** 2
    n = mask.sum().clamp(min=1.0)
    loss = 0.5 * (torch.maximum(l1, l2) * mask).sum() / n
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": ((l2 > l1).float() * mask).sum() / n,
        "critic/values_mean": (values.detach() * mask).sum() / n,
    }
    return loss, metrics
