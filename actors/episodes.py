"""Multi-turn and tool-using episodes written in Python, run by the actor against its own engine.

An environment is an async function `episode(ep: Episode) -> float | EpisodeResult`, named by dotted path in
`environment.name`. It talks to the model through `ep`, which holds the episode's token sequence (the
prompt, then every turn) and records who wrote each token:

- `await ep.generate()`: one policy turn, sampled by the engine from the whole sequence so far; its tokens,
  behaviour log-probs and versions are recorded exactly as the engine returned them (policy tokens);
- `ep.add_message(role, content)`: a tool result or a user turn, rendered through the model's chat template
  and appended as environment tokens (`ep.add_tokens(ids)` appends token ids as they are). The episode's
  sequence is only ever extended: the policy's text is never re-tokenized.

The episode returns its reward (and metadata). `sampling.n` episodes of one prompt run concurrently and
form one group, pushed as soon as all are done, as single-turn groups are. `finish_reason` is the last
policy turn's; an episode whose budget (`sampling.max_tokens` response tokens, the environment's
included) runs out ends there: a message that does not fit is not added and later turns return "".
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.engine import Completion
from actors.errors import RewardError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from actors.engine import VLLMEngine
    from actors.prompts import Prompt

_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    """What an episode returns: its reward and metadata (strings) for the record."""

    reward: float
    metadata: Mapping[str, str] = field(default_factory=dict)


Environment = Callable[["Episode"], Awaitable["float | EpisodeResult"]]


def resolve_environment(name: str) -> Environment:
    """The async function at dotted path `pkg.mod.fn` (a built-in: `actors.environments.calculator`)."""
    module_name, _, attr = name.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"environment {name!r}: cannot import {attr!r} from {module_name!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"environment {name!r} is not callable")
    return fn


class Episode:
    """One episode's token sequence and the engine it samples from (see the module docstring)."""

    def __init__(
        self,
        prompt: Prompt,
        prompt_ids: Sequence[int],
        engine: VLLMEngine,
        tokenizer: PreTrainedTokenizerBase,
        params_for: Callable[[int], Any],
        budget: int,
        version: int,
    ) -> None:
        self.prompt = prompt
        self._engine, self._tokenizer, self._params_for = engine, tokenizer, params_for
        self._prompt = [int(t) for t in prompt_ids]
        self._ids: list[int] = []  # every response token, policy and environment
        self._lps: list[float] = []
        self._versions: list[int] = []
        self._policy: list[bool] = []
        self._budget, self._version = budget, version
        self.finish_reason = "length"
        self.turns = 0
        self.ended = False  # the budget ran out: no more turns

    @property
    def tokens(self) -> list[int]:
        """The whole sequence so far: the prompt, then every turn."""
        return self._prompt + self._ids

    @property
    def budget_left(self) -> int:
        """Response tokens this episode may still add (`sampling.max_tokens` in all)."""
        return self._budget - len(self._ids)

    async def generate(self, max_tokens: int | None = None) -> str:
        """One policy turn from the sequence so far (at most `max_tokens` and the budget left); its text.
        An empty string once the budget is spent."""
        limit = self.budget_left if max_tokens is None else min(max_tokens, self.budget_left)
        if limit <= 0 or self.ended:
            self.ended, self.finish_reason = True, "length"
            return ""
        request = f"episode-{next(_ids)}"
        (out,) = await self._engine.generate_group(request, self.tokens, self._params_for(limit))
        self._ids += out.token_ids.tolist()
        self._lps += out.logprobs.tolist()
        versions = out.versions if out.versions is not None else np.full(len(out.token_ids), self._version)
        self._versions += [int(v) for v in versions]
        self._policy += [True] * len(out.token_ids)
        self.finish_reason, self.turns = out.finish_reason, self.turns + 1
        return out.text

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Append environment tokens (attended by the policy, never trained). Tokens that do not fit the
        budget left end the episode instead (nothing is cut in half; `generate` returns "" from then on)."""
        ids = [int(t) for t in token_ids]
        if self.ended or len(ids) > self.budget_left:
            self.ended, self.finish_reason = True, "length"
            return
        self._ids += ids
        self._lps += [0.0] * len(ids)
        self._versions += [self._version] * len(ids)
        self._policy += [False] * len(ids)

    def add_message(self, role: str, content: str) -> None:
        """Append a message (`tool`, `user`, ...) as the chat template renders it after a turn, ending with
        the template's prompt for the next assistant turn: environment tokens."""
        self.add_tokens(render_message(self._tokenizer, role, content))

    def completion(self) -> Completion:
        """The episode as one completion: every response token, with the policy mask."""
        mask = np.array(self._policy, dtype=bool)
        return Completion(
            token_ids=np.array(self._ids, dtype=np.int32),
            logprobs=np.array(self._lps, dtype=np.float32),
            finish_reason=self.finish_reason,
            text=self._tokenizer.decode([t for t, p in zip(self._ids, self._policy, strict=True) if p]),
            versions=np.array(self._versions, dtype=np.int32),
            policy_mask=None if mask.all() else mask,
        )


def render_message(tokenizer: PreTrainedTokenizerBase, role: str, content: str) -> list[int]:
    """The tokens the chat template adds for one message after an assistant turn (and the next assistant
    turn's opening): the template rendered with and without the message, the difference taken in tokens
    of the rendered text. Only the environment's text is tokenized here, never the policy's."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = tokenizer.apply_chat_template(base, tokenize=True, add_generation_prompt=False)
    after = tokenizer.apply_chat_template(
        [*base, {"role": role, "content": content}], tokenize=True, add_generation_prompt=True
    )
    before, after = _ids_of(before), _ids_of(after)
    if after[: len(before)] != before:
        raise ValueError("the chat template does not render a conversation as a prefix of its extension")
    return after[len(before) :]


def _ids_of(rendered: Any) -> list[int]:
    """`apply_chat_template(tokenize=True)`'s ids (a list, or a mapping with `input_ids`)."""
    return list(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)


def as_result(value: float | EpisodeResult) -> EpisodeResult:
    """An episode's return value as an `EpisodeResult`; anything else is a `RewardError`."""
    if isinstance(value, EpisodeResult):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return EpisodeResult(float(value))
    raise RewardError(f"an episode returned {value!r}, not a reward or an EpisodeResult")
