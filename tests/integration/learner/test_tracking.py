"""The learner's trackers after a short run on the tiny model and the embedded Redis: the TensorBoard
event files (read back with TensorBoard's EventAccumulator), the offline W&B run folder (its records read
back) and the MLflow store each hold every step's metrics, an eval metric logged through `log_eval`, the
config at start and the applied change with their sources, and the completions of each policy version
once; a JSONL file that cannot be written is logged and counted while the steps go on; a learner resumed
from a checkpoint logs its config with the source `resume`."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.tracking import SAMPLE_COLUMNS
from offpolicy.learner.trainer import Learner
from tests.integration.learner.test_loop import config, tiny_dir  # noqa: F401
from tests.unit.learner.rl.test_microbatches import ragged_groups

pytestmark = pytest.mark.redis
STEPS = 3


def run_three_steps(cfg) -> tuple[Learner, list[dict[str, float]]]:
    """Three steps on two groups each (policy versions 0, 1, 1), a config change applied before the third
    step, an eval metric at the version reached; the learner closed."""
    learner, out = Learner(cfg, CollectorRegistry()), []
    try:
        with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
            for i in range(STEPS):
                groups = ragged_groups(2, 2, seed=30 + i, response=(2, 6))
                buf.insert_many([replace(g, policy_version=min(i, 1)) for g in groups])
                if i == 2:
                    new = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"lr": 5e-4})})
                    learner.apply_config(new, config_version=1)
                out.append(learner.step())
        learner.tracker.log_eval(learner.version, {"accuracy": 0.625})
    finally:
        learner.close()
    return learner, out


def same_points(points: list[tuple[int, float]], losses: list[float]) -> None:
    """`points` are the three steps' losses at steps 1, 2, 3 (TensorBoard keeps float32)."""
    assert [step for step, _ in points] == [1, 2, 3]
    assert [value for _, value in points] == pytest.approx(losses, rel=1e-6, abs=1e-7)


