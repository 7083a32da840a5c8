"""Every benchmark target in one table: the figure, its baseline, the bound an issue set, and the run.

A target reads one figure out of a benchmark's `--json` object (`pick`), compares it with its bound (`op`,
`bound`), and names what it is measured against (`baseline`). `offpolicy bench --check` judges each target
on the median of a record's repeats; docs/benchmarks.md's "Targets" table is rendered from the same rows, so a
missed target is shown missed there.

`args` is the full run's command line (what a committed record of the target must have been run with);
`device` says where the figure means something ("cpu", "cuda"): a CUDA target has no verdict from a CPU
record. A target whose figure is absent from a record (the script changed, or the run skipped that part)
is reported as such, never as met.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from offpolicy.services.bench.records import Record, lookup

OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda v, b: v <= b,
    ">=": lambda v, b: v >= b,
    "<": lambda v, b: v < b,
    "==": lambda v, b: v == b,
}


def _key(path: str) -> Callable[[dict[str, Any]], float | None]:
    def pick(out: dict[str, Any]) -> float | None:
        try:
            value = lookup(out, path)
        except KeyError:
            return None
        if isinstance(value, bool):
            return float(value)
        return float(value) if isinstance(value, int | float) else None

    pick.__doc__ = path
    return pick


def _largest(list_key: str, value_key: str, **match: Any) -> Callable[[dict[str, Any]], float | None]:
    """The `value_key` of the largest (B x T) row of `out[list_key]` whose fields equal `match` (a smoke run's
    sizes are smaller than a full run's: the same pick serves both)."""

    def pick(out: dict[str, Any]) -> float | None:
        rows = [r for r in out.get(list_key) or [] if all(r.get(k) == v for k, v in match.items())]
        rows = [r for r in rows if isinstance(r.get(value_key), int | float)]
        return float(max(rows, key=lambda r: r["B"] * r["T"])[value_key]) if rows else None

    pick.__doc__ = f"{list_key}[{', '.join(f'{k}={v}' for k, v in match.items())}, largest B x T].{value_key}"
    return pick


def _worst(list_key: str, value_key: str, worst: Callable = max) -> Callable[[dict[str, Any]], float | None]:
    def pick(out: dict[str, Any]) -> float | None:
        values = [r[value_key] for r in out.get(list_key) or [] if isinstance(r.get(value_key), int | float)]
        return float(worst(values)) if values else None

    pick.__doc__ = f"{worst.__name__} of {list_key}[*].{value_key}"
    return pick


def _kl_fall(out: dict[str, Any]) -> float | None:
    first, last = out.get("distill_kl_first"), out.get("distill_kl_last")
    if not isinstance(first, int | float) or not isinstance(last, int | float) or first <= 0:
        return None
    return 1.0 - last / first


_kl_fall.__doc__ = "1 - distill_kl_last / distill_kl_first"


def _replay_gap_change(out: dict[str, Any]) -> float | None:
    replay, free = out.get("logprob_gap_replay"), out.get("logprob_gap_no_replay")
    if not isinstance(replay, int | float) or not isinstance(free, int | float):
        return None
    return replay - free


_replay_gap_change.__doc__ = "logprob_gap_replay - logprob_gap_no_replay"


@dataclass(frozen=True)
class Target:
    """One bound on one figure of one benchmark."""

    name: str
    """Unique, stable: `bench --check` names a missed target by it."""
    benchmark: str
    """The script: benchmarks/<benchmark>.py."""
    figure: str
    """What the figure is, in words (with its unit)."""
    pick: Callable[[dict[str, Any]], float | None]
    """The figure out of one repeat's `--json` object (None: absent)."""
    op: str
    bound: float
    baseline: str
    """What the figure is measured against in the same run."""
    args: tuple[str, ...] = ()
    """The full run's arguments (besides --json)."""
    device: str = "cpu"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.pick.__doc__ or self.name

    @property
    def bound_text(self) -> str:
        return f"{self.op} {self.bound:g}"

    def figures(self, record: Record) -> list[float]:
        """This target's figure in each repeat of `record` that has it."""
        values = []
        for repeat in record.data.get("repeats", []):
            out = repeat.get("output")
            value = self.pick(out) if isinstance(out, dict) else None
            if value is not None and math.isfinite(value):
                values.append(value)
        return values

    def verdict(self, record: Record) -> dict[str, Any]:
        """{"status": met|missed|absent, "median", "min", "max", "n", "record"} of `record`'s repeats."""
        values = self.figures(record)
        if not values:
            return {"target": self.name, "status": "absent", "record": record.id, "n": 0}
        median = statistics.median(values)
        return {
            "target": self.name,
            "status": "met" if OPS[self.op](median, self.bound) else "missed",
            "median": median,
            "min": min(values),
            "max": max(values),
            "n": len(values),
            "record": record.id,
        }


SIX_SEEDS = ("--distill-steps", "0", "--seeds", "0", "1", "2", "3", "4", "5")
TARGETS: tuple[Target, ...] = (
    Target("correction_ms", "correction", "ms per call, token TIS + token_k1,seq_max_k2, B=256, T=2048",
           _largest("results", "ours_ms", config="token TIS + token_k1,seq_max_k2"), "<=", 40.0,
           "verl 0.9.1's compute_rollout_correction_and_rejection_mask", ("--repeats", "11")),
    Target("buffer_insert_ratio", "buffer", "insert groups/s, ours / raw, worst shape and process count",
           _worst("rows", "insert_ratio", min), ">=", 0.8, "raw redis-py pipelined SET of the same bytes",
           ("--repeats", "5")),
    Target("buffer_sample_ratio", "buffer", "sample groups/s, ours / raw, worst shape and process count",
           _worst("rows", "sample_ratio", min), ">=", 0.8, "raw redis-py pipelined GET of the same bytes",
           ("--repeats", "5")),
    Target("learner_publish_share", "learner", "publish phase / step, publish-heavy shape",
           _key("publish_share"), "<=", 0.05, "a synchronous publish of the same weights",
           ("--shape", "publish-heavy", "--steps", "5")),
    Target("learner_published_lag", "learner", "published lag, versions, publish-heavy shape",
           _key("published_lag_max"), "<=", 2, "the step counter",
           ("--shape", "publish-heavy", "--steps", "5")),
    Target("longtail_padding", "learner", "padded share of token slots, packed micro-batches",
           _key("padded_token_share"), "<=", 0.05, "padded rows (padded_token_share_rows)",
           ("--shape", "longtail")),
    Target("longtail_speedup", "learner", "step time, padded rows / packed", _key("step_speedup_vs_rows"),
           ">=", 2.0, "padded rows of the same batch", ("--shape", "longtail")),
    Target("mfu_4b", "learner", "MFU of a whole step, Qwen3-4B shape, long-tailed batch, defaults",
           _key("mfu"), ">=", 0.40, "the levers-off row of the same run (--levers)",
           ("--shape", "longtail-4b", "--device", "cuda", "--steps", "3", "--profile"), device="cuda"),
    Target("mfu_1_78b", "learner", "MFU of a whole step, Llama 1.78B shape, long-tailed batch, defaults",
           _key("mfu"), ">=", 0.35, "the levers-off row of the same run (--levers)",
           ("--shape", "longtail-1.3b", "--device", "cuda", "--steps", "3"), device="cuda"),
    Target("fsdp_weight_diff", "learner_fsdp", "max |weight difference| after 3 steps, 2 ranks vs 1 process",
           _key("max_abs_weight_diff"), "<=", 1e-5, "the one-process learner on the same groups",
           ("--nproc", "2")),
    Target("publish_gather_speedup", "publish_gather", "gather to rank 0: state_dict / cast-first seconds",
           _key("speedup"), ">=", 1.5, "get_model_state_dict(full_state_dict, cpu_offload) then cast"),
    Target("publish_gather_share", "publish_gather", "publish phase / step on 2 ranks", _key("publish_share"),
           "<=", 0.05, "a synchronous gather and write (sync_publish_share)"),
    Target("actor_longtail", "actor", "tokens/s, streaming actor / old batch loop, long-tail lengths",
           _key("ratio_stream_vs_batch"), ">=", 1.2, "the old batch loop"),
    Target("actor_uniform", "actor", "tokens/s, streaming actor / bare LLM.generate, uniform lengths",
           _key("ratio_stream_vs_bare"), ">=", 0.9, "bare LLM.generate"),
    Target("actor_pause", "actor", "generation pause per update / 1 s interval, inflight reload",
           _key("pause_share"), "<=", 0.1, "the update interval"),
    Target("reward_latency", "reward_latency", "actor tokens/s, 200 ms remote verifier / local reward",
           _key("ratio"), ">=", 0.9, "a local sync reward, same engine"),
    Target("weight_sync_prefetch", "weight_sync", "generation pause, next version prefetched / not",
           _key("files_pause_ratio"), "<=", 0.5, "reload.prefetch: none", ("--rounds", "5")),
    Target("weight_delta_share", "weight_delta", "bytes of a delta version / a full one, AdamW lr 1e-6",
           _key("delta_bytes_share"), "<=", 0.1, "a full version of the same weights"),
    Target("weight_delta_engine_share", "weight_delta",
           "bytes of a delta round / a whole one, gloo engine, AdamW lr 1e-6",
           _key("engine.delta_bytes_share"), "<=", 0.1, "a whole round of the same weights"),
    Target("vision_logprob_diff", "vision", "max |learner - vLLM| log-prob, prompts with 1-2 images, fp32",
           _key("logprob_max_abs_diff"), "<=", 1e-4, "vLLM's behaviour log-probs of the same tokens"),
    Target("vision_image_bytes", "vision", "image bytes stored per group / (raw per group / n), n = 8",
           _key("stored_over_raw_per_n"), "<=", 1.01, "n copies of each group's image"),
    Target("agent_gateway", "agent", "gateway's share of the episodes' wall time",
           _key("gateway_overhead_share"), "<=", 0.05, "the engine's own time"),
    Target("dynamic_sampling_steps", "learning_signal", "steps to 0.5, dynamic / plain, 4 x 4, 6 seeds",
           _key("ratio_dynamic_vs_plain"), "<=", 0.8, "the plain arm (FIFO, flat groups trained)",
           SIX_SEEDS),
    Target("dynamic_sampling_steps_4x8", "learning_signal", "steps to 0.5, dynamic / plain, 4 x 8, 6 seeds",
           _key("ratio_dynamic_vs_plain"), "<=", 0.8, "the plain arm (FIFO, flat groups trained)",
           ("--groups-per-step", "4", "--n", "8", *SIX_SEEDS)),
    Target("dynamic_sampling_steps_8x8", "learning_signal", "steps to 0.5, dynamic / plain, 8 x 8, 6 seeds",
           _key("ratio_dynamic_vs_plain"), "<=", 0.8, "the plain arm (FIFO, flat groups trained)",
           ("--groups-per-step", "8", "--n", "8", *SIX_SEEDS)),
    Target("dynamic_sampling_steps_eta2", "learning_signal",
           "steps to 0.5, dynamic / plain, 4 x 4, 6 seeds, data 2 versions old",
           _key("ratio_dynamic_vs_plain"), "<=", 0.8, "the plain arm at the same staleness",
           ("--eta", "2", *SIX_SEEDS)),
    Target("distill_kl_fall", "learning_signal", "distillation: reverse KL's fall over 20 steps",
           _kl_fall, ">=", 0.5, "the student's first steps"),
    Target("control_auto_reward", "control", "control.mode auto: final reward / the synchronous arm's, "
           "phases changing under the run, 3 seeds", _key("auto_reward_vs_sync"), ">=", 0.95,
           "the synchronous arm (eta 0)"),
    Target("control_auto_idle", "control", "control.mode auto: learner idle share minus the best fixed "
           "eta's that reaches 0.95x sync", _key("auto_idle_excess"), "<=", 0.0,
           "the best fixed bound (eta 1, 4, 16) at >= 0.95x sync's reward",
           note="met by starting at max_staleness 16 and never moving: the toy task saturates within ~20 "
           "steps (no gradient after), so no phase made a loose bound cost reward; three earlier controller "
           "versions that started at 4 idled 0.253, 0.230, 0.221"),
    Target("control_auto_reward_rs", "control", "control.mode auto with a rejecting correction "
           "(decoupled_geo_rs_token_tis: stale tokens masked, eta 4 and 16 lose reward): final reward / "
           "sync's",
           _key("auto_reward_vs_sync"), ">=", 0.95, "the synchronous arm (eta 0)",
           args=("--correction", "decoupled_geo_rs_token_tis"),
           note="controller v4 (halving once per window) reached 0.935: too slow; v5 cuts in proportion"),
    Target("control_auto_idle_rs", "control", "control.mode auto with a rejecting correction: idle share "
           "minus the best fixed eta's that reaches 0.95x sync", _key("auto_idle_excess"), "<=", 0.0,
           "the best fixed bound (eta 1 here) at >= 0.95x sync's reward",
           args=("--correction", "decoupled_geo_rs_token_tis")),
    Target("lora_swap", "lora", "adapter swap / paused full reload, same engine",
           _key("adapter_swap_ratio"), "<=", 0.1, "a paused in-place reload of the full weights"),
    Target("lora_pool", "lora", "tokens/s per run, two runs on one engine / one run alone",
           _key("pool_tokens_per_s_ratio"), ">=", 0.8, "one run alone on the same engine", device="cuda",
           note="an engine below its batch limit: a 1-core CPU engine is saturated by one run"),
    Target("moe_replay_used", "moe", "token-layers whose experts the learner used = vLLM's, replay on",
           _key("router_agreement_replay"), "==", 1.0, "its own top-k (router_agreement_no_replay)"),
    Target("moe_replay_gap", "moe", "mean |log pi_learner - log mu|, bf16, replay on - off (nats)",
           _replay_gap_change, "<=", 0.0, "routing freely (logprob_gap_no_replay), same completions"),
    Target("moe_replay_fp32", "moe", "max |log pi_learner - log mu|, fp32, replay on (nats)",
           _key("fp32.logprob_gap_max_replay"), "<=", 1e-4, "vLLM's behaviour log-probs"),
    Target("moe_ep_weights", "moe", "max |weight diff|, 2 ranks with 2-way expert parallelism, 2 steps",
           _key("ep_max_abs_weight_diff"), "<=", 1e-5, "the one-process learner on the same groups"),
    Target("moe_routed_bytes", "moe", "routed experts' buffer bytes per response token / (layers x top_k)",
           _key("routed_bytes_per_choice"), "<=", 2.0, "the same groups encoded without them"),
    Target("soak_redis_memory", "soak", "Redis used memory growth after warm-up, 10 minutes",
           _key("redis_used_memory_growth"), "<", 0.1, "the memory after warm-up", ("--minutes", "10")),
    Target("soak_learner_rss", "soak", "learner RSS growth after warm-up, 10 minutes",
           _key("learner_rss_growth"), "<", 0.1, "the RSS after warm-up", ("--minutes", "10")),
)  # fmt: skip
"""Every target, in the order docs/benchmarks.md lists them."""


def targets_of(benchmark: str) -> list[Target]:
    return [t for t in TARGETS if t.benchmark == benchmark]


def options(args: list[str] | tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """`--a 1 --b x y --c` -> {"--a": ("1",), "--b": ("x", "y"), "--c": ()}: arguments compared as options."""
    opts: dict[str, tuple[str, ...]] = {}
    name = ""
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            opts[name] = (value,) if value else ()
        else:
            opts[name] = (*opts.get(name, ()), arg)
    return opts


def newest(records: list[Record], target: Target) -> Record | None:
    """The newest full-run record of `target`'s benchmark run with exactly the target's arguments (None:
    none): a record of another shape or other seeds is not the target's."""
    want = options(target.args)
    matching = [
        r
        for r in records
        if r.benchmark == target.benchmark
        and r.source == "run"
        and not r.smoke
        and options(r.data.get("args", [])) == want
    ]
    return matching[-1] if matching else None
