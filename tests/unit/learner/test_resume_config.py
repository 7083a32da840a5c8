"""`resumed_config`: which config a resumed learner runs (learner/config/resume.py)."""

from __future__ import annotations

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.resume import resumed_config


def _file(**kw) -> LearnerConfig:
    base = {"model_path": "/models/a", "redis_url": "redis://:secret@redis:6379/0", "optimizer": {"lr": 1e-4}}
    return LearnerConfig.model_validate(base | kw)


def _meta(config: LearnerConfig, version: int = 3) -> dict:
    saved = config.model_dump(mode="json") | {
        "redis_url": "redis://:****@redis:6379/0"
    }  # as checkpoints save it
    return {"config": saved, "config_version": version}


def test_the_checkpoint_wins_for_changeable_fields_and_the_file_for_frozen_ones() -> None:
    saved = _file(optimizer={"lr": 5e-3}, rollout_correction="decoupled_seq_is", model_path="/old/place")
    file = _file(publish={"weights_dir": "/new/weights"})
    out = resumed_config(file, _meta(saved))
    assert out.config.optimizer.lr == 5e-3 and out.config.rollout_correction.rollout_is == "sequence"
    assert out.config.model_path == "/models/a"  # frozen: where this process runs
    assert out.config.publish.weights_dir == "/new/weights"
    assert out.config.redis_url == file.redis_url  # never the redacted one
    assert out.saved_version == 3
    assert out.disagreeing == ["optimizer.lr", "rollout_correction.rollout_is"]
    assert "checkpoint.resume_config: checkpoint" in out.detail
    # each key with both values, and how to choose the other way
    assert "optimizer.lr (file 0.0001, checkpoint 0.005)" in out.detail
    assert "rollout_correction.rollout_is (file None, checkpoint 'sequence')" in out.detail
    assert "restart with checkpoint.resume_config: file, or PATCH them now" in out.detail


def test_the_file_wins_when_told() -> None:
    saved = _file(optimizer={"lr": 5e-3})
    file = _file(checkpoint={"resume_config": "file"})
    out = resumed_config(file, _meta(saved))
    assert out.config == file
    assert out.disagreeing == ["optimizer.lr"] and "checkpoint.resume_config: file" in out.detail
    assert "optimizer.lr (file 0.0001, checkpoint 0.005)" in out.detail
    assert "restart with checkpoint.resume_config: checkpoint" in out.detail


def test_the_rule_itself_is_always_the_files() -> None:
    saved = _file(optimizer={"lr": 5e-3}, checkpoint={"resume_config": "file"})
    out = resumed_config(_file(), _meta(saved))
    assert out.config.optimizer.lr == 5e-3 and out.config.checkpoint.resume_config == "checkpoint"


def test_a_checkpointed_config_that_no_longer_validates_is_reported_and_the_file_used() -> None:
    meta = _meta(_file(optimizer={"lr": 5e-3}))
    meta["config"]["optimizer"]["renamed_knob"] = 1
    out = resumed_config(_file(), meta)
    assert out.config == _file() and "optimizer.renamed_knob" in out.detail


def test_a_critic_cannot_appear_at_resume() -> None:
    out = resumed_config(_file(), _meta(_file(adv_estimator="gae")))
    assert out.config.adv_estimator == "grpo" and "critic" in out.detail


def test_agreement_and_old_checkpoints() -> None:
    assert resumed_config(_file(), _meta(_file())).disagreeing == []
    assert resumed_config(_file(), {}).config == _file()


def test_where_the_metrics_go_is_the_files_not_the_checkpoints() -> None:
    saved = _file(optimizer={"lr": 5e-3}, metrics_jsonl="/old/run/metrics.jsonl")
    out = resumed_config(_file(metrics_jsonl="/this/run/metrics.jsonl"), _meta(saved))
    assert out.config.metrics_jsonl == "/this/run/metrics.jsonl" and out.config.optimizer.lr == 5e-3
    assert out.disagreeing == ["optimizer.lr"]
