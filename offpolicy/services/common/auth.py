"""Bearer-token check for mutating routes, active when `OFFPOLICY_API_TOKEN` is set; constant-time compare."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from offpolicy.services.common.errors import Unauthorized

_bearer = HTTPBearer(
    auto_error=False,
    description="Bearer token; required on mutating routes when OFFPOLICY_API_TOKEN is set",
)


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Raise `Unauthorized` unless no token is configured or the request carries exactly that token."""
    expected = request.app.state.settings.api_token
    if expected is None:
        return
    if credentials is None:
        raise Unauthorized("this route needs an `Authorization: Bearer <token>` header")
    given = credentials.credentials.encode()
    if not hmac.compare_digest(given, expected.get_secret_value().encode()):
        raise Unauthorized("the bearer token does not match")


Authorized = Depends(require_token)
"""Route dependency: `dependencies=[Authorized]` on every mutating route."""
