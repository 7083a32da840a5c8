"""LearnerConfig: validation, presets by name, YAML + OFFPOLICY_ env loading, frozen-while-running fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from offpolicy.learner.config import (
    LearnerConfig,
    OptimizerConfig,
    env_overrides,
    frozen_field_changes,
    frozen_field_paths,
    load_config,
)
from offpolicy.learner.correction.config import RolloutCorrectionConfig

CONFIGS = Path(__file__).resolve().parents[4] / "configs"


def test_every_example_config_loads():
    names = [
        "learner.yaml",
        *sorted(p.name for p in CONFIGS.glob("seed_*.yaml")),
    ]  # actor.yaml is the actor's
    assert {"seed_1_rloo_seq_is.yaml", "seed_3_gae_ppo.yaml"} <= set(names)
    for name in names:
        assert isinstance(load_config(CONFIGS / name), LearnerConfig)


def test_seed_readme_configurations_as_written():
    c1 = load_config(CONFIGS / "seed_1_rloo_seq_is.yaml")
    assert (c1.adv_estimator, c1.ppo_epochs) == ("rloo", 1)
    assert c1.rollout_correction == RolloutCorrectionConfig(
        rollout_is="sequence", rollout_is_batch_normalize=True, bypass_mode=True, loss_type="reinforce"
    )
    c2 = load_config(CONFIGS / "seed_2_grpo_token_is_multi_rs.yaml")
    assert c2.rollout_correction.rollout_rs == "token_k1,seq_max_k2"
    assert c2.rollout_correction.rollout_rs_threshold == "0.6_1.6,2.5"
    c3 = load_config(CONFIGS / "seed_3_gae_ppo.yaml")
    assert (c3.adv_estimator, c3.ppo_epochs, c3.gamma, c3.lam) == ("gae", 4, 0.99, 0.95)
    assert c3.rollout_correction.bypass_mode is False
    assert c3.optimizer_steps_per_step == 4
    c4 = load_config(CONFIGS / "seed_4_rs_only.yaml")
    assert c4.rollout_correction.rollout_is is None


def test_preset_name_is_accepted_for_rollout_correction():
    c = LearnerConfig(model_path="m", rollout_correction="decoupled_token_is")
    assert c.rollout_correction == RolloutCorrectionConfig.decoupled_token_is()
    alias = LearnerConfig(model_path="m", rollout_correction="pg_is")
    assert alias.rollout_correction == RolloutCorrectionConfig.bypass_pg_is()
    with pytest.raises((ValidationError, KeyError)):
        LearnerConfig(model_path="m", rollout_correction="no_such_preset")


def test_cross_field_checks_name_the_values():
    with pytest.raises(ValidationError, match="mini_batch_groups=3 must divide groups_per_step=8"):
        LearnerConfig(model_path="m", groups_per_step=8, mini_batch_groups=3)
    with pytest.raises(ValidationError, match="decay='cosine' needs decay_steps"):
        OptimizerConfig(decay="cosine")
    with pytest.raises(ValidationError, match="extra"):
        LearnerConfig(model_path="m", learning_rate=1.0)
    with pytest.raises(ValidationError):
        LearnerConfig(model_path="m", clip_ratio_c=1.0)


def test_optimizer_steps_per_step():
    c = LearnerConfig(model_path="m", groups_per_step=8, mini_batch_groups=2, ppo_epochs=3)
    assert c.optimizer_steps_per_step == 12


def test_env_overrides_nest_and_parse():
    env = {"OFFPOLICY_OPTIMIZER__LR": "1e-5", "OFFPOLICY_PPO_EPOCHS": "2", "OTHER": "x"}
    assert env_overrides(env) == {"optimizer": {"lr": "1e-5"}, "ppo_epochs": 2}


def test_load_config_layers_yaml_env_kwargs(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_path: a\nppo_epochs: 2\noptimizer: {lr: 0.001, warmup_steps: 3}\n")
    env = {
        "OFFPOLICY_OPTIMIZER__LR": "0.01",
        "OFFPOLICY_ROLLOUT_CORRECTION": "bypass_ppo_clip",
        "OFFPOLICY_API_TOKEN": "not-ours",
    }
    c = load_config(path, env, groups_per_step=4)
    assert (c.model_path, c.ppo_epochs, c.groups_per_step) == ("a", 2, 4)
    assert (c.optimizer.lr, c.optimizer.warmup_steps) == (0.01, 3)
    assert c.rollout_correction.bypass_mode is True
    assert load_config(path).optimizer.lr == 0.001  # nothing read unless passed


def test_frozen_fields_and_changes():
    assert {"model_path", "device", "redis_url", "run_id", "publish.weights_dir"} <= set(frozen_field_paths())
    old = LearnerConfig(model_path="a")
    new = old.model_copy(update={"model_path": "b", "ppo_epochs": 3})
    assert frozen_field_changes(old, new) == ["model_path"]
    assert frozen_field_changes(old, LearnerConfig(model_path="a", adv_estimator="gae")) == ["adv_estimator"]
    assert frozen_field_changes(old, LearnerConfig(model_path="a", groups_per_step=2)) == []


def test_schema_marks_frozen_fields():
    props = LearnerConfig.model_json_schema()["properties"]
    assert props["model_path"]["frozen_while_running"] is True
    assert "frozen_while_running" not in props["ppo_epochs"]


def test_torch_threads_is_optional_positive_and_frozen_while_running():
    assert LearnerConfig(model_path="a").torch_threads is None
    assert LearnerConfig(model_path="a", torch_threads=1).torch_threads == 1
    with pytest.raises(ValidationError, match="torch_threads"):
        LearnerConfig(model_path="a", torch_threads=0)
    assert "torch_threads" in frozen_field_paths()


def test_the_speed_settings_take_auto_and_name_the_field_they_refuse():
    cfg = LearnerConfig(
        model_path="m", gradient_checkpointing="auto", micro_batch_tokens="auto",
        no_grad_micro_batch_tokens="auto", logprob_head="chunked", attn_implementation="torch_varlen",
    )  # fmt: skip
    assert (cfg.micro_batch_tokens, cfg.gradient_checkpointing) == ("auto", "auto")
    assert LearnerConfig(model_path="m").micro_batch_tokens == 16384  # the earlier values stay valid
    for field, value in (
        ("micro_batch_tokens", 0),
        ("micro_batch_tokens", "big"),
        ("no_grad_micro_batch_tokens", -1),
        ("gradient_checkpointing", "sometimes"),
        ("logprob_head", "liger"),
    ):
        with pytest.raises(ValidationError, match=field):
            LearnerConfig(model_path="m", **{field: value})
