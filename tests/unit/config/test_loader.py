"""`offpolicy.config.loader`: the one layered loader (YAML, then `OFFPOLICY_*` env, then overrides) of the
learner,
the actors and the service settings; text fields take env values as written; `buffer/` stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from offpolicy.actors.config import load_config as load_actor_config
from offpolicy.config.loader import load_layered
from offpolicy.learner.config import load_config as load_learner_config
from offpolicy.services.common.settings import ActorServiceSettings, LearnerServiceSettings, ServiceSettings


def test_text_fields_take_env_values_as_written(tmp_path) -> None:
    path = tmp_path / "learner.yaml"
    path.write_text("model_path: /models/tiny\n")
    env = {
        "OFFPOLICY_RUN_ID": "123456",  # YAML would make it an int, which a str field refuses
        "OFFPOLICY_DEVICE": "cpu",
        "OFFPOLICY_OPTIMIZER__LR": "1e-5",  # YAML 1.1 reads a string; the float field parses it
        "OFFPOLICY_OPTIMIZER__BETAS": "[0.8, 0.9]",
        "OFFPOLICY_PPO_EPOCHS": "2",
        "OFFPOLICY_NORM_ADV_BY_STD_IN_GRPO": "false",
        "OFFPOLICY_METRICS_JSONL": "",
        "OFFPOLICY_ROLLOUT_CORRECTION__ROLLOUT_IS": "token",
        "OFFPOLICY_ROLLOUT_CORRECTION__ROLLOUT_IS_THRESHOLD": "0.5_2",  # YAML would read 0.52
        "OFFPOLICY_API_TOKEN": "not-a-learner-field",
    }
    cfg = load_learner_config(path, env)
    assert (cfg.run_id, cfg.device, cfg.optimizer.lr, cfg.optimizer.betas) == (
        "123456",
        "cpu",
        1e-5,
        (0.8, 0.9),
    )
    assert (cfg.ppo_epochs, cfg.norm_adv_by_std_in_grpo, cfg.metrics_jsonl) == (2, False, None)
    assert cfg.rollout_correction.rollout_is_threshold == "0.5_2"


def test_env_values_obey_the_strict_base() -> None:
    env = {"OFFPOLICY_OPTIMIZER__LR": "inf"}
    with pytest.raises(ValidationError, match="finite"):
        load_learner_config(None, env, model_path="/m")
    with pytest.raises(ValidationError, match="boolean"):
        load_learner_config(None, {"OFFPOLICY_GROUPS_PER_STEP": "true"}, model_path="/m")


def test_the_actor_config_uses_the_same_loader() -> None:
    env = {"OFFPOLICY_ACTOR_ID": "0042", "OFFPOLICY_ENGINE__SEED": "7", "OFFPOLICY_PORT": "9"}
    cfg = load_actor_config(None, env, model_path="/m", dataset={"path": "/d.jsonl"})
    assert (cfg.actor_id, cfg.engine.seed) == ("0042", 7)


def test_service_settings_load_from_the_env_mapping_then_overrides() -> None:
    env = {
        "OFFPOLICY_API_TOKEN": "123456",
        "OFFPOLICY_PORT": "9001",
        "OFFPOLICY_CONFIG_PATH": "/etc/offpolicy/learner.yaml",
        "OFFPOLICY_FATAL_EXIT_GRACE_S": "5",
        "OFFPOLICY_RUN_ID": "not-a-settings-field",
    }
    settings = LearnerServiceSettings.from_env(env, port=9002)
    assert settings.api_token is not None and settings.api_token.get_secret_value() == "123456"
    assert (settings.port, str(settings.config_path), settings.fatal_exit_grace_s) == (
        9002,
        "/etc/offpolicy/learner.yaml",
        5.0,
    )
    assert ActorServiceSettings.from_env({}).port == 8001
    assert ServiceSettings.from_env({}) == ServiceSettings()
    with pytest.raises(ValidationError):
        ServiceSettings.from_env({"OFFPOLICY_REDIS_PING_TIMEOUT_S": "nan"})
    with pytest.raises(ValidationError):
        ServiceSettings.from_env({"OFFPOLICY_MAX_BODY_BYTES": "1.5"})


def test_one_loader_for_everything() -> None:
    assert load_layered(ServiceSettings, None, {"OFFPOLICY_LOG_JSON": "false"}).log_json is False


def test_buffer_imports_neither_torch_nor_fastapi() -> None:
    code = (
        "import sys, offpolicy.buffer.replay_buffer, offpolicy.buffer.config, offpolicy.config.loader\n"
        "import offpolicy.weights.record, offpolicy.weights.manifest, offpolicy.buffer.embedded\n"
        "print(sorted(m for m in ('torch', 'fastapi', 'starlette') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
