"""`offpolicy data preview`: a dataset's first records as the actor sees them (the prompt after the chat
template, its token count, the answer, the metadata, each image's format, size and bytes), and how many
records it has, how many lack an answer, how many carry images, and each record left out for an image.
A bad file fails here, with the row and the key, before any engine starts."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from offpolicy.actors.config import DatasetConfig
from offpolicy.actors.data.prompts import encode, load_prompts, render, uses_chat_template
from offpolicy.actors.data.sources import read_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def preview(
    dataset: DatasetConfig, tokenizer: PreTrainedTokenizerBase | None = None, n: int = 3
) -> dict[str, Any]:
    """The report as data: `records`, `with_answer`, the keys used, and the first `n` records (`rendered`
    and `tokens` only with a tokenizer). Raises `DatasetError` as the actor would at start-up."""
    refused: list[str] = []
    prompts = load_prompts(dataset, refused=refused)
    first = []
    for p in prompts[:n]:
        rendered = tokens = None
        if tokenizer is not None:
            rendered = render(tokenizer, p, dataset.chat_template, dataset.system_prompt)
            tokens = len(encode(tokenizer, p, dataset.chat_template, dataset.system_prompt))
        first.append(
            {
                "index": p.index,
                "id": p.prompt_id,
                "text": p.text,
                "messages": None if p.messages is None else list(p.messages),
                "system": p.system,
                "rendered": rendered,
                "tokens": tokens,
                "answer": p.answer,
                "metadata": p.metadata,
                "images": [im.describe() for im in p.images],
            }
        )
    return {
        "path": dataset.path,
        "split": dataset.split,
        "records": len(prompts),
        "with_answer": sum(p.answer is not None for p in prompts),
        "keys": dataset.model_dump(
            include={"prompt_key", "answer_key", "metadata_keys", "id_key", "system_prompt_key", "image_key"}
        ),
        "chat_template": (
            dataset.chat_template
            if tokenizer is None
            else uses_chat_template(tokenizer, dataset.chat_template)
        ),
        "first": first,
        "with_images": sum(bool(p.images) for p in prompts),
        "images": sum(len(p.images) for p in prompts),
        "refused": refused,
        "layout_hint": layout_hint(dataset),
    }


def layout_hint(dataset: DatasetConfig, n: int = 5) -> str | None:
    """Why a dataset read with `dataset`'s keys would give no answers though its first `n` rows hold
    them in a known layout (verl's `reward_model.ground_truth`): the preset to set; None otherwise."""
    if dataset.preset == "verl" or dataset.answer_key == "reward_model.ground_truth":
        return None
    rows = [raw for _, raw in read_rows(dataset.path, dataset.split)[:n]]
    if any(isinstance(r, dict) and r.get(dataset.answer_key) is not None for r in rows):
        return None
    if rows and all(isinstance(r, dict) and isinstance(r.get("reward_model"), dict) for r in rows):
        return (
            f"the records have no `{dataset.answer_key}` (dataset.answer_key) but verl's "
            "`reward_model.ground_truth`: this is verl's layout, read it with `dataset.preset: verl` "
            "(`--preset verl`)"
        )
    return None


def format_report(report: dict[str, Any]) -> str:
    """The report as the command prints it."""
    keys = report["keys"]
    lines = [
        f"{report['path']}: {report['records']} records, {report['with_answer']} with an answer "
        f"(`{keys['answer_key']}`)",
        "keys: " + ", ".join(f"{k}={v}" for k, v in keys.items() if v is not None)
        + f", chat_template={_template(report['chat_template'])}",
    ]  # fmt: skip
    missing = report["records"] - report["with_answer"]
    if report["layout_hint"]:
        lines.append(f"WARNING: {report['layout_hint']}")
    if missing:
        lines.append(
            f"WARNING: {missing} records have no `{keys['answer_key']}`: a reward that needs an answer "
            "(math_answer, exact_match) fails on them (reason no_answer)"
        )
    if report["images"]:
        lines.append(f"images: {report['images']} in {report['with_images']} records (`{keys['image_key']}`)")
    for message in report["refused"]:
        lines.append(f"REFUSED: {message}")
    for r in report["first"]:
        lines += ["", f"--- record {r['index']} (id {r['id']})", f"text: {r['text']}"]
        if r["messages"] is not None:
            lines.append(f"messages: {json.dumps(r['messages'], ensure_ascii=False)}")
        if r["system"] is not None:
            lines.append(f"system: {r['system']}")
        if r["rendered"] is not None:
            lines += [f"rendered ({r['tokens']} tokens):", r["rendered"]]
        lines.append(f"answer: {r['answer']!r}")
        if r["metadata"]:
            lines.append(f"metadata: {json.dumps(r['metadata'], ensure_ascii=False)}")
        for k, im in enumerate(r["images"]):
            lines.append(
                f"image {k}: {im['format']} {im['width']}x{im['height']}, {im['bytes']} bytes, "
                f"sha256 {im['sha256']}"
            )
    return "\n".join(lines)


def _template(value: bool | None) -> str:
    return "auto (the tokenizer's, if it has one)" if value is None else str(value).lower()
