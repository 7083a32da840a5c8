"""The actor's prompt source (`dataset` of actors/config): which file or hub dataset, its columns, the chat
template, splits and shuffling (actors/data/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from offpolicy.config.base import MAX_COUNT, ConfigModel, PathStr
from offpolicy.config.vision import VisionConfig

_KEY = r"^[^.\s][^\s]*$"  # a column name or a dotted path into nested objects


class DatasetConfig(ConfigModel):
    """Where prompts come from, which columns hold what, and how prompts reach the model.

    Presets for the layouts users bring (docs/actor.md "Datasets"): `DatasetConfig.verl(path)` (verl's
    parquet: `prompt` messages, `reward_model.ground_truth`) and `DatasetConfig.trl(path)` (TRL's
    conversational prompt-only layout), or `preset: verl` in YAML; the defaults read plain `{"prompt",
    "answer", "metadata", "id"}`.
    """

    renamed_keys: ClassVar[Mapping[str, str]] = {
        "prompts_per_batch": "prompts are admitted one at a time up to the actor's `max_inflight_prompts`; "
        "remove the key"
    }

    path: PathStr
    """A `.jsonl` or `.parquet` file, a folder written by `datasets`' `save_to_disk`, or a Hugging Face
    hub id (`openai/gsm8k`; read with `datasets.load_dataset`, only when `path` is neither a file nor a
    folder: needs the `hf` extra)."""
    split: str | None = Field(None, min_length=1, max_length=256)
    """The split of a `DatasetDict` folder or a hub dataset (`train`); None = its only split (more than
    one is an error that lists them)."""
    prompt_key: str = Field("prompt", pattern=_KEY, max_length=256)
    """The column (or dotted path) of the prompt: a non-empty string, or a list of chat messages
    (`{"role", "content"}`; needs `chat_template`)."""
    answer_key: str = Field("answer", pattern=_KEY, max_length=256)
    """The column (or dotted path, e.g. `reward_model.ground_truth`) of the reference answer the reward
    reads; a record without it has none (None)."""
    metadata_keys: list[Annotated[str, Field(pattern=_KEY, max_length=256)]] | None = Field(
        None, max_length=64
    )
    """Columns (or dotted paths) copied into each group's metadata under their own names, as strings,
    each required; None = the record's `metadata` object, if any."""
    id_key: str = Field("id", pattern=_KEY, max_length=256)
    """The column (or dotted path) of the record's id; a record without it gets its index."""
    system_prompt_key: str | None = Field(None, pattern=_KEY, max_length=256)
    """The column (or dotted path) of a per-record system prompt (string or null), used instead of
    `system_prompt`; None = `system_prompt` for every record."""
    chat_template: bool | None = None
    """True = render each prompt with the tokenizer's chat template (a string prompt as one user message);
    False = the prompt's text as it is (chat-message prompts are then refused); None = the chat template
    when the tokenizer has one (instruct models), the text otherwise."""
    system_prompt: str | None = Field(None, max_length=65_536)
    """System message put first when `chat_template` is on and neither the record (`system_prompt_key`)
    nor its conversation has one (at most 65,536 characters); None = none."""
    shuffle: bool = True
    """Reshuffle this actor's shard at the start of every epoch (seeded by `seed` and the epoch)."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seed of the per-epoch shuffle."""
    max_epochs: int | None = Field(None, ge=1, le=MAX_COUNT)
    """Stop after this many passes over the shard; None = run until stopped."""
    optional_metadata_keys: list[Annotated[str, Field(pattern=_KEY, max_length=256)]] = Field(
        default_factory=list, max_length=64
    )
    """Columns (or dotted paths) copied into the metadata as `metadata_keys` are, when a record has them
    (objects as JSON); none = nothing more."""
    image_key: str | None = Field(None, pattern=_KEY, max_length=256)
    """The column (or dotted path) of a record's images (one, or a list): bytes, `{bytes, path}` as
    `datasets` stores an `Image`, a path relative to the dataset's folder, or a `data:` URL
    (actors/data/images.py); a record without it has none. The prompt's `<image>` placeholders, when it has
    any, must match their count. None = text only (the `verl` and `trl` presets read `images`)."""
    vision: VisionConfig = VisionConfig()
    """What each image may be (size, format, count per prompt); a record whose image is refused is left
    out, named with the image's key and index (config/vision.py)."""
    preset: Literal["plain", "verl", "trl"] | None = None
    """A layout's keys by name, as `DatasetConfig.verl` / `.trl` set them (`preset: verl` in YAML); keys
    given beside it win. None = the keys as given."""

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("preset") in DATASET_PRESETS:
            return DATASET_PRESETS[data["preset"]] | dict(data)
        return data  # an unknown preset name: the `preset` field refuses it

    @classmethod
    def plain(cls, path: str, **overrides: Any) -> DatasetConfig:
        """Records `{"prompt": str, "answer", "metadata": {...}, "id"}`: the defaults."""
        return cls(**({"path": path} | overrides))

    @classmethod
    def verl(cls, path: str, **overrides: Any) -> DatasetConfig:
        """verl's RL parquet (`data_source`, `prompt` messages, `reward_model: {style, ground_truth}`, and
        when present `ability`, `extra_info: {split, index, ...}`), e.g. its GSM8K and MATH preprocessing.
        `data_source` and `extra_info` go into the metadata: what verl's `compute_score` reads."""
        return cls(**({"path": path, "preset": "verl"} | overrides))

    @classmethod
    def trl(cls, path: str, **overrides: Any) -> DatasetConfig:
        """TRL's conversational prompt-only layout (`prompt`: a list of messages) with the answer in an
        extra column, `answer` here (`answer_key: solution` for datasets that call it that;
        `answer_key: completion` for the prompt-completion layout)."""
        return cls(**({"path": path, "preset": "trl"} | overrides))


DATASET_PRESETS: dict[str, dict[str, Any]] = {
    "plain": {},
    "verl": {
        "answer_key": "reward_model.ground_truth",
        "metadata_keys": ["data_source"],
        "optional_metadata_keys": ["ability", "extra_info"],
        "id_key": "extra_info.index",
        "chat_template": True,
        "image_key": "images",
    },
    "trl": {"chat_template": True, "image_key": "images"},
}
"""The keys each `DatasetConfig.preset` sets (keys given beside it win)."""