def wandb_records(run_file: Path) -> list[Any]:
    """The records of an offline W&B run file: W&B's LevelDB-style log (a 7-byte header, then 32 KiB
    blocks of chunks: crc32 (4), length (2), type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, records, pos, parts = run_file.read_bytes(), [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # the block's tail is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
        elif kind == 0:
            break
    return records


def test_tensorboard_wandb_and_mlflow_hold_the_steps_an_eval_and_the_configs(tiny_dir, redis_url, tmp_path):  # noqa: F811
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config(
        tiny_dir, redis_url, tmp_path, checkpoint={"checkpoint_dir": None},
        metrics_jsonl=str(tmp_path / "steps.jsonl"),
        tracking={
            "tensorboard_dir": str(tmp_path / "tb"),
            "wandb": {"project": "offpolicy-test", "mode": "offline", "dir": str(tmp_path / "wb")},
            "mlflow": {
                "tracking_uri": uri, "experiment": "tracking-test",
                "artifact_location": (tmp_path / "mlflow-artifacts").as_uri(),
            },
            "samples_per_version": 3,
        },
    )  # fmt: skip
    learner, steps = run_three_steps(cfg)
    losses = [s["loss"] for s in steps]
    version = learner.version
    assert learner.metrics.registry.get_sample_value(
        "offpolicy_learner_tracking_errors_total", {"sink": "mlflow"}
    ) == 0 and all(
        learner.metrics.registry.get_sample_value("offpolicy_learner_tracking_errors_total", {"sink": s}) == 0
        for s in ("jsonl", "tensorboard", "wandb")
    )

    # JSONL: one line per step, as before
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["loss"] for line in lines] == pytest.approx(losses) and len(lines[0]["group_ids"]) == 2

    # TensorBoard
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    same_points([(e.step, e.value) for e in events.Scalars("loss")], losses)
    assert {"rollout_corr/training_ppl", "reward_mean", "tokens", "time/forward_backward"} <= set(
        events.Tags()["scalars"]
    )
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(version, 0.625)]
    configs = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("config/text_summary")]
    assert [c.split(":")[0] for c in configs] == [
        "config_version 0 (initial) from step 1", "config_version 1 (api) from step 3",
    ]  # fmt: skip
    assert '"lr": 0.0005' in configs[1]
    samples = events.Tensors("samples/text_summary")
    assert [e.step for e in samples] == [0, 1]  # once per policy version
    assert len(samples[0].tensor_proto.string_val[0].decode().splitlines()) == 2 + 3  # header, rule, 3 rows

    # W&B, offline
    (run_file,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    history: dict[str, list[tuple[int, Any]]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for key, value in row.items():
                history.setdefault(key, []).append((r.history.step.num, value))
    same_points(history["loss"], losses)
    assert history["eval/accuracy"] == [(3, 0.625)] and history["eval/policy_version"] == [(3, version)]
    assert "rollout_corr/training_ppl" in history
    tables = sorted((run_file.parent / "files" / "media" / "table").glob("samples_*.table.json"))
    assert [step for step, _ in history["samples/_type"]] == [1, 2]  # versions 0 and 1, once each
    last = json.loads(tables[1].read_text())
    assert last["columns"] == list(SAMPLE_COLUMNS) and [row[0] for row in last["data"]] == [1, 1, 1]
    config_updates = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.config.update}
        for r in records
        if r.WhichOneof("record_type") == "config"
    ]
    sources = [u["config_source"] for u in config_updates if "config_source" in u]
    assert sources == ["initial", "api"]
    assert [u["learner"]["optimizer"]["lr"] for u in config_updates if "learner" in u] == [1e-3, 5e-4]

    # MLflow
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tracking-test").experiment_id])
    assert run.info.run_name == cfg.run_id and run.info.status == "FINISHED"
    loss = client.get_metric_history(run.info.run_id, "loss")
    same_points([(m.step, m.value) for m in loss], losses)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [
        (version, 0.625)
    ]
    assert "rollout_corr/training_ppl" in run.data.metrics
    assert run.data.params["optimizer.lr"] == "0.001"
    artifacts = {
        a.path for folder in ("config", "samples") for a in client.list_artifacts(run.info.run_id, folder)
    }
    assert artifacts == {
        "config/v0000-initial.json", "config/v0001-api.json", "samples/v000000.json", "samples/v000001.json",
    }  # fmt: skip
    table = json.loads(
        Path(client.download_artifacts(run.info.run_id, "samples/v000001.json", str(tmp_path))).read_text()
    )
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert len(table["data"]) == 3 and {row[0] for row in table["data"]} == {1}


def test_a_sink_that_fails_does_not_stop_the_steps(tiny_dir, redis_url, tmp_path, caplog):  # noqa: F811
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the metrics folder should be")
    cfg = config(
        tiny_dir, redis_url, tmp_path, checkpoint={"checkpoint_dir": None},
        metrics_jsonl=str(blocker / "steps.jsonl"), tracking={"tensorboard_dir": str(tmp_path / "tb")},
    )  # fmt: skip
    learner, _ = run_three_steps(cfg)
    assert learner.step_count == STEPS and learner.version == STEPS
    errors = learner.metrics.registry.get_sample_value
    assert errors("offpolicy_learner_tracking_errors_total", {"sink": "jsonl"}) == STEPS
    assert errors("offpolicy_learner_tracking_errors_total", {"sink": "tensorboard"}) == 0
    assert len([r for r in caplog.records if "tracker jsonl failed" in r.message]) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]


def test_a_resumed_learner_logs_its_config_as_resume(tiny_dir, redis_url, tmp_path):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config(
        tiny_dir, redis_url, tmp_path, tracking={"tensorboard_dir": str(tmp_path / "tb")},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 1},
    )  # fmt: skip
    with ReplayBuffer(cfg.redis_url, cfg.run_id, cfg.buffer) as buf:
        buf.insert_many(ragged_groups(2, 2, seed=40, response=(2, 6)))
    first = Learner(cfg, CollectorRegistry())
    try:
        first.step()
    finally:
        first.close()
    Learner(cfg, CollectorRegistry()).close()  # resumes the checkpoint of step 1
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    configs = [
        e.tensor_proto.string_val[0].decode().split(":")[0] for e in events.Tensors("config/text_summary")
    ]
    assert configs == ["config_version 0 (initial) from step 1", "config_version 1 (resume) from step 2"]
