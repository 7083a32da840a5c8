"""A prompt's images as users' datasets hold them (verl's multimodal parquet, jsonl with files beside it,
data URLs): read and checked per record; a corrupt, oversized, remote, unsupported or misplaced image
leaves its record out, named with the image's key and index, and the rest of the dataset is read on."""

from __future__ import annotations

import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from pydantic import ValidationError

from offpolicy.actors.config import DatasetConfig
from offpolicy.actors.data.preview import format_report, preview
from offpolicy.actors.data.prompts import load_prompts, text_only
from offpolicy.actors.errors import DatasetError
from offpolicy.config.vision import VisionConfig


def _png(colour: str = "red", size: tuple[int, int] = (32, 24), fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return out.getvalue()


def _verl_parquet(path, images: list[list[bytes]]) -> None:
    """verl's multimodal layout: chat `prompt` with `<image>` placeholders, `images` as `datasets` writes an
    `Image` feature (a list of {bytes, path}), `reward_model.ground_truth`, `extra_info.index`."""
    n = len(images)
    table = pa.table({
        "data_source": ["geo3k"] * n,
        "prompt": [[{"role": "user", "content": "<image>" * len(ims) + f"What colour is shape {i}?"}]
                   for i, ims in enumerate(images)],
        "images": [[{"bytes": b, "path": None} for b in ims] for ims in images],
        "reward_model": [{"style": "rule", "ground_truth": "red"}] * n,
        "extra_info": [{"split": "train", "index": i} for i in range(n)],
    })  # fmt: skip
    pq.write_table(table, path)


def test_a_verl_multimodal_parquet_reads_its_images_and_leaves_out_a_corrupt_one(tmp_path):
    path = tmp_path / "train.parquet"
    corrupt = _png()[:60]  # a truncated PNG
    _verl_parquet(path, [[_png()], [_png("blue"), _png("green", (8, 8))], [corrupt], [_png()]])
    refused: list[str] = []
    prompts = load_prompts(DatasetConfig.verl(str(path)), refused=refused)
    assert [p.prompt_id for p in prompts] == ["0", "1", "3"]  # record 2 alone is left out
    assert [len(p.images) for p in prompts] == [1, 2, 1]
    im = prompts[1].images[1]
    assert (im.format, im.width, im.height, im.data) == ("PNG", 8, 8, _png("green", (8, 8)))
    assert prompts[0].images[0].sha256 == prompts[2].images[0].sha256  # the same bytes, one address
    (message,) = refused
    assert "row 2" in message and "`images` image 0" in message and "decode" in message
    report = preview(DatasetConfig.verl(str(path)))
    assert report["records"] == 3 and report["with_images"] == 3 and report["images"] == 4
    text = format_report(report)
    assert "images: 4 in 3 records (`images`)" in text and "image 1: PNG 8x8" in text
    assert "REFUSED:" in text and "`images` image 0" in text


def test_jsonl_images_by_path_or_data_url_and_each_refusal_named(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png())
    (tmp_path / "img" / "b.tiff").write_bytes(_png(fmt="TIFF"))
    url = "data:image/png;base64," + base64.b64encode(_png("blue")).decode()
    rows = [
        {"prompt": "<image> colour?", "images": ["img/a.png"], "answer": "red"},
        {"prompt": "colour?", "images": url, "answer": "blue"},  # one image, no placeholder: first
        {"prompt": "<image> colour?", "images": ["img/b.tiff"]},  # not an accepted format
        {"prompt": "<image> colour?", "images": ["https://example.com/x.png"]},  # never fetched
        {"prompt": "<image> colour?", "images": ["img/missing.png"]},
        {"prompt": "<image><image> colour?", "images": ["img/a.png"]},  # two placeholders, one image
        {"prompt": "colour?", "images": ["data:image/png;base64,!!"]},
        {"prompt": "colour?"},  # no images: a text record
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    refused: list[str] = []
    cfg = DatasetConfig(path=str(path), image_key="images", vision={"max_image_bytes": 10_000})
    prompts = load_prompts(cfg, refused=refused)
    assert [p.index for p in prompts] == [0, 1, 7]
    assert [len(p.images) for p in prompts] == [1, 1, 0]
    reasons = "\n".join(refused)
    for expected in (
        "format TIFF",
        "a remote URL",
        "cannot read",
        "2 <image> placeholder(s) for 1",
        "base64",
    ):
        assert expected in reasons, expected
    big = DatasetConfig(path=str(path), image_key="images", vision={"max_image_bytes": 50})
    with pytest.raises(DatasetError, match=r"bytes > dataset\.vision\.max_image_bytes 50"):
        load_prompts(big, limit=1)


def test_a_dataset_whose_every_record_is_refused_fails_and_the_actor_refuses_images_it_cannot_send(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "<image> x", "images": ["nope.png"]}))
    with pytest.raises(DatasetError, match="every record was left out"):
        load_prompts(DatasetConfig(path=str(path), image_key="images"))
    (tmp_path / "a.png").write_bytes(_png())
    path.write_text(json.dumps({"prompt": "<image> x", "images": ["a.png"]}))
    prompts = load_prompts(DatasetConfig(path=str(path), image_key="images"))
    with pytest.raises(DatasetError, match="not a vision-language one"):
        text_only(prompts, str(path))
    assert text_only(prompts, str(path), vision=True)[0].images == prompts[0].images  # a VL model takes them
    assert text_only(load_prompts(DatasetConfig(path=str(path))), str(path))[0].images == ()  # image_key null


