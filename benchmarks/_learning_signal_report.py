"""The report of benchmarks/learning_signal.py: its table (`print_table`, from the `--json` object) and its
plot (`plot`: the learnable groups' reward per arm, and the distilled student's reverse KL and reward)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from learning_signal import RunTrace, Setup


def plot(traces: list[RunTrace], setup: Setup, path: Path) -> None:
    """Left: the learnable groups' reward per step, mean over seeds, per arm, with the threshold; right
    (when it ran): the distilled student's reverse KL to the teacher and its reward. matplotlib Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(arm: str) -> list[float]:
        runs = [t.rewards for t in traces if t.arm == arm]
        return [statistics.fmean(c) for c in zip(*runs, strict=True)]

    student = [t for t in traces if t.arm == "distill"]
    fig, axes = plt.subplots(1, 1 + bool(student), figsize=(5.5 * (1 + bool(student)), 4), squeeze=False)
    ax = axes[0][0]
    for arm in (a for a in setup.arms if any(t.arm == a for t in traces)):
        ax.plot(curve(arm), lw=1.5, label=arm)
    ax.axhline(setup.threshold, color="grey", lw=0.5)
    ax.set_title("learnable groups' reward (half the prompts flat)")
    ax.set_xlabel("learner step")
    ax.set_ylabel(f"reward (mean of {len(setup.seeds)} seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if student:
        ax = axes[0][1]
        ax.plot(student[0].distill_kl, color="tab:purple", lw=1.5, label="reverse KL to the teacher")
        ax.set_xlabel("student step")
        ax.set_ylabel("distill/reverse_kl")
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.plot(student[0].rewards, color="tab:green", lw=1.5, label="student reward")
        twin.set_ylabel("reward")
        ax.set_title("on-policy distillation")
        lines = ax.get_lines() + twin.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="center right")
    lag = f", actors {setup.eta} versions behind" if setup.eta else ""
    shape = f"{setup.groups_per_step}x{setup.n} completions/step"
    fig.suptitle(f"toy task, tiny Llama, lr {setup.lr:g}, {shape}{lag}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(out: dict, file=None) -> None:
    """The `--json` object of `summarise` as a table (stdout, or stderr beside the JSON)."""
    if out["eta"]:
        print(f"actors {out['eta']} policy versions behind the learner (eta)", file=file)
    print(f"{'arm':<12} {'seed':>4} {'steps':>5} {'reached':>7} {'learner s':>9} {'final':>6} "
          f"{'flat trained':>12} {'generated':>9}", file=file)  # fmt: skip
    for r in out["runs"]:
        print(f"{r['arm']:<12} {r['seed']:>4} {r['steps_to_target']:>5} {r['reached']!s:>7} "
              f"{r['learner_s_to_target']:>9.2f} {r['final_reward']:>6.3f} {r['trained_flat_share']:>12.2f} "
              f"{r['groups_generated']:>9}", file=file)  # fmt: skip
    for arm, m in out["mean_steps_to_target"].items():
        print(
            f"mean {arm:<12} steps {m:.2f}, learner s {out['mean_learner_s_to_target'][arm]:.2f}", file=file
        )
    for key in ("ratio_dynamic_vs_plain", "ratio_prioritized_vs_plain"):
        if out[key] is not None:
            print(f"{key}: {out[key]:.3f} (target <= {out['target_ratio']})", file=file)
    if out["generated_groups_ratio"] is not None:  # the cost the steps ratio leaves out
        print(f"generated_groups_ratio (dynamic / plain, whole runs): {out['generated_groups_ratio']:.3f}; "
              f"to the target: {out['generated_to_target_ratio']:.3f}", file=file)  # fmt: skip
    if "distill_kl_first" in out:
        print(f"distillation: reverse KL {out['distill_kl_first']:.4f} -> {out['distill_kl_last']:.4f}, "
              f"student reward {out['distill_reward_first']:.3f} -> {out['distill_reward_last']:.3f} "
              f"(teacher {out['teacher_reward']:.3f})", file=file)  # fmt: skip
