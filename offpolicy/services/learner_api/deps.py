"""Typed dependencies of the learner routes: the runtime and its parts, taken from `app.state`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from offpolicy.services.learner_api.control import ConfigControl
from offpolicy.services.learner_api.runtime import LearnerRuntime


def get_runtime(request: Request) -> LearnerRuntime:
    return request.app.state.runtime


def get_control(request: Request) -> ConfigControl:
    """The config history (the learner marks versions applied at its step boundaries)."""
    return request.app.state.runtime.control


Runtime = Annotated[LearnerRuntime, Depends(get_runtime)]
Control = Annotated[ConfigControl, Depends(get_control)]
