"""What the quickstart shows: the reward-rise rule, the progress line, the summary and the PNG plot."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

# Keys of the learner's per-step metrics (learner/metrics.py) that the quickstart reads.
REWARD = "reward_mean"
VERSION = "version"
STALENESS = "staleness_mean"
ESS = "rollout_corr/rollout_is_eff_sample_size"
KL = "rollout_corr/kl"
TOKENS_PER_S = "tokens_per_s"


@dataclass
class RewardTracker:
    """Per-step records and the rule for "the reward has clearly risen".

    Risen = at least `min_steps` steps, and the mean reward of the last `window` steps exceeds the mean of
    the first `baseline_steps` by `min_rise` (absolute) and by `min_ratio` (relative to the baseline).
    """

    baseline_steps: int = 3
    window: int = 5
    min_steps: int = 10
    min_rise: float = 0.1
    min_ratio: float = 2.0
    records: list[dict[str, Any]] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    @property
    def steps(self) -> int:
        return len(self.records)

    def rewards(self) -> list[float]:
        return [float(r.get(REWARD, 0.0)) for r in self.records]

    def baseline(self) -> float | None:
        rewards = self.rewards()
        return fmean(rewards[: self.baseline_steps]) if len(rewards) >= self.baseline_steps else None

    def recent(self) -> float | None:
        rewards = self.rewards()
        return fmean(rewards[-self.window :]) if rewards else None

    def risen(self) -> bool:
        base, recent = self.baseline(), self.recent()
        if base is None or recent is None or self.steps < self.min_steps:
            return False
        return recent - base >= self.min_rise and recent >= self.min_ratio * base


def _fmt(value: Any, spec: str) -> str:
    return "  -  " if value is None else format(float(value), spec)


def format_progress(record: dict[str, Any], tracker: RewardTracker) -> str:
    """One line per learner step: step, version, reward (and its start), staleness, IS ESS, KL, tokens/s."""
    actor = record.get("actor") or {}
    base = tracker.baseline()
    return (
        f"step {tracker.steps:3d}  v{int(record.get(VERSION, 0)):<4d} "
        f"reward {_fmt(record.get(REWARD), '.3f')} (start {_fmt(base, '.3f')})  "
        f"staleness {_fmt(record.get(STALENESS), '.2f')}  IS ESS {_fmt(record.get(ESS), '.3f')}  "
        f"KL {_fmt(record.get(KL), '+.4f')}  tok/s learner {_fmt(record.get(TOKENS_PER_S), '.0f')} "
        f"actor {_fmt(actor.get('tokens_per_s'), '.0f')} (on v{actor.get('loaded_policy_version', '?')})"
    )


def format_eval(record: dict[str, Any]) -> str | None:
    """The evaluation line of a step that carries one (`eval/...` keys); None otherwise."""
    if "eval/reward_mean" not in record:
        return None
    passes = "  ".join(
        f"{k.removeprefix('eval/')} {_fmt(v, '.3f')}"
        for k, v in sorted(record.items())
        if k.startswith("eval/pass@")
    )
    version, prompts = int(record.get("eval/policy_version") or 0), int(record.get("eval/prompts") or 0)
    reward = _fmt(record.get("eval/reward_mean"), ".3f")
    return f"  eval v{version:<4d} held-out reward {reward}  {passes}  ({prompts} prompts)"


def summary_lines(tracker: RewardTracker, run_dir: Path) -> list[str]:
    """The closing summary: did the reward rise, from what to what, in how many steps and seconds."""
    if not tracker.records:
        return ["[quickstart] no learner step completed"]
    first, last = tracker.records[0], tracker.records[-1]
    seconds = float(last.get("t", 0.0)) - float(first.get("t", 0.0))
    staleness = [float(r[STALENESS]) for r in tracker.records if STALENESS in r]
    verdict = "ROSE" if tracker.risen() else "did not rise clearly"
    tensorboard = run_dir / "tensorboard"
    return [
        "",
        f"[quickstart] reward {verdict}: {_fmt(tracker.baseline(), '.3f')} over the first "
        f"{tracker.baseline_steps} steps -> {_fmt(tracker.recent(), '.3f')} over the last {tracker.window}",
        f"[quickstart] {tracker.steps} learner steps, policy v{int(last.get(VERSION, 0))}, "
        f"{seconds:.0f} s of training; mean staleness {_fmt(fmean(staleness) if staleness else None, '.2f')}",
        f"[quickstart] metrics: {run_dir / 'metrics.jsonl'}",
        *([f"[quickstart] TensorBoard: tensorboard --logdir {tensorboard}"] if tensorboard.is_dir() else []),
    ]


def plot_run(records: list[dict[str, Any]], path: Path) -> None:
    """Reward, off-policy KL and staleness per learner step, as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(records) + 1))
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    for ax, key, label in zip(
        axes, (REWARD, KL, STALENESS), ("reward (mean)", "KL(rollout || train)", "staleness (steps)"),
        strict=True,
    ):  # fmt: skip
        ax.plot(steps, [r.get(key, float("nan")) for r in records], marker=".")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("learner step")
    fig.suptitle("offpolicy quickstart")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
