"""`offpolicy runs list|add|update|remove` against a live actor service (the real app under uvicorn in a
thread, on a pool of fake actors and a stub engine), reached at its URL like from a shell."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
import yaml

from offpolicy.buffer.embedded import free_port
from offpolicy.services.cli import main
from tests.unit.services.actor_api.test_runs import app_for, run_body


@pytest.fixture
def actor_url() -> Iterator[str]:
    app, _ = app_for()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name="actor-api")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive():
            assert time.monotonic() < deadline, "the actor service did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_runs_verbs(actor_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    def cli(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main(["runs", *argv, "--actor-url", actor_url])
        out, err = capsys.readouterr()
        return rc, out, err.splitlines()[-1] if err else ""  # the verb's line (another test's log handler
        # may report here that its stream is closed)

    config = tmp_path / "run-b.yaml"
    config.write_text(yaml.safe_dump(run_body("b", max_inflight_prompts=3)))
    rc, _, err = cli("add", str(config))
    assert rc == 2 and "error 401 unauthorized" in err
    monkeypatch.setenv("OFFPOLICY_API_TOKEN", "tok")
    rc, out, _ = cli("add", str(config))
    assert (rc, out.strip()) == (0, "run b added: running, share 3 prompts")
    rc, _, err = cli("add", str(config))
    assert rc == 2 and err.startswith("error 409 run_conflict: run 'b' is already served")
    rc, out, _ = cli("list")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:2] == ["run_id", "state"]
    assert [line.split()[:2] for line in lines[1:]] == [["a", "running"], ["b", "running"]]
    rc, out, _ = cli("update", "b", "max_inflight_prompts=5", "sampling.temperature=0.5")
    assert (rc, out.strip()) == (0, "run b updated: share 5 prompts")
    rc, _, err = cli("update", "b", "sampling.temperature=-1")
    assert (rc, err) == (2, "error 422 validation_error: body.sampling.temperature: Input should be "
                                 "greater than 0")  # fmt: skip
    rc, out, _ = cli("remove", "b", "--json")
    assert rc == 0 and json.loads(out)["state"] == "removed"
    rc, _, err = cli("remove", "b")
    assert rc == 2 and "error 404 run_not_found" in err
    capsys.readouterr()
    assert main(["runs", "list", "--actor-url", "http://127.0.0.1:1"]) == 1
    assert "the actor at http://127.0.0.1:1 cannot be reached" in capsys.readouterr().err
