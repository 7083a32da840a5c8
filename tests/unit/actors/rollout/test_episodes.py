"""Episodes' environment turns: the chat template's tokens for a message after an assistant turn, the
budget that ends an episode instead of cutting a message, and the environments' lookup."""

from __future__ import annotations

import pytest

from offpolicy.actors.data.prompts import Prompt
from offpolicy.actors.errors import RewardError
from offpolicy.actors.rollout.episodes import (
    Episode,
    EpisodeResult,
    as_result,
    render_message,
    resolve_environment,
)
from offpolicy.learner.model import build_char_tokenizer


def test_a_message_renders_as_the_template_adds_it_after_a_turn():
    tok = build_char_tokenizer()
    ids = render_message(tok, "tool", "42")
    assert tok.decode(ids) == "tool: 42\nassistant: "


def test_a_message_past_the_budget_ends_the_episode_whole():
    tok = build_char_tokenizer()
    ep = Episode(
        Prompt(0, "p", "hi"), [5, 6], engine=None, tokenizer=tok, params_for=None, budget=30, version=3
    )
    ep.add_message("user", "warmer")  # 24 tokens: fits
    assert ep.budget_left == 6 and not ep.ended
    ep.add_message("user", "colder")  # 24 more: does not fit, nothing added
    assert ep.ended and ep.budget_left == 6 and ep.finish_reason == "length"
    c = ep.completion()
    assert c.policy_mask is not None and not c.policy_mask.any() and (c.versions == 3).all()
    assert ep.tokens[:2] == [5, 6] and len(ep.tokens) == 2 + 24


def test_results_and_lookup():
    assert as_result(1) == EpisodeResult(1.0) and as_result(EpisodeResult(0.5, {"a": "b"})).reward == 0.5
    with pytest.raises(RewardError):
        as_result("high")
    assert resolve_environment("offpolicy.actors.rollout.environments.calculator").__name__ == "calculator"
    with pytest.raises(ValueError, match="cannot import"):
        resolve_environment("offpolicy.actors.rollout.environments.nope")
