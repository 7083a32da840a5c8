"""ActorConfig: frozen, extra=forbid, cross-field checks with values, YAML + OFFPOLICY_ env loading."""

from __future__ import annotations

import pydantic
import pytest
import yaml

from offpolicy.actors.config import ActorConfig, EngineConfig, SamplingConfig, load_config


def _base() -> dict:
    return {"model_path": "/m", "dataset": {"path": "/d.jsonl"}}


def test_defaults_and_frozen():
    cfg = ActorConfig.model_validate(_base())
    assert cfg.resolved_actor_id == "actor-0"
    assert cfg.sampling.temperature == 1.0 and cfg.sampling.top_k == -1
    with pytest.raises(pydantic.ValidationError):
        cfg.run_id = "x"


def test_extra_fields_are_rejected():
    with pytest.raises(pydantic.ValidationError, match="extra"):
        ActorConfig.model_validate(_base() | {"bogus": 1})
    with pytest.raises(pydantic.ValidationError, match="extra"):
        ActorConfig.model_validate(_base() | {"sampling": {"temp": 0.7}})


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"actor_index": 2, "num_actors": 2}, "actor_index=2 must be < num_actors=2"),
        ({"sampling": {"max_tokens": 4096}}, "max_tokens=4096 leaves no room"),
        ({"sampling": {"top_k": 0}}, "top_k = 0"),
        ({"sampling": {"temperature": 0.0}}, "greater than 0"),
        ({"retry": {"initial_s": 5, "max_s": 1}}, "max_s=1.0 < retry.initial_s=5.0"),
    ],
)
def test_cross_field_checks_name_the_values(over, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ActorConfig.model_validate(_base() | over)


def test_yaml_then_env_then_kwargs(tmp_path):
    path = tmp_path / "actor.yaml"
    path.write_text(yaml.safe_dump(_base() | {"sampling": {"temperature": 0.5, "n": 2}, "run_id": "r1"}))
    env = {
        "OFFPOLICY_SAMPLING__TEMPERATURE": "0.7",
        "OFFPOLICY_ENGINE__DTYPE": "float32",
        "OFFPOLICY_API_TOKEN": "not mine",  # another component's variable: ignored
        "UNRELATED": "1",
    }
    cfg = load_config(path, env, actor_index=1, num_actors=2)
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.n == 2
    assert cfg.engine.dtype == "float32" and cfg.model_path == "/m"
    assert (cfg.run_id, cfg.actor_index, cfg.resolved_actor_id) == ("r1", 1, "actor-1")


def test_load_config_without_environ_reads_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_RUN_ID", "from-env")
    path = tmp_path / "a.yaml"
    path.write_text(yaml.safe_dump(_base()))
    assert load_config(path).run_id == "default"


def test_presets():
    eng = EngineConfig.cpu_tiny()
    assert (eng.dtype, eng.enforce_eager, eng.cpu_kv_cache_gib, eng.max_model_len) == (
        "float32",
        True,
        1.0,
        512,
    )
    cfg = ActorConfig.cpu_tiny("/m", "/d.jsonl", run_id="r")
    assert cfg.reward.name == "target_token_share" and cfg.sampling == SamplingConfig(
        temperature=0.7, max_tokens=32, n=4
    )


def test_engine_lora_is_checked_at_construction():
    cfg = ActorConfig.model_validate(_base() | {"engine": {"lora": {}}})
    assert (cfg.engine.lora.max_rank, cfg.engine.lora.max_loras, cfg.engine.lora.max_cpu_loras) == (16, 2, 4)
    assert ActorConfig.model_validate(_base()).engine.lora is None  # full weights by default
    with pytest.raises(pydantic.ValidationError, match="max_rank"):  # the ranks vLLM accepts
        ActorConfig.model_validate(_base() | {"engine": {"lora": {"max_rank": 24}}})
    with pytest.raises(pydantic.ValidationError, match="max_cpu_loras=2 < max_loras=3"):
        ActorConfig.model_validate(_base() | {"engine": {"lora": {"max_loras": 3, "max_cpu_loras": 2}}})
    with pytest.raises(pydantic.ValidationError, match=r"reload\.transport='vllm'"):
        ActorConfig.model_validate(
            _base() | {"engine": {"lora": {}}, "reload": {"transport": "vllm", "mode": "inflight"}}
        )


# --- runs: several runs on one engine (an actor pool)

_LORA = {"lora": {"max_rank": 8, "max_loras": 4, "max_cpu_loras": 8}}


def _pool(*runs: dict, engine: dict | None = None) -> dict:
    return _base() | {"run_id": "a", "engine": _LORA if engine is None else engine, "runs": list(runs)}


def test_a_runs_model_path_and_engine_are_the_pools(tmp_path):
    path = tmp_path / "actor.yaml"
    path.write_text(yaml.safe_dump(_pool({"run_id": "b", "dataset": {"path": "/b.jsonl"}})))
    cfg = load_config(path, {})
    (b,) = cfg.runs
    assert (b.run_id, b.model_path, b.engine, b.dataset.path) == ("b", "/m", cfg.engine, "/b.jsonl")
    assert b.sampling == SamplingConfig()  # its own defaults, not the first run's
    assert cfg.run_config.runs == () and cfg.run_config.run_id == "a"


def test_a_run_reads_the_pools_redis_unless_it_names_its_own(tmp_path):
    """OFFPOLICY_REDIS_URL (the password is in it) sets the pool's first run; the runs take it."""
    path = tmp_path / "actor.yaml"
    runs = ({"run_id": "b", "dataset": {"path": "/b"}}, {"run_id": "c", "dataset": {"path": "/c"},
                                                         "redis_url": "redis://other:6379/2"})  # fmt: skip
    path.write_text(yaml.safe_dump(_pool(*runs)))
    cfg = load_config(path, {"OFFPOLICY_REDIS_URL": "redis://:s3cret@redis:6379/1"})
    assert [r.redis_url for r in (cfg, *cfg.runs)] == [
        "redis://:s3cret@redis:6379/1", "redis://:s3cret@redis:6379/1", "redis://other:6379/2",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("runs", "engine", "match"),
    [
        ([{"run_id": "b", "dataset": {"path": "/b"}}], {}, r"runs\.0: this actor pool serves full weights"),
        ([{"run_id": "a", "dataset": {"path": "/b"}}], None, r"runs\.0: run 'a' is already served"),
        ([{"run_id": "b", "dataset": {"path": "/b"}, "model_path": "/other"}], None, "not this pool's base"),
        (
            [{"run_id": "b", "dataset": {"path": "/b"}, "engine": {}}],
            None,
            "full-weight and adapter runs cannot share a pool",
        ),
        (
            [{"run_id": "b", "dataset": {"path": "/b"}, "engine": {**_LORA, "seed": 3}}],
            None,
            r"engine\.seed differ from this pool's engine",
        ),
        (
            [{"run_id": r, "dataset": {"path": "/b"}} for r in "bcde"],
            None,
            r"runs\.3: 5 runs need 2 adapters each .*max_cpu_loras=8: set max_cpu_loras >= 10",
        ),
        (
            [{"run_id": r, "dataset": {"path": "/b"}} for r in "bc"],
            {"lora": {"max_loras": 2, "max_cpu_loras": 8}},
            r"3 runs, but engine.lora.max_loras=2 .* set max_loras >= 3",
        ),
        (
            [{"run_id": "b", "dataset": {"path": "/b"}, "reload": {"transport": "vllm"}}],
            None,
            r"runs\.0\n.*reload.transport: files",
        ),
        (
            [{"run_id": "b", "dataset": {"path": "/b"}, "runs": [{"run_id": "c", "dataset": {"path": "/"}}]}],
            None,
            "has no `runs` of its own",
        ),
    ],
)
def test_runs_that_cannot_share_the_pool_are_refused_with_the_fix(runs, engine, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ActorConfig.model_validate(_pool(*runs, engine=engine))


def test_a_full_weight_actor_is_one_run_as_before():
    cfg = ActorConfig.model_validate(_base() | {"reload": {"transport": "vllm"}})
    assert cfg.runs == () and cfg.run_config == cfg
