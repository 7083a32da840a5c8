"""The gateway's HTTP routes on the actor service, against a scripted engine: the bearer token, the error
envelope of each refusal (404 disabled or unknown, 409 a rewritten turn, 422 with the field), and a
recorded episode from open to finish."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient

from offpolicy.services.actor_api.main import create_app
from offpolicy.services.common.settings import ActorServiceSettings
from tests.unit.actors.gateway.test_agent_episodes import StubActor
from tests.unit.actors.rollout.fakes import StubEngine

AUTH = {"Authorization": "Bearer tok"}


class ServedActor(StubActor):
    """A stub actor the service can host: its loop waits for the stop event."""

    def __init__(self, config: Any, registry: Any, script: list[str]) -> None:
        super().__init__(script, group_size=1)
        self.config = config
        from offpolicy.actors.gateway.agent_episodes import Gateway

        self.gateway = Gateway(self)

    def run(self, stop_event: threading.Event) -> None:
        stop_event.wait()

    def status(self) -> dict[str, Any]:
        return {"state": "running", "actor_id": "a0", "loaded_policy_version": 7, "learner_policy_version": 7,
                "tokens_per_s": None, "groups_pushed": len(self.pushed), "reloads": 0}  # fmt: skip

    def close(self) -> None:
        pass


def app_for(enabled: bool, script: list[str], token: str = "tok") -> Any:
    config = StubActor([], group_size=1).config.model_copy(
        update={"gateway": StubActor([], group_size=1).config.gateway.model_copy(update={"enabled": enabled})}
    )
    return create_app(
        ActorServiceSettings(api_token=token),
        config=config,
        actor_factory=lambda c, r, e: ServedActor(c, r, script),
        engine=StubEngine(),
    )


def test_routes_need_the_token_and_refuse_with_the_envelope() -> None:
    app = app_for(True, ["hello", "there"])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as http:
        assert http.post("/v1/episodes", json={"prompt_id": "p"}).status_code == 401
        assert http.post("/v1/chat/completions", json=chat).status_code == 401
        eid = http.post("/v1/episodes", json={"prompt_id": "p"}, headers=AUTH).json()["episode_id"]
        ep = {**AUTH, "X-Episode-Id": eid}
        r = http.post("/v1/chat/completions", json={**chat, "temperature": 1.5}, headers=ep)
        assert r.status_code == 422 and r.json()["error"]["detail"][0]["field"] == "body.temperature"
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": "nope"}, headers=ep)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
        r = http.post("/v1/chat/completions", json=chat, headers=ep)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello"
        rewritten = [{"role": "assistant", "content": "HELLO"}, {"role": "user", "content": "?"}]
        bad = {**chat, "messages": [*chat["messages"], *rewritten]}
        r = http.post("/v1/chat/completions", json=bad, headers=ep)
        assert r.status_code == 409 and r.json()["error"]["code"] == "episode_conflict"
        assert r.headers["x-should-retry"] == "false"  # every 409: the openai client does not retry it
        r = http.post("/v1/chat/completions", json=chat, headers={**AUTH, "X-Episode-Id": "abc"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "episode_not_found"
        r = http.post(f"/v1/episodes/{eid}/finish", json={"reward": 0.5}, headers=AUTH)
        assert r.json() == {"episode_id": eid, "group_id": r.json()["group_id"], "group_complete": True}
        assert http.get("/v1/status").json()["groups_pushed"] == 1
        assert http.post(f"/v1/episodes/{eid}/finish", json={}, headers=AUTH).status_code == 404
        bad_reward = http.post(f"/v1/episodes/{eid}/finish", content=b'{"reward": NaN}', headers=AUTH)
        assert bad_reward.status_code == 422


def test_the_gateway_has_its_own_token_and_refuses_the_admin_one() -> None:
    """With OFFPOLICY_GATEWAY_TOKEN the gateway's routes take it and refuse the learner's admin token; no
    response shows either."""
    config = StubActor([], group_size=1).config
    config = config.model_copy(update={"gateway": config.gateway.model_copy(update={"enabled": True})})
    settings = ActorServiceSettings(api_token="admin-secret", gateway_token="agent-secret")
    app = create_app(
        settings, config=config, actor_factory=lambda c, r, e: ServedActor(c, r, ["hi"]), engine=StubEngine()
    )
    with TestClient(app) as http:
        admin = {"Authorization": "Bearer admin-secret"}
        r = http.post("/v1/episodes", json={"prompt_id": "p"}, headers=admin)
        assert r.status_code == 401 and "admin-secret" not in r.text
        agent = {"Authorization": "Bearer agent-secret"}
        eid = http.post("/v1/episodes", json={"prompt_id": "p"}, headers=agent).json()["episode_id"]
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = http.post("/v1/chat/completions", json=chat, headers={**agent, "X-Episode-Id": eid})
        assert r.status_code == 200 and "agent-secret" not in r.text
    env = ActorServiceSettings.from_env({"OFFPOLICY_GATEWAY_TOKEN": "g", "OFFPOLICY_API_TOKEN": "a"})
    assert env.gateway_token.get_secret_value() == "g" and env.api_token.get_secret_value() == "a"


def test_a_disabled_gateway_answers_404() -> None:
    with TestClient(app_for(False, [])) as http:
        r = http.post("/v1/episodes", json={"prompt_id": "p"}, headers=AUTH)
        assert r.status_code == 404 and "gateway.enabled" in r.json()["error"]["message"]


def test_an_openai_client_gets_4xx_for_bad_input_and_the_episode_stays_usable() -> None:
    """The `openai` client against the real app: `stop: [""]` and `max_tokens` <= 0 answer 422 naming the
    field, a message past the budget 409 with `x-should-retry: false` (the client does not retry it); the
    episode records none of them and the corrected call goes on from where it was."""
    from openai import ConflictError, OpenAI, UnprocessableEntityError

    app = app_for(True, ["hello", "ok"], token="s3cret")  # not "tok": the envelope scrubs the token
    auth = {"Authorization": "Bearer s3cret"}
    with TestClient(app) as http:
        sent: list[str] = []
        http.event_hooks = {"request": [lambda r: sent.append(r.url.path)], "response": []}
        client = OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=http, max_retries=2)
        eid = http.post("/v1/episodes", json={"prompt_id": "p"}, headers=auth).json()["episode_id"]
        ep = {"X-Episode-Id": eid}
        first = [{"role": "user", "content": "hi"}]
        for extra, field in (
            ({"stop": [""]}, "body.stop"),
            ({"max_tokens": -1}, "body.max_tokens"),
            ({"max_tokens": 0}, "body.max_tokens"),
        ):
            with pytest.raises(UnprocessableEntityError) as e:
                client.chat.completions.create(model="m", messages=first, extra_headers=ep, **extra)
            assert e.value.response.json()["error"]["detail"][0]["field"] == field
        r = client.chat.completions.create(model="m", messages=first, extra_headers=ep)
        assert r.choices[0].message.content == "hello"
        messages = [*first, r.choices[0].message.model_dump(exclude_none=True)]
        sent.clear()
        with pytest.raises(ConflictError) as e:
            long = [*messages, {"role": "user", "content": "x" * 300}]
            client.chat.completions.create(model="m", messages=long, extra_headers=ep)
        assert e.value.response.headers["x-should-retry"] == "false" and len(sent) == 1  # not retried
        assert e.value.response.json()["error"]["code"] == "episode_budget_exceeded"
        r = client.chat.completions.create(
            model="m", messages=[*messages, {"role": "user", "content": "?"}], extra_headers=ep
        )
        assert r.choices[0].message.content == "ok"
        done = http.post(f"/v1/episodes/{eid}/finish", json={"reward": 1.0}, headers=auth).json()
        assert done["group_complete"] and http.get("/v1/status").json()["groups_pushed"] == 1
