"""Multi-turn and tool-using episodes written in Python, run by the actor against its own engine.

An environment is an async function `episode(ep: Episode) -> float | EpisodeResult`, named by dotted path in
`environment.name`. It talks to the model through `ep`, which holds the episode's token sequence (the
prompt, then every turn) and records who wrote each token:

- `await ep.generate()`: one policy turn, sampled by the engine from the whole sequence so far; its tokens,
  behaviour log-probs and versions are recorded exactly as the engine returned them (policy tokens);
- `ep.add_message(role, content)`: a tool result or a user turn, rendered through the model's chat template
  and appended as environment tokens (`ep.add_tokens(ids)` appends token ids as they are). The episode's
  sequence is only ever extended: the policy's text is never re-tokenized;
- `await ep.chat(messages, tools=...)`: the OpenAI way: the messages must repeat the recorded conversation
  (the prompt's messages and every turn so far, assistant turns as `chat` returned them) and may add
  messages after it, appended as environment tokens; then one policy turn, returned as a `ChatTurn` (text,
  tool calls read by `tool_parser`, the recorded tokens and log-probs). The gateway
  (actors/gateway/agent_episodes.py)
  serves `POST /v1/chat/completions` with it; an episode opened there has no prompt until its first call,
  whose whole conversation (with its `tools`) becomes the prompt. On a vision-language model that first
  call may show images (`image_url` parts, read by the gateway: `chat(..., images=)`); each turn sends them
  to the engine with the prompt, and the episode records the prompt as the engine ran it (each image's
  placeholder widened to its tokens). Images in later calls are refused: the learner reads a sequence's
  images in its prompt. An environment's episode on a prompt with images (the dataset's) is the same:
  `Episode(..., images=prompt.images)`; `prompt_ids` is the widened prompt once it has generated.

The episode returns its reward (and metadata). `sampling.n` episodes of one prompt run concurrently and
form one group, pushed as soon as all are done, as single-turn groups are. `finish_reason` is the last
policy turn's; an episode whose budget (`sampling.max_tokens` response tokens, the environment's
included) runs out ends there: a message that does not fit is not added and later turns return "".

With `engine.return_routed_experts` (MoE) each turn asks the engine for the routing of every position from
where the episode's rows end (the first turn: from position 0), so the rows stay contiguous: the
environment tokens between turns get the routing of the prefill that read them. The completion carries
one row per response token (buffer/types.py `Trajectory.routed_experts`).
"""

from __future__ import annotations

import importlib
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from offpolicy.actors.engine.chat import (
    Message,
    ToolCallParser,
    chat_request,
    image_parts,
    new_messages,
    render_messages,
    render_prompt,
)
from offpolicy.actors.engine.routing import filler
from offpolicy.actors.engine.vllm import Completion
from offpolicy.actors.errors import BudgetExceeded, ChatRequestError, RewardError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from offpolicy.actors.data.images import PromptImage
    from offpolicy.actors.data.prompts import Prompt
    from offpolicy.actors.engine.vllm import VLLMEngine

_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    """What an episode returns: its reward and metadata (strings) for the record."""

    reward: float
    metadata: Mapping[str, str] = field(default_factory=dict)


