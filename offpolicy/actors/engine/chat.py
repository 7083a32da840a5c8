"""Conversations in tokens: render messages through the chat template without re-tokenizing the policy's
text, check that a call's messages extend the recorded conversation, read tool calls out of a turn.

- `render_prompt(tokenizer, messages, tools)`: the first call's whole conversation, ending with the
  template's opening of the assistant turn (these become the episode's prompt).
- `render_messages(tokenizer, messages, tools)`: the tokens the template adds for messages that follow an
  assistant turn (tool results, user turns), ending with the next assistant turn's opening: the template
  rendered with and without them after a fixed conversation, the difference taken in tokens. Only the
  environment's text is tokenized here; the policy's turns stay exactly the engine's tokens.
- `new_messages(recorded, messages)`: the messages a call adds after the recorded conversation; a call
  whose messages rewrite an earlier turn raises `EpisodeConflict` naming the first message that differs.
  Assistant turns are compared by content and tool calls (name, arguments as JSON), not by ids or
  formatting of the client's copy.
- `ToolCallParser`: a vLLM tool parser by name (`hermes`, `llama3_json`, `qwen3_xml`, ...: the model's
  own format) reading a turn's text into content and OpenAI tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from offpolicy.actors.errors import ChatRequestError, EpisodeConflict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
_BASE: list[Message] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: list[Any] | None = None,
    images: bool = False,
) -> list[int]:
    """Token ids of a whole conversation and the opening of the assistant's turn (the template's own
    tokenization: `apply_chat_template(tokenize=True)`). `images`: `image_url` content parts become the
    template's image placeholders (a vision-language model); else they are refused."""
    if not messages:
        raise ChatRequestError("messages", "a conversation needs at least one message")
    return ids_of(_template(tokenizer, [as_template_message(m, images) for m in messages], tools, True))


def render_messages(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None = None
) -> list[int]:
    """The tokens the chat template adds for `messages` after an assistant turn, and the next assistant
    turn's opening (see the module docstring)."""
    before = ids_of(_template(tokenizer, _BASE, tools, False))
    after = ids_of(_template(tokenizer, [*_BASE, *(as_template_message(m) for m in messages)], tools, True))
    if after[: len(before)] != before:
        raise ValueError("the chat template does not render a conversation as a prefix of its extension")
    return after[len(before) :]


def _template(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[Any] | None, generation: bool
) -> Any:
    """`apply_chat_template(tokenize=True)`; a conversation the template refuses (its `raise_exception`:
    roles out of order, a tool message it cannot place) is the caller's `ChatRequestError`."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=generation
        )
    except TemplateError as e:
        raise ChatRequestError("messages", f"the chat template refused the conversation: {e}") from e


def ids_of(rendered: Any) -> list[int]:
    """`apply_chat_template(tokenize=True)`'s ids (a list, or a mapping with `input_ids`)."""
    return [int(t) for t in (rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)]


def text_of(content: Any) -> str:
    """A message's content as text: a string, None (""), or OpenAI content parts (their `text` parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if _is_image(part):
                raise ChatRequestError(
                    "messages.content",
                    "image_url parts need a vision-language model, in an episode's first call",
                )
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatRequestError(
                    "messages.content", "only text and image_url content parts are supported"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatRequestError("messages.content", f"expected a string or content parts, got {type(content)}")


def as_template_message(message: Mapping[str, Any], images: bool = False) -> Message:
    """A message as chat templates read it: content as text, tool-call arguments as objects. With
    `images`, content that holds `image_url` parts stays parts: its text parts and an `{"type": "image"}`
    per image, which vision-language templates render as the image's placeholder."""
    out: Message = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if images and isinstance(content, list) and any(_is_image(p) for p in content):
        out["content"] = [
            {"type": "image"} if _is_image(p) else {"type": "text", "text": text_of([p])} for p in content
        ]
    else:
        out["content"] = text_of(content)
    if calls := message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"].get("arguments")),
                },
            }
            for c in calls
        ]
    return out


def new_messages(
    recorded: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]]
) -> list[Message]:
    """The messages of a call after the recorded conversation (which they must repeat exactly)."""
    if len(messages) < len(recorded):
        raise EpisodeConflict(
            f"the call has {len(messages)} messages, fewer than the {len(recorded)} already recorded: "
            "send the whole conversation (a new branch needs a new episode)"
        )
    for i, (have, got) in enumerate(zip(recorded, messages, strict=False)):
        if _key(have) != _key(got):
            raise EpisodeConflict(
                f"messages[{i}] ({got.get('role')!r}) differs from the recorded conversation: a call may "
                "only append messages (rewriting an earlier turn needs a new episode)"
            )
    added = [dict(m) for m in messages[len(recorded) :]]
    if not added:
        raise EpisodeConflict("the call adds no message after the recorded conversation")
    return added


def image_parts(messages: Sequence[Mapping[str, Any]], first: int = 0) -> list[tuple[str, str]]:
    """(field, url) of each `image_url` content part of `messages`, in order (`messages[i]` counted from
    `first`); a malformed part is refused (`ChatRequestError` naming it)."""
    out = []
    for i, message in enumerate(messages, start=first):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "image_url":
                continue
            field = f"messages[{i}].content[{j}].image_url"
            url = _image_url(part)
            if not isinstance(url, str) or not url:
                raise ChatRequestError(field, "an image part needs `image_url.url` (a data: or http(s) URL)")
            out.append((field, url))
    return out


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image_url"


def _image_url(part: Mapping[str, Any]) -> Any:
    """An `image_url` part's URL (`{"image_url": {"url": ...}}`, or the bare string some clients send)."""
    ref = part.get("image_url")
    return ref.get("url") if isinstance(ref, Mapping) else ref


def _content_key(content: Any) -> Any:
    """A message's content as compared between calls: its text, and each image by its URL, in order."""
    if isinstance(content, list) and any(_is_image(p) for p in content):
        return tuple(
            ("image", str(_image_url(p))) if _is_image(p) else ("text", text_of([p])) for p in content
        )
    return text_of(content)


def _key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    calls = tuple(
        (c["function"]["name"], _canonical(c["function"].get("arguments")))
        for c in message.get("tool_calls") or ()
    )
    return (
        message.get("role"),
        _content_key(message.get("content")),
        calls,
        message.get("tool_call_id") or "",
        message.get("name") or "",
    )


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as an object when they are a JSON string (what templates expect)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _canonical(arguments: Any) -> str:
    value = _arguments(arguments)
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


class ToolCallParser:
    """vLLM's tool parser `name`, reading tool calls out of a turn's text (the model's format)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

        try:
            self._cls = ToolParserManager.get_tool_parser(name)
        except KeyError as e:
            raise ValueError(f"tool_parser {name!r}: vLLM has no such tool parser") from e
        self.name, self._tokenizer = name, tokenizer

    def parse(self, text: str, request: Any) -> tuple[str | None, list[Message]]:
        """(content, tool calls) of `text`; `request` is the call's vLLM `ChatCompletionRequest`."""
        info = self._cls(self._tokenizer, request.tools).extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in info.tool_calls
        ]
        return info.content, calls


def chat_request(body: Mapping[str, Any]) -> Any:
    """A vLLM `ChatCompletionRequest` of an OpenAI chat body (validated by vLLM's own model)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(dict(body))