def test_images_become_content_parts_at_their_placeholders_or_first(tmp_path):
    from offpolicy.actors.data.prompts import chat_messages

    (tmp_path / "a.png").write_bytes(_png())
    path = tmp_path / "d.jsonl"
    rows = [
        {"prompt": "look <image> then <image>!", "images": ["a.png", "a.png"]},
        {"prompt": [{"role": "user", "content": "what colour?"}], "images": ["a.png"]},
        {"prompt": "plain"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    placed, first, plain = load_prompts(DatasetConfig(path=str(path), image_key="images"))
    image = {"type": "image"}
    assert chat_messages(placed, None) == [
        {"role": "user", "content": [
            {"type": "text", "text": "look "}, image, {"type": "text", "text": " then "}, image,
            {"type": "text", "text": "!"},
        ]},
    ]  # fmt: skip
    assert chat_messages(first, "sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [image, {"type": "text", "text": "what colour?"}]},
    ]
    assert chat_messages(plain, None) == [{"role": "user", "content": "plain"}]


def test_the_image_count_is_bounded_and_the_limits_checked(tmp_path):
    with pytest.raises(ValidationError, match="formats"):
        VisionConfig(formats=["TIFF"])
    (tmp_path / "a.png").write_bytes(_png())
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "x", "images": ["a.png"] * 3}) + "\n" + json.dumps({"prompt": "y"}))
    refused: list[str] = []
    cfg = DatasetConfig(path=str(path), image_key="images", vision={"max_images": 2})
    assert [p.index for p in load_prompts(cfg, refused=refused)] == [1]
    assert "3 images > dataset.vision.max_images" in refused[0]


def test_the_pixel_budget_is_checked_and_shared_by_engine_and_learner():
    from offpolicy.actors.config import EngineConfig
    from offpolicy.config.vision import ImagePixels
    from offpolicy.learner.config import LearnerConfig

    with pytest.raises(ValidationError, match="min_pixels=4000 exceeds max_pixels=3136"):
        ImagePixels(min_pixels=4000, max_pixels=3136)
    with pytest.raises(ValidationError, match="max_pixels"):
        ImagePixels(max_pixels=100)  # below one 28 x 28 token
    assert ImagePixels().processor_kwargs() == {}
    assert EngineConfig(image_pixels={"max_pixels": 3136}).image_pixels.processor_kwargs() == {
        "max_pixels": 3136
    }
    learner = LearnerConfig(model_path="m", image_pixels={"min_pixels": 784, "max_pixels": 3136})
    assert learner.image_pixels.processor_kwargs() == {"min_pixels": 784, "max_pixels": 3136}
