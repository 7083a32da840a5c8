"""Python clients of the services, with typed errors: the learner's control API and the ingest of groups
(`LearnerClient`), an actor pool's runs (`ActorClient`).

    from offpolicy.services.client import LearnerClient
    with LearnerClient("http://learner:8000", token=os.environ["OFFPOLICY_API_TOKEN"]) as learner:
        learner.push_groups(groups)       # TrajectoryGroup objects, or JSON documents
        learner.patch_config({"optimizer": {"lr": 5e-7}})
        print(learner.status()["policy_version"])
    with ActorClient("http://actor:8001", token=...) as actor:
        actor.add_run(yaml.safe_load(open("run-b.yaml")))

Every error the service answers (`{"error": {"code", "message", "detail"}}`) is raised as a `ClientError`
subclass chosen by its status: `Unauthorized` (401), `NotFound` (404), `Conflict` (409), `Invalid` (422),
`RateLimited` (429), `Unavailable` (503); anything else as `ClientError`. A service that cannot be
reached (refused connection, unknown host, timeout) raises `Unreachable`. The token is sent as a bearer
header and never appears in an error's text.
"""

from __future__ import annotations

from typing import Any, Self
from urllib.parse import quote

import httpx

from offpolicy.buffer.json_records import group_to_json
from offpolicy.buffer.types import InsertResult, TrajectoryGroup


class ClientError(Exception):
    """An error answer of the service: HTTP `status`, the error `code`, `message` and `detail`."""

    def __init__(self, status: int, code: str, message: str, detail: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.detail = status, code, message, detail


class Unauthorized(ClientError):
    """401: the bearer token is missing or wrong."""


class NotFound(ClientError):
    """404."""


class Conflict(ClientError):
    """409: a frozen field, disabled checkpoints, another run's checkpoint."""


class Invalid(ClientError):
    """422: the request failed validation (`detail` names the fields)."""


class RateLimited(ClientError):
    """429: the buffer's rate limiter refused; retry later."""


class Unavailable(ClientError):
    """503: the learner is starting, or Redis is unreachable; retry later."""


class Unreachable(Exception):
    """No answer from the service at all: the connection was refused or timed out, or the host is unknown."""


_BY_STATUS = {
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
    422: Invalid,
    429: RateLimited,
    503: Unavailable,
}


class ServiceClient:
    """A service at `base_url` (its error envelope as typed errors); `http` replaces the HTTP client (a
    test's `TestClient`)."""

    what = "the service"
    """How messages name it."""

    def __init__(
        self,
        base_url: str = "",
        token: str | None = None,
        timeout_s: float = 30.0,
        http: httpx.Client | None = None,
    ) -> None:
        self._http = http if http is not None else httpx.Client(base_url=base_url, timeout=timeout_s)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")

    # --- plumbing

    def _call(self, method: str, path: str, json: Any = None, params: Any = None) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, json=json, params=params, headers=self._headers)
        except httpx.TransportError as exc:  # the request text never holds the token: headers are not shown
            raise Unreachable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                error = {"code": "http_error", "message": response.text[:500]}
            cls = _BY_STATUS.get(response.status_code, ClientError)
            raise cls(
                response.status_code, error.get("code", ""), error.get("message", ""), error.get("detail")
            )
        return response.json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LearnerClient(ServiceClient):
    """The learner service: its control API and the ingest of groups."""

    what = "the learner"

    # --- control

    def pause(self) -> dict[str, Any]:
        return self._call("POST", "/v1/pause")

    def resume(self) -> dict[str, Any]:
        return self._call("POST", "/v1/resume")

    def checkpoint(self) -> dict[str, Any]:
        return self._call("POST", "/v1/checkpoints")

    def dead_letters(self, limit: int = 100) -> dict[str, Any]:
        return self._call("GET", "/v1/dead_letters", params={"limit": limit})

    # --- config

    def config(self) -> dict[str, Any]:
        return self._call("GET", "/v1/config")

    def config_history(self) -> dict[str, Any]:
        return self._call("GET", "/v1/config/history")

    def patch_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", "/v1/config", json=changes)

    def put_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Replace the whole config (fields left out take their defaults)."""
        return self._call("PUT", "/v1/config", json=config)

    def validate_config(self, body: dict[str, Any], mode: str = "replace") -> dict[str, Any]:
        """Dry run of `put_config` (mode `replace`) or `patch_config` (`merge`): the same errors, nothing
        applied; answers `{"valid", "changed_fields", "config"}`."""
        return self._call("POST", "/v1/config/validate", json=body, params={"mode": mode})

    # --- ingest

    def push_groups(self, groups: list[TrajectoryGroup | dict[str, Any]]) -> InsertResult:
        """Insert groups generated elsewhere; the result names each rejected group's failing field."""
        docs = [g if isinstance(g, dict) else group_to_json(g) for g in groups]
        out = self._call("POST", "/v1/groups", json={"groups": docs})
        return InsertResult(tuple(out["inserted"]), tuple(out["duplicates"]), dict(out["rejected"]))


class ActorClient(ServiceClient):
    """An actor service: the runs of its pool (`/v1/runs`)."""

    what = "the actor"

    def runs(self) -> dict[str, Any]:
        return self._call("GET", "/v1/runs")

    def add_run(self, config: dict[str, Any]) -> dict[str, Any]:
        """Add a run (its config; `model_path` and `engine` may be left out: the pool's)."""
        return self._call("POST", "/v1/runs", json=config)

    def update_run(self, run_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Merge `changes` (`max_inflight_prompts`, `sampling`) into a run's config."""
        return self._call("PATCH", f"/v1/runs/{quote(run_id, safe='')}", json=changes)

    def remove_run(self, run_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/runs/{quote(run_id, safe='')}")
