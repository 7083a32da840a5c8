"""The OpenAI-compatible gateway: agents written in any framework run episodes against the actor's engine,
and every model call they make is recorded exactly (docs/agents.md).

- `open_episode(prompt_id, group_id=None, group_size=None, ...)`: an episode of a group; without a
  `group_id`, episodes of one `prompt_id` fill a group of `group_size` (default `gateway.group_size`,
  else `sampling.n`) and the next one opens a new group.
- `chat(episode_id, body)`: one OpenAI chat completion (vLLM's `ChatCompletionRequest` validates the
  body). Within an episode it is `Episode.chat`: the first call's conversation (and `tools`) becomes the
  prompt; later calls must repeat the recorded conversation (the assistant turns as the gateway returned
  them) and may append messages, which become environment tokens through the chat template; a call that
  rewrites an earlier turn is refused (`EpisodeConflict`: a new branch needs a new episode). On a
  vision-language model the first call may show images (`image_url` parts: gateway/images.py reads and
  checks them; later calls may not add any). Tool calls are
  read by `tool_parser`. The actor's sampling parameters are used (the learner corrects with them): a call
  that asks for another temperature, top_p or top_k is refused. Without an episode the call is served and
  not recorded.
- `finish(episode_id, reward=None)`: closes it; without a reward the configured reward function scores
  it. When every episode of its group has finished (or expired), the group is pushed: its prompt is the
  longest common prefix of its episodes' prompts, each episode one completion with its policy mask; the
  images its episodes showed go with it (episodes of one group must show the same images, else the group
  is set aside, counted as `invalid_group`).
- `expire()`: episodes idle for `gateway.episode_timeout_s` are dropped (counted) and their groups pushed
  with the episodes that finished.

Everything here runs on the engine's event loop (the service calls `engine.acall`), like the actor's own
loop: its state needs no lock, and a finished group joins the actor's pusher directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from offpolicy.actors.data.prompts import Prompt
from offpolicy.actors.engine.chat import ToolCallParser, chat_request, image_parts
from offpolicy.actors.errors import (
    ChatRequestError,
    EpisodeConflict,
    EpisodeNotFound,
    InvalidSampling,
    RewardError,
    TooManyEpisodes,
)
from offpolicy.actors.gateway.images import read_call_images
from offpolicy.actors.rollout.episodes import ChatTurn, Episode, group_completions
from offpolicy.actors.rollout.submit import stamp_group

if TYPE_CHECKING:
    from offpolicy.actors.config import ActorConfig
    from offpolicy.actors.engine.vllm import VLLMEngine
    from offpolicy.actors.metrics import ActorMetrics
    from offpolicy.actors.rollout.scoring import RewardFailures, Scorer
    from offpolicy.buffer.types import SamplingParams, TrajectoryGroup


class GatewayHost(Protocol):
    """What the gateway needs of the actor that hosts it (`rollout.actor.Actor`): its engine, scorer, stamp
    and way into the buffer. A protocol, so that the gateway never imports the actor that builds it."""

    config: ActorConfig
    metrics: ActorMetrics
    engine: VLLMEngine
    scorer: Scorer
    reward_failures: RewardFailures
    actor_id: str
    stamp: SamplingParams

    def submit(self, group: TrajectoryGroup, images: Mapping[str, bytes] | None = None) -> None: ...


log = logging.getLogger(__name__)
_OPENAI_FINISH = {"stop", "length", "tool_calls"}


@dataclass(eq=False)
class _Group:
    group_id: str  # the caller's, or a new one
    size: int
    prompt: Prompt
    opened: int = 0
    ended: int = 0  # finished or expired
    finished: list[_Open] = field(default_factory=list)


@dataclass(eq=False)
class _Open:
    episode_id: str
    group: _Group
    episode: Episode
    last_active: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reward: float | None = None


class Gateway:
    """The episodes of one actor's gateway (see the module docstring)."""

    def __init__(self, actor: GatewayHost) -> None:
        self.actor = actor
        self.config = actor.config
        self.metrics = actor.metrics
        self.tool_parser = (
            ToolCallParser(self.config.tool_parser, actor.engine.tokenizer)
            if self.config.tool_parser
            else None
        )
        self._episodes: dict[str, _Open] = {}
        self._groups: dict[str, _Group] = {}
        self._filling: dict[str, _Group] = {}  # prompt_id -> the group its next episode joins

    # --- episodes

    async def open_episode(
        self,
        prompt_id: str,
        group_id: str | None = None,
        group_size: int | None = None,
        answer: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Open an episode; its id, group id and group size."""
        gw = self.config.gateway
        if len(self._episodes) >= gw.max_open_episodes:
            raise TooManyEpisodes(f"{len(self._episodes)} episodes are open (gateway.max_open_episodes)")
        size = group_size or gw.group_size or self.config.sampling.n
        limit = self.config.buffer.limits.max_completions_per_group
        if size > limit:
            raise ChatRequestError("group_size", f"{size} > buffer.limits.max_completions_per_group={limit}")
        prompt = Prompt(-1, prompt_id, "", answer, dict(metadata or {}))
        if group_id is None:
            group = self._filling.get(prompt_id)
            if group is None or group.opened >= group.size or group.size != size:
                group = self._new_group(uuid.uuid4().hex, size, prompt)
                self._filling[prompt_id] = group
        else:
            group = self._groups.get(group_id) or self._new_group(group_id, size, prompt)
            if group_size is not None and group.size != group_size:
                raise EpisodeConflict(f"group {group_id} has group_size {group.size}, not {group_size}")
            if group.opened >= group.size:
                raise EpisodeConflict(f"group {group_id} already has its {group.size} episodes")
        group.opened += 1
        engine = self.actor.engine
        episode = Episode(
            prompt,
            [],
            engine,
            engine.tokenizer,
            self._params_for,
            self.config.sampling.max_tokens,
            engine.loaded_version,
            tool_parser=self.tool_parser,
            max_len=self.config.engine.max_model_len,
        )
        episode_id = uuid.uuid4().hex
        self._episodes[episode_id] = _Open(episode_id, group, episode, time.monotonic())
        self.metrics.episodes.labels("opened").inc()
        self.metrics.open_episodes.set(len(self._episodes))
        return {"episode_id": episode_id, "group_id": group.group_id, "group_size": group.size}

    async def finish(
        self, episode_id: str, reward: float | None = None, metadata: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """Close an episode (`reward` None: the reward function scores it); pushes its group when complete."""
        open_ = self._get(episode_id)
        async with open_.lock:  # after a call in progress
            if self._episodes.pop(episode_id, None) is None:
                raise EpisodeNotFound(f"episode {episode_id} is not open")
            open_.reward = reward
            if metadata:
                open_.group.prompt.metadata.update(metadata)
            self.metrics.episodes.labels("finished").inc()
            self.metrics.open_episodes.set(len(self._episodes))
            group = open_.group
            group.finished.append(open_)
            group.ended += 1
            pushed = await self._complete(group)
        return {"episode_id": episode_id, "group_id": group.group_id, "group_complete": pushed}

    def expire(self, now: float | None = None) -> list[_Group]:
        """Drop episodes idle for `gateway.episode_timeout_s`; the groups this completes (to `_complete`)."""
        now = time.monotonic() if now is None else now
        timeout, done = self.config.gateway.episode_timeout_s, []
        for episode_id, open_ in list(self._episodes.items()):
            if open_.lock.locked() or now - open_.last_active < timeout:
                continue
            del self._episodes[episode_id]
            self.metrics.episodes.labels("expired").inc()
            open_.group.ended += 1
            if open_.group.ended == open_.group.size:
                done.append(open_.group)
        self.metrics.open_episodes.set(len(self._episodes))
        return done

    async def expire_loop(self) -> None:
        """`expire` every few seconds, pushing the groups it completes (a task of the actor's loop)."""
        period = min(5.0, self.config.gateway.episode_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            for group in self.expire():
                await self._complete(group)

    # --- chat completions

    async def chat(self, episode_id: str | None, body: Mapping[str, Any]) -> dict[str, Any]:
        """One chat completion (OpenAI's response object); recorded within `episode_id`'s episode. The
        request is checked whole before anything is recorded (`_check`, then `Episode.chat`): a refused
        call leaves the episode as it was, and a corrected retry goes on from there."""
        request = chat_request(body)
        self._check(request, recorded=episode_id is not None)
        messages = [dict(m) for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        max_tokens = self._max_tokens(body)
        stop = [request.stop] if isinstance(request.stop, str) else (request.stop or None)
        self._check_stop(stop)
        kwargs = {"max_tokens": max_tokens, "stop": stop, "request": request, "refuse_past_budget": True}
        if episode_id is None:
            episode = self._scratch_episode()
            turn = await episode.chat(messages, tools, images=await self._images(episode, messages), **kwargs)
        else:
            open_ = self._get(episode_id)
            async with open_.lock:  # one call at a time per episode: the next must extend this one
                if episode_id not in self._episodes:
                    raise EpisodeNotFound(f"episode {episode_id} is not open")
                open_.last_active = time.monotonic()
                episode = open_.episode
                images = await self._images(episode, messages)
                turn = await episode.chat(messages, tools, images=images, **kwargs)
                open_.last_active = time.monotonic()
        self.metrics.chat_calls.labels("true" if episode_id else "false").inc()
        self.metrics.gateway_seconds.labels("engine").inc(episode.engine_seconds_last)
        return self._response(turn, request)

    async def _images(self, episode: Episode, messages: list[dict[str, Any]]) -> tuple[Any, ...]:
        """The images of an episode's first call, read and checked (none for a later call: the episode
        refuses new ones and compares the recorded ones by URL)."""
        if episode.prompt_ids or not (parts := image_parts(messages)):
            return ()
        if not getattr(self.actor.engine, "vision", False):
            raise ChatRequestError(parts[0][0], "the actor's model reads no images")
        return await read_call_images(messages, self.config.gateway)

    @staticmethod
    def _max_tokens(body: Mapping[str, Any]) -> int | None:
        """The call's `max_completion_tokens`, else its `max_tokens` (integers: vLLM's request model
        checked them); below 1 is `InvalidSampling`."""
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        value = body.get(field)
        if value is not None and value < 1:
            raise InvalidSampling(field, f"must be at least 1, got {value}")
        return value

    def _check_stop(self, stop: list[str] | None) -> None:
        """vLLM's own checks of `stop` (`[""]` is refused), run before anything is recorded: the actor's
        sampling passes them, so a refusal here is the stop's."""
        if stop:
            try:
                self._params_for(1, stop=stop)
            except InvalidSampling as e:
                raise InvalidSampling("stop", str(e).removeprefix(f"{e.field}: ")) from e

    def _check(self, request: Any, recorded: bool) -> None:
        if request.n not in (None, 1):
            raise ChatRequestError("n", "one completion per call (an episode's turn); run n episodes instead")
        if request.stream:
            raise ChatRequestError("stream", "streaming is not supported")
        if request.top_logprobs:
            raise ChatRequestError("top_logprobs", "only the sampled token's log-prob is returned")
        if isinstance(request.tool_choice, str) and request.tool_choice not in ("auto", "none"):
            raise ChatRequestError("tool_choice", "only auto and none (forcing a call needs guided decoding)")
        if request.tool_choice is not None and not isinstance(request.tool_choice, str):
            raise ChatRequestError("tool_choice", "only auto and none (forcing a call needs guided decoding)")
        if request.tools and self.tool_parser is None:
            raise ChatRequestError("tools", "set the actor's tool_parser (e.g. hermes) to read tool calls")
        if recorded:  # the learner corrects with the actor's sampling: another one would be off-policy
            s = self.config.sampling
            for name, value, ours in (
                ("temperature", request.temperature, s.temperature),
                ("top_p", request.top_p, s.top_p),
                ("top_k", request.top_k, s.top_k),
            ):
                if value is not None and value != ours:
                    raise ChatRequestError(name, f"{value} differs from the actor's sampling.{name}={ours}")

    def _response(self, turn: ChatTurn, request: Any) -> dict[str, Any]:
        tokenizer = self.actor.engine.tokenizer
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = turn.tool_calls
        logprobs = None
        if request.logprobs:
            content = []
            for token_id, lp in zip(turn.token_ids.tolist(), turn.logprobs.tolist(), strict=True):
                text = tokenizer.decode([token_id])
                content.append(
                    {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                )
            logprobs = {"content": content}
        n = len(turn.token_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.gateway.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": turn.finish_reason if turn.finish_reason in _OPENAI_FINISH else "stop",
                    "logprobs": logprobs,
                    "token_ids": turn.token_ids.tolist(),
                }
            ],
            "usage": {
                "prompt_tokens": turn.prompt_tokens,
                "completion_tokens": n,
                "total_tokens": turn.prompt_tokens + n,
            },
        }

    # --- groups

    async def _complete(self, group: _Group) -> bool:
        """Push `group` once all its episodes ended; True when it is complete (pushed or set aside)."""
        if group.ended < group.size:
            return False
        self._groups.pop(group.group_id, None)
        if self._filling.get(group.prompt.prompt_id) is group:
            del self._filling[group.prompt.prompt_id]
        done = [o for o in group.finished if o.episode.turns > 0]
        self.metrics.episodes.labels("empty").inc(len(group.finished) - len(done))
        if not done:
            return True
        first = done[0].episode.messages or []
        user = next((m for m in first if m.get("role") == "user"), {})
        images = done[0].episode.images
        if any([i.sha256 for i in o.episode.images] != [i.sha256 for i in images] for o in done):
            self.metrics.failures.labels("invalid_group").inc()
            log.warning("gateway group %s: its episodes showed different images; set aside", group.group_id)
            return True
        content = user.get("content")
        text = (
            content
            if isinstance(content, str)
            else " ".join(
                str(p.get("text", ""))
                for p in content or ()
                if isinstance(p, Mapping) and p.get("type") == "text"
            )
        )
        prompt = replace(group.prompt, text=text, images=images)
        unscored = [o for o in done if o.reward is None]
        if unscored:
            try:
                scores = await self.actor.scorer.score(
                    prompt, [o.episode.completion().text for o in unscored]
                )
            except RewardError as e:
                self.actor.reward_failures.failed(e.reason)
                log.warning("gateway group %s: reward failed, group dropped: %s", group.group_id, e)
                return True
            self.actor.reward_failures.scored()
            for o, score in zip(unscored, scores, strict=True):
                o.reward = score
        prompt_ids, completions = group_completions([o.episode for o in done])
        if len(prompt_ids) == 0:
            self.metrics.failures.labels("invalid_group").inc()
            log.warning("gateway group %s: its episodes share no prompt token; set aside", group.group_id)
            return True
        version = min(o.episode.version for o in done)
        record = stamp_group(
            replace(prompt, metadata={**prompt.metadata, "gateway_group_id": group.group_id}),
            prompt_ids,
            completions,
            [float(o.reward) for o in done],  # type: ignore[arg-type]
            version,
            self.actor.actor_id,
            self.actor.stamp,
        )
        if images:  # the encoded images go with the group (hosts without images keep their signature)
            self.actor.submit(record, {i.sha256: i.data for i in images})
        else:
            self.actor.submit(record)
        return True

    def holds(self, episode_id: str | None) -> bool:
        """Whether episode `episode_id` is open on this gateway (an actor pool's runs each have theirs)."""
        return episode_id in self._episodes

    # --- helpers

    def _new_group(self, group_id: str, size: int, prompt: Prompt) -> _Group:
        group = _Group(group_id, size, prompt)
        self._groups[group_id] = group
        return group

    def _get(self, episode_id: str) -> _Open:
        open_ = self._episodes.get(episode_id)
        if open_ is None:
            raise EpisodeNotFound(f"episode {episode_id} is not open (never opened, finished, or expired)")
        return open_

    def _params_for(self, max_tokens: int, **overrides: Any) -> Any:
        return self.actor.engine.sampling_params(
            self.config.sampling, n=1, max_tokens=max_tokens, **overrides
        )

    def _scratch_episode(self) -> Episode:
        engine = self.actor.engine
        return Episode(
            Prompt(-1, "", ""),
            [],
            engine,
            engine.tokenizer,
            self._params_for,
            self.config.engine.max_model_len,
            engine.loaded_version,
            tool_parser=self.tool_parser,
            max_len=self.config.engine.max_model_len,
        )
