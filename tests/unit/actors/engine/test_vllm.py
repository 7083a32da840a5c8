"""offpolicy.actors.engine.vllm's output conversion (hermetic): vLLM's weight-version spans become per-token
versions."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from offpolicy.actors.engine.vllm import _completion
from offpolicy.actors.errors import EngineError


def _output(ids, spans, finish="length"):
    flat = SimpleNamespace(token_ids=list(ids), logprobs=[-0.5] * len(ids))
    spans = None if spans is None else [SimpleNamespace(version=v, start=s, end=e) for v, s, e in spans]
    return SimpleNamespace(
        token_ids=ids, logprobs=flat, finish_reason=finish, text="x", weight_versions=spans
    )


def test_spans_become_one_version_per_token():
    c = _completion(_output([5, 6, 7, 8], [("3", 0, 1), ("4", 1, 4)]))
    assert c.versions.tolist() == [3, 4, 4, 4] and c.versions.dtype == np.int32
    assert c.behavior_logprobs.tolist() == [-0.5] * 4 and c.token_ids.tolist() == [5, 6, 7, 8]
    assert _completion(_output([5], None)).versions is None  # no label: the caller's version applies


def test_spans_that_do_not_cover_the_tokens_are_an_error():
    with pytest.raises(EngineError, match="cover 2 of 3"):
        _completion(_output([5, 6, 7], [("3", 0, 2)]))


def test_an_aborted_request_without_tokens_is_an_empty_completion():
    c = _completion(_output([], None, finish="abort"))
    assert (len(c.token_ids), len(c.behavior_logprobs), c.finish_reason, c.versions) == (0, 0, "abort", None)
