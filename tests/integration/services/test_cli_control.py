"""The `offpolicy` control verbs against a live learner service: the real app with the real Learner (tiny
model, embedded Redis) under uvicorn in a thread, reached over HTTP at its URL like from a shell."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
import yaml

from offpolicy.buffer.config import BufferConfig
from offpolicy.buffer.embedded import free_port
from offpolicy.buffer.replay_buffer import ReplayBuffer
from offpolicy.learner.config import LearnerConfig
from offpolicy.services.cli import main
from offpolicy.services.cli.verbs import merge_patch
from offpolicy.services.common.settings import LearnerServiceSettings
from offpolicy.services.learner_api.main import create_app
from tests.integration.services.test_learner import TOKEN, random_group, tiny, wait_for  # noqa: F401

pytestmark = pytest.mark.redis


@pytest.fixture
def learner_url(
    tiny: Path,  # noqa: F811
    redis_url: str,
    run_id: str,
    tmp_path: Path,
) -> Iterator[tuple[str, ReplayBuffer]]:
    buffer_cfg = BufferConfig(max_staleness=4, max_times_sampled=1)
    config = LearnerConfig(
        model_path=str(tiny),
        device="cpu",
        redis_url=redis_url,
        run_id=run_id,
        groups_per_step=2,
        micro_batch_size=8,
        buffer=buffer_cfg,
        sample_timeout_s=0.5,
        publish={"weights_dir": str(tmp_path / "weights")},
        checkpoint={"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": None},
    )
    app = create_app(LearnerServiceSettings(api_token=TOKEN), config=config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name="learner-api")
    thread.start()
    producer = ReplayBuffer(redis_url, run_id, buffer_cfg)
    try:
        wait_for(lambda: server.started or not thread.is_alive())
        assert thread.is_alive(), "the learner service did not start"
        yield f"http://127.0.0.1:{server.config.port}", producer
    finally:
        producer.close()
        server.should_exit = True
        thread.join(60)


class Cli:
    """`offpolicy ...` in this process; (exit code, stdout, stderr) of each call."""

    def __init__(self, url: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.url, self.capsys = url, capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        rc = main([*argv, "--url", self.url])
        out, err = self.capsys.readouterr()
        return rc, out, err

    def json(self, *argv: str) -> dict:
        rc, out, err = self(*argv, "--json")
        assert rc == 0, err
        return json.loads(out)


def feed(producer: ReplayBuffer, cli: Cli, groups: int, seed: int) -> None:
    version = cli.json("status")["policy_version"]
    for i in range(groups):
        producer.insert(random_group(version, seed * 100 + i))


def test_control_verbs_change_what_the_learner_does(learner_url, capsys, monkeypatch, tmp_path):
    url, producer = learner_url
    cli = Cli(url, capsys)
    monkeypatch.delenv("OFFPOLICY_TOKEN", raising=False)
    monkeypatch.delenv("OFFPOLICY_API_TOKEN", raising=False)
    wait_for(lambda: cli.json("status")["state"] != "starting")
    rc, out, _ = cli("status")
    assert rc == 0 and out.startswith("state ")

    # changes need the token (401, exit 2); a wrong token is never printed
    rc, out, err = cli("config", "set", "optimizer.lr=1e-3")
    assert (rc, err.strip()) == (
        2,
        "error 401 unauthorized: this route needs an `Authorization: Bearer <token>` header",
    )
    rc, out, err = cli("pause", "--token", "wrong-secret-123")
    assert rc == 2 and "401 unauthorized" in err and "wrong-secret-123" not in out + err

    # steps run with the start-up learning rate
    feed(producer, cli, 2, seed=1)
    wait_for(lambda: cli.json("status")["step"] >= 1)
    assert cli.json("status")["last_step"]["lr"] == pytest.approx(1e-6)

    # validate: errors with field paths, nothing applied; a good patch passes
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"optimizer": {"lr": -1.0}, "clip_ratio_low": 1.5}))
    rc, out, err = cli("config", "validate", str(bad), "--merge")
    assert rc == 2
    assert err.splitlines() == [
        "error 422 validation_error: body.clip_ratio_low: Input should be less than 1",
        "error 422 validation_error: body.optimizer.lr: Input should be greater than 0",
    ]
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"optimizer": {"lr": 1e-3}}))
    rc, out, _ = cli("config", "validate", str(good), "--merge")
    assert (rc, out.strip()) == (0, "valid (merge); it would change: optimizer.lr")
    assert cli.json("config", "get")["config_version"] == 0

    # set (token from OFFPOLICY_API_TOKEN): one PATCH, applied at the next step boundary
    monkeypatch.setenv("OFFPOLICY_API_TOKEN", TOKEN)
    rc, out, err = cli("config", "set", "optimizer.lr=1e-3", "clip_ratio_high=0.28")
    assert (rc, out.strip()) == (0, "config_version 1 pending: changed clip_ratio_high, optimizer.lr"), err
    feed(producer, cli, 4, seed=2)
    wait_for(lambda: cli.json("config", "get")["config_version"] == 1)
    boundary = cli.json("config", "get")["applied_at_step"]
    wait_for(lambda: cli.json("status")["step"] > boundary)
    assert cli.json("status")["last_step"]["lr"] == pytest.approx(1e-3)  # the learner trains with it
    assert cli("config", "get", "optimizer.lr")[1].strip() == "0.001"
    assert cli.json("config", "get", "clip_ratio_high") == 0.28
    assert cli("config", "get", "checkpoint.checkpoint_every")[1].strip() == "null"
    rc, _, err = cli("config", "get", "optimizer.nope")
    assert (rc, err.strip()) == (2, "config get: no key 'optimizer.nope' in the running config")

    # refused changes: a frozen field (409), a malformed assignment (nothing sent)
    rc, _, err = cli("config", "set", "model_path=/elsewhere")
    assert (rc, err.strip()) == (
        2,
        "error 409 field_frozen: cannot change while running: model_path",
    )
    rc, _, err = cli("config", "set", "optimizer.lr")
    assert rc == 2 and err.startswith("config set: 'optimizer.lr' is not KEY=VALUE")

    # history lists the change
    history = cli.json("config", "history")["entries"]
    assert [(e["config_version"], e["source"]) for e in history] == [(0, "initial"), (1, "patch")]
    rc, out, _ = cli("config", "history")
    assert out.splitlines()[0].split() == [
        "version",
        "source",
        "submitted",
        "(UTC)",
        "applied_at_step",
        "changed",
    ]
    assert out.splitlines()[2].split()[:2] == ["1", "patch"] and "optimizer.lr" in out

    # pause / resume change the state
    rc, out, _ = cli("pause")
    assert rc == 0 and out.startswith("state paused")
    assert cli.json("status")["state"] == "paused"
    assert cli.json("resume")["state"] in ("running", "waiting_for_data")

    # checkpoint writes one (no step in flight)
    wait_for(lambda: (s := cli.json("status"))["state"] == "waiting_for_data" and s["buffer"]["size"] == 0)
    ckpt = cli.json("checkpoint")
    assert Path(ckpt["path"]).exists()

    # apply: the whole config from a file (GET, edit, PUT)
    whole = cli.json("config", "get")["config"] | {"clip_ratio_low": 0.1}
    (tmp_path / "whole.yaml").write_text(yaml.safe_dump(whole))
    rc, out, _ = cli("config", "apply", str(tmp_path / "whole.yaml"))
    assert (rc, out.strip()) == (0, "config_version 2 pending: changed clip_ratio_low")

    # dead letters; a limit outside 1..1000 is refused by field
    assert cli.json("dead-letters", "--limit", "5") == {"entries": []}
    rc, out, err = cli("dead-letters", "--limit", "0")
    assert rc == 2 and err.startswith("error 422 validation_error: query.limit: ")
    rc, out, err = cli("dead-letters", "--limit", "0", "--json")
    assert rc == 2 and json.loads(out)["error"]["detail"][0]["field"] == "query.limit"


def test_unreachable_learner_exits_1(capsys):
    rc, _, err = Cli(f"http://127.0.0.1:{free_port()}", capsys)("status")
    assert rc == 1 and err.startswith("error: the learner at http://127.0.0.1:")


def test_set_builds_one_merge_patch():
    assert merge_patch(["optimizer.lr=1e-5", "optimizer.betas=[0.9, 0.99]", "rollout_correction=tis"]) == {
        "optimizer": {"lr": 1e-5, "betas": [0.9, 0.99]},
        "rollout_correction": "tis",
    }
    assert merge_patch(["metrics_jsonl=", "checkpoint.checkpoint_every=null"]) == {
        "metrics_jsonl": None,
        "checkpoint": {"checkpoint_every": None},
    }
