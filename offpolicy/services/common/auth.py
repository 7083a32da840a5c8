"""Bearer-token checks, constant-time: mutating routes need `OFFPOLICY_API_TOKEN` when it is set; the actor's
gateway routes need its own `OFFPOLICY_GATEWAY_TOKEN` when that is set (else the API token)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from offpolicy.services.common.errors import Unauthorized

_bearer = HTTPBearer(
    auto_error=False,
    description="Bearer token; required on mutating routes when OFFPOLICY_API_TOKEN is set",
)


def _check(expected: SecretStr | None, credentials: HTTPAuthorizationCredentials | None) -> None:
    """Raise `Unauthorized` unless no token is expected or `credentials` carry exactly that token."""
    if expected is None:
        return
    if credentials is None:
        raise Unauthorized("this route needs an `Authorization: Bearer <token>` header")
    given = credentials.credentials.encode()
    if not hmac.compare_digest(given, expected.get_secret_value().encode()):
        raise Unauthorized("the bearer token does not match")


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Raise `Unauthorized` unless no token is configured or the request carries exactly that token."""
    _check(request.app.state.settings.api_token, credentials)


def require_gateway_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """The gateway's token when the settings have one (the admin token is then refused), else the API
    token's rule."""
    settings = request.app.state.settings
    gateway = getattr(settings, "gateway_token", None)
    _check(gateway if gateway is not None else settings.api_token, credentials)


Authorized = Depends(require_token)
"""Route dependency: `dependencies=[Authorized]` on every mutating route."""

GatewayAuthorized = Depends(require_gateway_token)
"""Route dependency of the actor's gateway routes (`/v1/episodes`, `/v1/chat/completions`)."""
