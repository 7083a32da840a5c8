"""Prompts: read a jsonl/parquet dataset, take this actor's shard, reshuffle per epoch, tokenize.

A record has `prompt` (str), optional `answer` (str), `metadata` (a flat mapping, values kept as
strings) and `id` (default: the record's index in the file). Actor `i` of `N` takes the records whose
index is `i` modulo `N`, so the actors together cover every record exactly once per epoch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.errors import DatasetError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class Prompt:
    """One dataset record."""

    index: int  # position in the dataset file
    prompt_id: str  # `id` of the record, or its index
    text: str
    answer: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


def _record(index: int, raw: Any, where: str) -> Prompt:
    if not isinstance(raw, Mapping):
        raise DatasetError(f"{where}: a record must be an object, got {type(raw).__name__}")
    text = raw.get("prompt")
    if not isinstance(text, str) or not text:
        raise DatasetError(f"{where}: `prompt` must be a non-empty string, got {text!r}")
    answer = raw.get("answer")
    meta = raw.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise DatasetError(f"{where}: `metadata` must be an object, got {type(meta).__name__}")
    metadata = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    rid = raw.get("id")
    return Prompt(
        index=index,
        prompt_id=str(index if rid is None else rid),
        text=text,
        answer=None if answer is None else str(answer),
        metadata=metadata,
    )


def load_prompts(path: str | Path) -> list[Prompt]:
    """Every record of a `.jsonl` or `.parquet` file, in file order; `DatasetError` names the bad one."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset {p} does not exist")
    if p.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"{p}:{n}", json.loads(line)))
                except ValueError as e:
                    raise DatasetError(f"{p}:{n}: not JSON: {e}") from e
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [(f"{p} row {i}", r) for i, r in enumerate(pq.read_table(p).to_pylist())]
    else:
        raise DatasetError(f"dataset {p}: expected a .jsonl or .parquet file")
    if not rows:
        raise DatasetError(f"dataset {p} has no records")
    return [_record(i, raw, where) for i, (where, raw) in enumerate(rows)]


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


def encode(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, chat_template: bool, system_prompt: str | None
) -> list[int]:
    """Token ids of a prompt: the raw text, or the text as a user message in the chat template."""
    if not chat_template:
        return list(tokenizer(prompt.text, add_special_tokens=True)["input_ids"])
    messages = [{"role": "user", "content": prompt.text}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