Environment = Callable[["Episode"], Awaitable["float | EpisodeResult"]]


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One policy turn of `Episode.chat`: what the engine sampled and what the tool parser read in it."""

    text: str  # the turn's whole text
    content: str | None  # the text without its tool calls
    tool_calls: list[Message]  # OpenAI tool calls: {"id", "type": "function", "function": {name, arguments}}
    finish_reason: str  # the engine's ("stop" | "length" | "abort"), "tool_calls" when the turn made some
    token_ids: np.ndarray  # int32[R]: the turn's tokens, exactly as the engine returned them
    logprobs: np.ndarray  # float32[R]: their behaviour log-probs
    prompt_tokens: int  # length of the sequence the turn was sampled from

    @property
    def message(self) -> Message:
        """The assistant message a client sends back in its next call."""
        return {
            "role": "assistant",
            "content": self.content,
            **({"tool_calls": self.tool_calls} if self.tool_calls else {}),
        }


def resolve_environment(name: str) -> Environment:
    """The async function at dotted path `pkg.mod.fn` (a built-in:
    `offpolicy.actors.rollout.environments.calculator`)."""
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
        messages: Sequence[Mapping[str, Any]] | None = None,
        tool_parser: ToolCallParser | None = None,
        max_len: int | None = None,
        images: Sequence[PromptImage] = (),
    ) -> None:
        self.prompt = prompt
        self._engine, self._tokenizer, self._params_for = engine, tokenizer, params_for
        self._prompt = [int(t) for t in prompt_ids]  # empty: the first `chat` call renders it
        self._messages: list[Message] | None = None if messages is None else [dict(m) for m in messages]
        self._tool_parser, self._max_len = tool_parser, max_len
        self.tools: list[Any] | None = None  # rendered into the prompt by the first `chat` call
        self.last_turn: Completion | None = None  # the engine's output of the last `generate`
        self.engine_seconds_last = 0.0  # how long the last `generate` waited for the engine
        self._ids: list[int] = []  # every response token, policy and environment
        self._behavior_logprobs: list[float] = []
        self._versions: list[int] = []
        self._policy: list[bool] = []
        self._routed: list[np.ndarray] = []  # routed experts of positions 0.. (engine.return_routed_experts)
        self._routed_len, self._num_experts = 0, None
        self._budget, self._version = budget, version
        self.finish_reason = "length"
        self.turns = 0
        self.ended = False  # the budget ran out: no more turns
        # the prompt's images (a vision-language model: the dataset's, or a gateway episode's first call's)
        # and the prompt as sent with them (one placeholder per image; `_prompt` becomes the prompt as the
        # engine ran it, each placeholder widened, at the first turn)
        self._images: tuple[PromptImage, ...] = tuple(images) if self._prompt else ()
        self._sent: list[int] = list(self._prompt) if self._images else []

    @property
    def tokens(self) -> list[int]:
        """The whole sequence so far: the prompt, then every turn."""
        return self._prompt + self._ids

    @property
    def budget_left(self) -> int:
        """Response tokens this episode may still add (`sampling.max_tokens` in all)."""
        return self._room(len(self._prompt), len(self._ids))

    def _room(self, prompt_len: int, response_len: int) -> int:
        """Response tokens left after a prompt and a response of these lengths (the budget, `max_len`)."""
        left = self._budget - response_len
        return left if self._max_len is None else min(left, self._max_len - prompt_len - response_len)

    @property
    def version(self) -> int:
        """The engine's policy version when the episode began (stamped on its environment tokens)."""
        return self._version

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's tokens (empty until the first `chat` of a gateway episode)."""
        return list(self._prompt)

    @property
    def images(self) -> tuple[PromptImage, ...]:
        """The images the episode's prompt shows (its first call's), in order."""
        return self._images

    @property
    def messages(self) -> list[Message] | None:
        """The conversation recorded so far (None when the prompt was not a conversation)."""
        return None if self._messages is None else [dict(m) for m in self._messages]

    async def generate(self, max_tokens: int | None = None, **overrides: Any) -> str:
        """One policy turn from the sequence so far (at most `max_tokens` and the budget left); its text.
        An empty string once the budget is spent. `overrides` go to the sampling parameters (`stop`)."""
        self.last_turn, self.engine_seconds_last = None, 0.0
        if not self._prompt:
            raise ChatRequestError("messages", "the episode has no prompt yet: its first call must be chat()")
        limit = self.budget_left if max_tokens is None else min(max_tokens, self.budget_left)
        if limit <= 0 or self.ended:
            self.ended, self.finish_reason = True, "length"
            return ""
        return await self._sample(self._params_for(limit, **overrides))

    async def _sample(self, params: Any) -> str:
        """One policy turn with `params` (built and checked by the caller), recorded."""
        request, t0 = f"episode-{next(_ids)}", time.perf_counter()
        routing = getattr(self._engine, "return_routed_experts", False)
        kw: dict[str, Any] = {"routed_start": self._routed_len} if routing else {}  # contiguous rows
        tokens = self.tokens
        if self._images:  # the prompt as sent, its images; the engine widens each placeholder again
            from offpolicy.actors.data.images import decoded_images

            kw["images"], tokens = decoded_images(self), self._sent + self._ids
        (out,) = await self._engine.generate_group(request, tokens, params, **kw)
        if self._images and not self._ids and out.prompt_ids is not None:  # the prompt as the engine ran it
            self._prompt = [int(t) for t in out.prompt_ids]
        self.engine_seconds_last = time.perf_counter() - t0
        if routing and out.routed_experts is not None:  # positions routed_len.. (len(tokens) + R - 2)
            self._routed.append(out.routed_experts)
            self._routed_len += len(out.routed_experts)
            self._num_experts = out.num_experts
        self.last_turn = out
        self._ids += out.token_ids.tolist()
        self._behavior_logprobs += out.behavior_logprobs.tolist()
        versions = out.versions if out.versions is not None else np.full(len(out.token_ids), self._version)
        self._versions += [int(v) for v in versions]
        self._policy += [True] * len(out.token_ids)
        self.finish_reason, self.turns = out.finish_reason, self.turns + 1
        return out.text

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[Any] | None = None,
        *,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
        request: Any = None,
        refuse_past_budget: bool = False,
        images: Sequence[PromptImage] = (),
    ) -> ChatTurn:
        """One policy turn after `messages` (the recorded conversation, then new messages appended as
        environment tokens); see the module docstring. `request`: the caller's vLLM `ChatCompletionRequest`
        (for the tool parser; built from `tools` when None).

        The call is checked whole before anything is recorded: the messages (`ChatRequestError`,
        `EpisodeConflict`) and the sampling parameters (vLLM's own checks: `InvalidSampling`). Messages
        that leave no room for one answer token end the episode (the turn is ""), or, with
        `refuse_past_budget` (the gateway), raise `BudgetExceeded`. A refused call leaves the episode as
        it was. `images`: the first call's images, one per `image_url` part of `messages`, read and checked
        by the caller (the gateway); the engine must be a vision-language one."""
        prompt, added, env = self._pending(messages, tools)
        if not self._prompt and len(images) != len(image_parts(messages)):
            raise ChatRequestError(
                "messages", f"{len(image_parts(messages))} image parts, {len(images)} images"
            )
        left = self._room(len(prompt), len(self._ids) + len(env))
        if refuse_past_budget and (self.ended or left < 1):
            have = 0 if self.ended else self.budget_left
            raise BudgetExceeded(
                f"the call needs {len(env) + 1} tokens (its new messages and one answer token) but the "
                f"episode has {have} of its {self._budget} left (sampling.max_tokens): a new episode, or "
                "shorter messages",
                len(env) + 1,
                have,
            )
        limit = left if max_tokens is None else min(max_tokens, left)
        overrides = {"stop": stop} if stop else {}
        params = self._params_for(limit, **overrides) if limit > 0 and not self.ended else None
        # --- recorded from here on: everything above raised before anything changed
        if not self._prompt:
            self._prompt, self._messages, self.tools = prompt, [dict(m) for m in messages], tools
            self._images, self._sent = tuple(images), list(prompt) if images else []
        else:
            self.add_tokens(env)
            self._messages += added  # type: ignore[operator]
        answered = len(self._ids)
        self.last_turn, self.engine_seconds_last = None, 0.0
        if params is None or self.ended:
            self.ended, self.finish_reason, text = True, "length", ""
        else:
            text = await self._sample(params)
        before = len(self._prompt) + answered  # the prompt as the engine ran it (images widened)
        out = self.last_turn
        content, calls = text, []
        wants = request is None or getattr(request, "tool_choice", "auto") != "none"
        if self._tool_parser is not None and tools and text and wants:
            content, calls = self._tool_parser.parse(
                text, request or chat_request({"model": "episode", "messages": [], "tools": tools})
            )
        turn = ChatTurn(
            text=text,
            content=content,
            tool_calls=calls,
            finish_reason="tool_calls" if calls else self.finish_reason,
            token_ids=np.zeros(0, np.int32) if out is None else out.token_ids,
            logprobs=np.zeros(0, np.float32) if out is None else out.behavior_logprobs,
            prompt_tokens=before,
        )
        self._messages.append(turn.message)  # type: ignore[union-attr]
        return turn

    def _pending(
        self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None
    ) -> tuple[list[int], list[Message], list[int]]:
        """What a `chat` call would record, changing nothing: the prompt (rendered by the first call,
        else the recorded one), the messages it adds and their environment tokens."""
        if not self._prompt:
            vision = bool(getattr(self._engine, "vision", False))
            if image_parts(messages) and not vision:
                raise ChatRequestError(image_parts(messages)[0][0], "the actor's model reads no images")
            prompt = render_prompt(self._tokenizer, messages, tools, images=vision)
            if self._max_len is not None and len(prompt) >= self._max_len:
                raise ChatRequestError(
                    "messages", f"the conversation is {len(prompt)} tokens: no room to answer"
                )
            return prompt, [], []
        if self._messages is None:
            raise ChatRequestError("messages", "this episode's prompt is not a conversation: use generate()")
        added = new_messages(self._messages, messages)
        if shown := image_parts(added, first=len(self._messages)):
            raise ChatRequestError(
                shown[0][0],
                "images after an episode's first call are not supported (the learner reads a sequence's "
                "images in its prompt): show them in the first call, or open a new episode",
            )
        return self._prompt, added, render_messages(self._tokenizer, added, self.tools)

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Append environment tokens (attended by the policy, never trained). Tokens that do not fit the
        budget left end the episode instead (nothing is cut in half; `generate` returns "" from then on)."""
        ids = [int(t) for t in token_ids]
        if self.ended or len(ids) > self.budget_left:
            self.ended, self.finish_reason = True, "length"
            return
        self._ids += ids
        self._behavior_logprobs += [0.0] * len(ids)
        self._versions += [self._version] * len(ids)
        self._policy += [False] * len(ids)

    def add_message(self, role: str, content: str) -> None:
        """Append a message (`tool`, `user`, ...) as the chat template renders it after a turn, ending with
        the template's prompt for the next assistant turn: environment tokens."""
        self.add_tokens(render_message(self._tokenizer, role, content))

    def routed_rows(self, first: int, count: int) -> np.ndarray | None:
        """Routed experts of the `count` positions from `first` (uint8|uint16[count, L, K]); the rows no
        forward computed (a negative position, or past the last turn) are `routing.filler`. None without
        routing."""
        if not self._routed:
            return None
        rows = np.concatenate(self._routed)  # (routed_len, L, K)
        _, layers, top_k = rows.shape
        lo, hi = max(first, 0), min(first + count, len(rows))
        parts = [filler(lo - first, layers, top_k, rows.dtype), rows[lo:hi]]
        parts.append(filler(count - (lo - first) - max(hi - lo, 0), layers, top_k, rows.dtype))
        return np.concatenate(parts)  # (count, L, K)

    def completion(self) -> Completion:
        """The episode as one completion: every response token, with the policy mask (and, with routing,
        the routed experts of every response token)."""
        routed = self.routed_rows(len(self._prompt) - 1, len(self._ids))
        mask = np.array(self._policy, dtype=bool)
        return Completion(
            token_ids=np.array(self._ids, dtype=np.int32),
            behavior_logprobs=np.array(self._behavior_logprobs, dtype=np.float32),
            finish_reason=self.finish_reason,
            text=self._tokenizer.decode([t for t, p in zip(self._ids, self._policy, strict=True) if p]),
            versions=np.array(self._versions, dtype=np.int32),
            policy_mask=None if mask.all() else mask,
            routed_experts=routed,  # (R, L, K) or None
            num_experts=None if routed is None else self._num_experts,
        )


