"""Prompts: a dataset's rows as `Prompt`s (keys by `DatasetConfig`), this actor's shard, per-epoch
reshuffles, the chat template.

A row's prompt (`dataset.prompt_key`, default `prompt`) is a non-empty string or a list of chat messages
(`{"role", "content"}` with string content, as verl and TRL store them). A conversation that ends with an
assistant message holds its completion: that message leaves the prompt and becomes the answer when the
row has none under `answer_key`. `Prompt.text` is what reward functions read: the string, or the content
of the conversation's last user message. The answer (`answer_key`, default `answer`; dotted paths such
as `reward_model.ground_truth` walk nested objects) is kept as a string (numbers as written, objects as
JSON, a list of messages as its last message's content); a row without one has None. Metadata is the
row's `metadata` object, or the values at `metadata_keys` (dotted paths, each required), as strings,
and those at `optional_metadata_keys` that the row has. The
id is the value at `id_key` (default `id`), else the row's index. Actor `i` of `N` takes the rows whose
index is `i` modulo `N`, so the actors together cover every row exactly once per epoch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from offpolicy.actors.config import DatasetConfig
from offpolicy.actors.data.images import ImageRefused, PromptImage, read_images
from offpolicy.actors.data.sources import read_rows
from offpolicy.actors.errors import DatasetError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
_MISSING = object()
IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a prompt's text (verl's multimodal layout); none = the images come first."""
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One dataset record."""

    index: int  # position in the dataset
    prompt_id: str  # the record's id (`id_key`), or its index
    text: str  # the prompt string, or the content of the conversation's last user message
    answer: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    messages: tuple[Message, ...] | None = None  # the conversation (chat prompts); None for a string
    system: str | None = None  # this record's system prompt (`system_prompt_key`); None = the config's
    images: tuple[PromptImage, ...] = ()  # its images (`image_key`), checked (actors/data/images.py)


def load_prompts(
    dataset: DatasetConfig | str | Path, limit: int | None = None, refused: list[str] | None = None
) -> list[Prompt]:
    """Every record of the dataset (the first `limit` with one), in order; `DatasetError` names the bad
    one (row and key). A path alone reads with the default keys. A record whose image is refused
    (actors/data/images.py) is left out, logged, and named in `refused` when given; the rest is read on
    (none left is a `DatasetError`)."""
    cfg = dataset if isinstance(dataset, DatasetConfig) else DatasetConfig(path=str(dataset))
    rows = read_rows(cfg.path, cfg.split)[:limit]
    base = Path(cfg.path).parent if Path(cfg.path).is_file() else Path(cfg.path)
    prompts, left_out = [], []
    for i, (where, raw) in enumerate(rows):
        try:
            prompts.append(_record(i, raw, where, cfg, base))
        except ImageRefused as e:
            left_out.append(f"{where}: record left out: {e}")
            log.warning("%s", left_out[-1])
    if refused is not None:
        refused.extend(left_out)
    if rows and not prompts:
        raise DatasetError(f"{cfg.path}: every record was left out for its images; the first: {left_out[0]}")
    if cfg.chat_template is False:
        chat = next((p for p in prompts if p.messages is not None), None)
        if chat is not None:
            raise DatasetError(
                f"{cfg.path}: record {chat.index} (`{cfg.prompt_key}`) is a list of chat messages, which "
                "only the chat template can render: set dataset.chat_template: true"
            )
    return prompts


def text_only(prompts: Sequence[Prompt], path: str, vision: bool = False) -> list[Prompt]:
    """`prompts`, refused (`DatasetError`) when one has images and the model is not a vision-language one
    (`vision`): it would be trained on prompts whose images it never saw, without a sign."""
    first = next((p for p in prompts if p.images), None)
    if first is not None and not vision:
        raise DatasetError(
            f"{path}: record {first.index} has {len(first.images)} image(s), and the model is not a "
            "vision-language one: set dataset.image_key: null to train on the text alone"
        )
    return list(prompts)


def _record(index: int, raw: Any, where: str, cfg: DatasetConfig, base: Path = Path(".")) -> Prompt:
    if not isinstance(raw, Mapping):
        raise DatasetError(f"{where}: a record must be an object, got {type(raw).__name__}")
    value = _lookup(raw, cfg.prompt_key)
    if value is _MISSING:
        raise DatasetError(
            f"{where}: no `{cfg.prompt_key}` (dataset.prompt_key); the record has {sorted(raw)}"
        )
    messages, completion = None, None
    if isinstance(value, str) and value:
        text = value
    elif isinstance(value, list) and value:
        messages = [_message(m, f"{where}: `{cfg.prompt_key}` message {k}") for k, m in enumerate(value)]
        if messages[-1]["role"] == "assistant":  # a conversation with its completion (TRL's `messages`)
            completion = messages.pop()["content"]
        text = _last_user_text(messages, f"{where}: `{cfg.prompt_key}`")
    else:
        raise DatasetError(
            f"{where}: `{cfg.prompt_key}` must be a non-empty string or a list of chat messages, "
            f"got {value!r}"
        )
    answer = _answer(_lookup(raw, cfg.answer_key))
    images: tuple[PromptImage, ...] = ()
    if cfg.image_key is not None and (got := _lookup(raw, cfg.image_key)) is not _MISSING:
        images = read_images(got, cfg.image_key, base, cfg.vision)
        holes = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages) if messages else 0
        holes = holes if messages else text.count(IMAGE_PLACEHOLDER)
        if holes and holes != len(images):
            raise ImageRefused(
                cfg.image_key, min(holes, len(images)),
                f"the prompt has {holes} {IMAGE_PLACEHOLDER} placeholder(s) for {len(images)} image(s)",
            )  # fmt: skip
    return Prompt(
        index=index,
        prompt_id=_id(raw, cfg.id_key, index),
        text=text,
        answer=completion if answer is None else answer,
        metadata=_metadata(raw, cfg.metadata_keys, where) | _optional(raw, cfg.optional_metadata_keys),
        messages=None if messages is None else tuple(messages),
        system=_system(raw, cfg.system_prompt_key, where),
        images=images,
    )


def _lookup(raw: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted `path` (`reward_model.ground_truth`), or `_MISSING`. A key that itself
    contains dots is found before its parts."""
    if path in raw:
        return raw[path]
    head, dot, rest = path.partition(".")
    if not dot or not isinstance(raw.get(head), Mapping):
        return _MISSING
    return _lookup(raw[head], rest)


