"""The learner's batch: trajectory groups as padded tensors, one row per completion (`Batch`, `collate`).

Layout (the same for every row): the prompt is LEFT-padded to the batch's longest prompt `P`, the
response is RIGHT-padded to the longest response `R`, so every response starts at column `P` and
`input_ids` is (B, P + R). Position ids restart at 0 on each row's first real prompt token, as in vLLM.
The policy's forward over a batch is learner/model/policy.py.

Groups that show images (a vision-language policy) also carry `Images`: the pixels of each distinct image
once, and which of them each row shows, in placeholder order (a group's n completions share one copy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from offpolicy.learner.errors import BatchError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from offpolicy.buffer.types import Trajectory, TrajectoryGroup


@dataclass(frozen=True, slots=True)
class Images:
    """The images of a batch as the vision tower takes them: each distinct image once."""

    pixel_values: torch.Tensor  # (patches, D) float: every image's patches, image after image
    grid_thw: torch.Tensor  # (n, 3) long: each image's (time, height, width) in patches
    rows: tuple[tuple[int, ...], ...]  # per batch row: the images (indexes) it shows, in placeholder order

    @classmethod
    def of(
        cls, groups: Sequence[TrajectoryGroup], pixels: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> Images | None:
        """The images of `groups`' rows (group order, then completion order) from each image's processed
        (pixel values (p, D), grid (3,)) by sha256; None when no group shows an image. A group naming an
        image `pixels` lacks raises `BatchError`."""
        if not any(g.images for g in groups):
            return None
        index: dict[str, int] = {}
        for g in groups:
            for sha in g.images:
                if sha not in pixels:
                    raise BatchError(f"group {g.group_id}: image {sha} has no pixels")
                index.setdefault(sha, len(index))
        shas = list(index)
        rows = tuple(tuple(index[sha] for sha in g.images) for g in groups for _ in g.trajectories)
        return cls(
            torch.cat([pixels[sha][0] for sha in shas]),
            torch.stack([torch.as_tensor(pixels[sha][1], dtype=torch.long) for sha in shas]),
            rows,
        )

    def select(self, rows: Sequence[int]) -> Images | None:
        """The images of batch rows `rows`, renumbered (None when they show none)."""
        used = sorted({i for r in rows for i in self.rows[r]})
        if not used:
            return None
        renumber = {old: new for new, old in enumerate(used)}
        sizes = self.grid_thw.prod(-1).tolist()
        starts = [0, *np.cumsum(sizes).tolist()]
        pixel_values = torch.cat([self.pixel_values[starts[i] : starts[i + 1]] for i in used])
        grid = self.grid_thw[used]
        return Images(pixel_values, grid, tuple(tuple(renumber[i] for i in self.rows[r]) for r in rows))

    def to(self, device: torch.device | str) -> Images:
        return dataclasses.replace(
            self, pixel_values=self.pixel_values.to(device), grid_thw=self.grid_thw.to(device)
        )


@dataclass(slots=True)
class Batch:
    """One sampled batch as padded tensors; `None` fields are filled in by the train loop."""

    input_ids: torch.Tensor  # (B, P+R) long: left-padded prompt, then right-padded response
    attention_mask: torch.Tensor  # (B, P+R) long: 1 on real prompt and response tokens
    position_ids: torch.Tensor  # (B, P+R) long: 0 at each row's first prompt token
    response_ids: torch.Tensor  # (B, R) long: the sampled token ids (pad after the end)
    response_mask: torch.Tensor  # (B, R) float: 1 on tokens the loss uses (rejection sampling may clear some)
    sampled_mask: (
        torch.Tensor
    )  # (B, R) float: 1 on every policy token (never changed; GAE and critic use it); 0 on environment ones
    behavior_logprobs: torch.Tensor  # (B, R) float: the behaviour policy's log-probs (0 on padding)
    rewards: torch.Tensor  # (B,) float: one scalar reward per completion
    group_index: torch.Tensor  # (B,) long: 0..G-1, which group each row belongs to
    policy_versions: (
        torch.Tensor
    )  # (B,) long: the row's oldest token version (its staleness is measured from it)
    versions: torch.Tensor  # (B, R) long: per-token policy version (the group's, unless it spans a reload)
    temperatures: torch.Tensor  # (B,) float: the sampling temperature of each row's group
    prompt_width: int  # P: column where every response starts
    # MoE (model/moe.py): the experts the rollout chose at the position predicting each response token,
    # (B, R, L, K) int16 (int32 past 32767 experts), -1 = no row (padding, a trajectory without routing)
    routed_experts: torch.Tensor | None = None
    replay_experts: torch.Tensor | None = None  # (B, R, L, K): what the forward replays (moe.routing_replay)
    images: Images | None = None  # the images the rows show (vision-language policies), else None
    # Filled in by the loop (spec §5.1):
    old_log_probs: torch.Tensor | None = None  # (B, R) pi_old (decoupled) or pi_rollout (bypass)
    advantages: torch.Tensor | None = None  # (B, R)
    is_weights: torch.Tensor | None = None  # (B, R) decoupled IS weights, detached
    returns: torch.Tensor | None = None  # (B, R) GAE returns (critic targets)
    values: torch.Tensor | None = None  # (B, R) critic values at sampling time
    ref_log_probs: torch.Tensor | None = None  # (B, R) the reference policy's (KL loss), no grad
    teacher_log_probs: torch.Tensor | None = None  # (B, R) the distillation teacher's, no grad

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on `device`."""
        images = None if self.images is None else self.images.to(device)
        return dataclasses.replace(
            self, images=images, **{k: v.to(device) for k, v in self._tensors().items()}
        )

    def select(self, rows: torch.Tensor) -> Batch:
        """The rows `rows` (long index), with columns that are padding in all of them trimmed away."""
        sub = {k: v[rows] for k, v in self._tensors().items()}
        prompt_mask = sub["attention_mask"][:, : self.prompt_width]  # (b, P)
        drop_left = int((prompt_mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-pad columns
        keep_r = int(sub["sampled_mask"].sum(0).nonzero().max()) + 1 if sub["sampled_mask"].any() else 1
        for k, v in sub.items():
            if v.dim() == 2 and v.shape[1] == self.input_ids.shape[1]:
                sub[k] = v[:, drop_left : self.prompt_width + keep_r]
            elif v.dim() >= 2:  # (b, R) and (b, R, L, K)
                sub[k] = v[:, :keep_r]
        images = None if self.images is None else self.images.select(rows.tolist())
        return dataclasses.replace(self, prompt_width=self.prompt_width - drop_left, images=images, **sub)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }


def _policy(values: np.ndarray, t: Trajectory) -> np.ndarray:
    """`values` (one per response token) on the policy's tokens only."""
    return values if t.policy_mask is None else values[t.policy_mask]


def collate(
    groups: Sequence[TrajectoryGroup],
    pad_token_id: int,
    pixels: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Batch:
    """Pad the completions of `groups` into one `Batch` (rows in group order, then completion order).
    `pixels`: each image's processed (pixel values, grid) by sha256, for groups that show images
    (learner/model/vision.py `process_images`).

    Environment tokens of a multi-turn completion (`policy_mask` False) are in `input_ids` and
    `attention_mask` (the policy attends to them) but not in `response_mask` / `sampled_mask`: no loss, no
    IS weight, no rejection-sampling statistic, no KL, no value; their behaviour log-probs read as 0."""
    if not groups:
        raise BatchError("collate needs at least one group")
    rows = [(gi, g, t) for gi, g in enumerate(groups) for t in g.trajectories]
    for _, g, t in rows:
        if g.sampling.temperature <= 0:
            raise BatchError(
                f"group {g.group_id}: temperature {g.sampling.temperature} has no sampling log-probs"
            )
        if len(t.response_ids) == 0 or len(t.response_ids) != len(t.behavior_logprobs):
            raise BatchError(
                f"group {g.group_id}: {len(t.response_ids)} response ids, "
                f"{len(t.behavior_logprobs)} behaviour log-probs"
            )
    B = len(rows)
    P = max(len(g.prompt_ids) for _, g, _ in rows)
    R = max(len(t.response_ids) for _, _, t in rows)
    ids = np.full((B, P + R), pad_token_id, dtype=np.int64)
    attn = np.zeros((B, P + R), dtype=np.int64)
    behavior_logprobs = np.zeros((B, R), dtype=np.float32)
    versions = np.zeros((B, R), dtype=np.int64)
    policy = np.zeros((B, R), dtype=np.float32)  # 1 on tokens the policy generated: the only ones trained
    for b, (_, g, t) in enumerate(rows):
        p, r = len(g.prompt_ids), len(t.response_ids)
        ids[b, P - p : P] = g.prompt_ids
        ids[b, P : P + r] = t.response_ids
        attn[b, P - p : P + r] = 1  # environment tokens too: attended, never trained
        behavior_logprobs[b, :r] = t.behavior_logprobs
        versions[b, :r] = g.policy_version if t.versions is None else t.versions
        policy[b, :r] = 1.0 if t.policy_mask is None else t.policy_mask
    oldest = [  # a completion's staleness counts from its oldest policy token (what max_staleness bounds)
        g.policy_version if t.versions is None or len(t.versions) == 0 else int(_policy(t.versions, t).min())
        for _, g, t in rows
    ]
    input_ids, attention_mask = torch.from_numpy(ids), torch.from_numpy(attn)
    routed = _routed(rows, R)
    response_mask = torch.from_numpy(policy)  # (B, R)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        response_ids=input_ids[:, P:].clone(),
        response_mask=response_mask,
        sampled_mask=response_mask.clone(),
        behavior_logprobs=torch.from_numpy(behavior_logprobs) * response_mask,
        rewards=torch.tensor([float(t.reward) for _, _, t in rows], dtype=torch.float32),
        group_index=torch.tensor([gi for gi, _, _ in rows], dtype=torch.long),
        policy_versions=torch.tensor(oldest, dtype=torch.long),
        versions=torch.from_numpy(versions),
        temperatures=torch.tensor([g.sampling.temperature for _, g, _ in rows], dtype=torch.float32),
        prompt_width=P,
        routed_experts=routed,
        images=Images.of(groups, pixels or {}),
    )


def _routed(rows: list[tuple[int, TrajectoryGroup, Trajectory]], R: int) -> torch.Tensor | None:
    """The rows' routed experts (B, R, L, K), -1 where a row has none; None when no row has any."""
    have = [t.routed_experts for _, _, t in rows if t.routed_experts is not None]
    if not have:
        return None
    shape = have[0].shape[1:]
    if any(a.shape[1:] != shape for a in have):
        raise BatchError(
            f"routed experts of (layers, top_k) {sorted({a.shape[1:] for a in have})} in one batch"
        )
    wide = max(g.num_experts or 0 for _, g, _ in rows) > np.iinfo(np.int16).max
    out = np.full((len(rows), R, *shape), -1, dtype=np.int32 if wide else np.int16)
    for b, (_, _, t) in enumerate(rows):
        if t.routed_experts is not None:
            out[b, : len(t.routed_experts)] = t.routed_experts
    return torch.from_numpy(out)


def staleness(batch: Batch, consumer_version: int) -> torch.Tensor:
    """Per-row staleness in optimizer steps: consumer_version - the row's oldest token version, (B,)."""
    return consumer_version - batch.policy_versions


def token_staleness(batch: Batch, consumer_version: int) -> torch.Tensor:
    """Per-token age in optimizer steps: consumer_version - the version that sampled each token, (B, R)."""
    return consumer_version - batch.versions