def render_message(tokenizer: PreTrainedTokenizerBase, role: str, content: str) -> list[int]:
    """The tokens the chat template adds for one message after an assistant turn (and the next assistant
    turn's opening); `offpolicy.actors.engine.chat.render_messages` of one message."""
    return render_messages(tokenizer, [{"role": role, "content": content}])


def group_completions(episodes: Sequence[Episode]) -> tuple[np.ndarray, list[Completion]]:
    """One group of episodes: the prompt they share (the longest common prefix of their prompts) and each
    one's completion after it. A prompt's tokens past the shared prefix (episodes of one group may render
    different conversations) join its completion as environment tokens."""
    prompts = [ep.prompt_ids for ep in episodes]
    shared = 0
    while all(len(p) > shared for p in prompts) and len({p[shared] for p in prompts}) == 1:
        shared += 1
    completions = []
    for ep, prompt in zip(episodes, prompts, strict=True):
        c, extra = ep.completion(), np.asarray(prompt[shared:], dtype=np.int32)
        if len(extra):
            mask = np.concatenate(
                [
                    np.zeros(len(extra), bool),
                    c.policy_mask if c.policy_mask is not None else np.ones(len(c.token_ids), bool),
                ]
            )
            versions = (
                c.versions if c.versions is not None else np.full(len(c.token_ids), ep.version, np.int32)
            )
            c = Completion(
                token_ids=np.concatenate([extra, c.token_ids]),
                behavior_logprobs=np.concatenate([np.zeros(len(extra), np.float32), c.behavior_logprobs]),
                finish_reason=c.finish_reason,
                text=c.text,
                versions=np.concatenate([np.full(len(extra), ep.version, np.int32), versions]),
                policy_mask=mask,
                routed_experts=ep.routed_rows(shared - 1, len(extra) + len(c.token_ids)),  # (R', L, K)
                num_experts=c.num_experts,
            )
        completions.append(c)
    return np.asarray(prompts[0][:shared], dtype=np.int32), completions


def as_result(value: float | EpisodeResult) -> EpisodeResult:
    """An episode's return value as an `EpisodeResult`; anything else is a `RewardError`."""
    if isinstance(value, EpisodeResult):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return EpisodeResult(float(value))
    raise RewardError(f"an episode returned {value!r}, not a reward or an EpisodeResult")