def _message(m: Any, where: str) -> Message:
    if (
        not isinstance(m, Mapping)
        or not isinstance(m.get("role"), str)
        or not isinstance(m.get("content"), str)
    ):
        raise DatasetError(f"{where} must be an object with string `role` and `content`, got {m!r}")
    return {k: v for k, v in m.items() if v is not None}  # parquet fills absent struct fields with null


def _last_user_text(messages: list[Message], where: str) -> str:
    for m in reversed(messages):
        if m["role"] == "user":
            return m["content"]
    raise DatasetError(f"{where} has no user message (roles: {[m['role'] for m in messages]})")


def _as_string(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _answer(value: Any) -> str | None:
    if value is _MISSING or value is None:
        return None
    if isinstance(value, list) and value and all(isinstance(m, Mapping) and "content" in m for m in value):
        return str(value[-1]["content"])  # TRL's `completion`: [{"role": "assistant", "content": ...}]
    if isinstance(value, str | int | float):
        return str(value)
    return json.dumps(value)


def _metadata(raw: Mapping[str, Any], keys: Sequence[str] | None, where: str) -> dict[str, str]:
    if keys is None:
        meta = raw.get("metadata") or {}
        if not isinstance(meta, Mapping):
            raise DatasetError(f"{where}: `metadata` must be an object, got {type(meta).__name__}")
        return {str(k): _as_string(v) for k, v in meta.items()}
    out = {}
    for key in keys:
        value = _lookup(raw, key)
        if value is _MISSING:
            raise DatasetError(f"{where}: no `{key}` (dataset.metadata_keys); the record has {sorted(raw)}")
        out[key] = _as_string(value)
    return out


def _optional(raw: Mapping[str, Any], keys: Sequence[str]) -> dict[str, str]:
    """The values at `keys` that the record has (not null), as strings (objects as JSON)."""
    values = {key: _lookup(raw, key) for key in keys}
    return {k: _as_string(v) for k, v in values.items() if v is not _MISSING and v is not None}


def _id(raw: Mapping[str, Any], key: str, index: int) -> str:
    value = _lookup(raw, key)
    return str(index) if value is _MISSING or value is None else str(value)


def _system(raw: Mapping[str, Any], key: str | None, where: str) -> str | None:
    if key is None:
        return None
    value = _lookup(raw, key)
    if value is _MISSING:
        raise DatasetError(f"{where}: no `{key}` (dataset.system_prompt_key); the record has {sorted(raw)}")
    if value is not None and not isinstance(value, str):
        raise DatasetError(f"{where}: `{key}` must be a string or null, got {type(value).__name__}")
    return value or None


# --- this actor's share, epochs


def shard(prompts: Sequence[Prompt], actor_index: int, num_actors: int) -> list[Prompt]:
    """The records of actor `actor_index` of `num_actors`: index % num_actors == actor_index."""
    if not 0 <= actor_index < num_actors:
        raise ValueError(f"actor_index={actor_index} must be in [0, num_actors={num_actors})")
    return [p for p in prompts if p.index % num_actors == actor_index]


def epoch_batches(
    prompts: Sequence[Prompt], batch_size: int, epoch: int, seed: int, shuffle: bool
) -> Iterator[list[Prompt]]:
    """One pass over `prompts` in batches of `batch_size` (the last may be short), in a per-epoch
    permutation seeded by (seed, epoch) when `shuffle`, else in order."""
    order = np.arange(len(prompts))
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(len(prompts))
    for start in range(0, len(order), batch_size):
        yield [prompts[i] for i in order[start : start + batch_size]]


# --- tokens


def chat_messages(prompt: Prompt, system_prompt: str | None) -> list[Message]:
    """The conversation the chat template renders: the record's messages (or its text as one user
    message), after the record's system prompt or else `system_prompt`, unless it starts with its own. A
    prompt with images shows them as OpenAI content parts (`{"type": "image"}`, which a vision-language
    model's template renders as its image placeholder): at its `<image>` placeholders, or before the
    first user message's text when it has none (verl's layout)."""
    messages = list(prompt.messages or [{"role": "user", "content": prompt.text}])
    if prompt.images:
        messages = _with_image_parts(messages, len(prompt.images))
    system = prompt.system if prompt.system is not None else system_prompt
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _with_image_parts(messages: list[Message], n: int) -> list[Message]:
    """`messages` with `n` image parts: each `<image>` placeholder of a string content becomes one, or
    (none anywhere) all `n` go before the first user message's text."""
    holes = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m["content"], str))
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str) and (IMAGE_PLACEHOLDER in content or (not holes and m["role"] == "user")):
            pieces = content.split(IMAGE_PLACEHOLDER) if holes else ["", content]
            parts: list[dict[str, Any]] = []
            for k, piece in enumerate(pieces):
                if k:
                    parts.extend([{"type": "image"}] * (1 if holes else n))
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = {**m, "content": parts}
            holes = holes or -1  # the images placed: later user messages keep their text
        out.append(m)
    return out


def uses_chat_template(tokenizer: PreTrainedTokenizerBase, chat_template: bool | None) -> bool:
    """`dataset.chat_template` resolved against the tokenizer: None = whether it has a chat template;
    True with a tokenizer that has none is a `DatasetError`."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template is None:
        return has
    if chat_template and not has:
        raise DatasetError(
            "dataset.chat_template is true but the tokenizer has no chat template: an Instruct model's is in "
            "its chat_template.jinja (or tokenizer_config.json's `chat_template`), copy it into the model "
            "folder; set dataset.chat_template to false only for a base model's raw-text prompts"
        )
    return chat_template


def render(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, chat_template: bool | None, system_prompt: str | None
) -> str:
    """The prompt as the model reads it: the raw text, or the chat template's rendering (with the
    generation prompt); `chat_template` as `uses_chat_template` resolves it. Chat messages without the
    chat template are a `DatasetError`."""
    if not uses_chat_template(tokenizer, chat_template):
        if prompt.messages is not None:
            raise DatasetError(
                f"prompt {prompt.prompt_id} is chat messages, which only a chat template can render: "
                "set dataset.chat_template: true with a tokenizer that has one"
            )
        return prompt.text
    return tokenizer.apply_chat_template(
        chat_messages(prompt, system_prompt), tokenize=False, add_generation_prompt=True
    )


def encode(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, chat_template: bool | None, system_prompt: str | None
) -> list[int]:
    """Token ids of a prompt: the raw text (with the tokenizer's special tokens), or the chat template's
    rendering (which has its own)."""
    templated = uses_chat_template(tokenizer, chat_template)
    if prompt.images and not templated:
        raise DatasetError(
            f"prompt {prompt.prompt_id} shows images, which only a chat template places: set "
            "dataset.chat_template: true with a vision-language model's tokenizer"
        )
    text = render(tokenizer, prompt, templated, system_prompt)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
