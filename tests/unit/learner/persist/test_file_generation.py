"""Published weights (streamed safetensors, manifest, shards, tied weights, publish dtype) and the
background writer's rules (one write at a time, coalescing, failures re-raised in the caller)."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from offpolicy.learner.errors import WriteFailed
from offpolicy.learner.model import load_tokenizer, make_tiny_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.persist import file_generation as weights_mod
from offpolicy.learner.persist.file_generation import (
    WeightsSnapshot,
    publish_weights,
    snapshot_to_host,
    write_version,
)
from offpolicy.learner.persist.version_folders import prune_versions, published_versions, remove_leftovers
from offpolicy.learner.persist.writer import BackgroundWriter, WeightsBuffers
from offpolicy.weights.manifest import read_manifest, weights_sha256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=64, num_heads=1, num_layers=2)
    return folder, AutoModelForCausalLM.from_pretrained(folder)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest_lists_every_file_with_its_real_size_and_sha256(tiny, tmp_path):
    folder, model = tiny
    record = publish_weights(model, tmp_path, 3, tokenizer=load_tokenizer(folder))
    out = Path(record.weights_uri)
    manifest = read_manifest(out)
    on_disk = {p.name for p in out.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and "tokenizer.json" in on_disk
    for name, entry in manifest["files"].items():
        assert entry == {"bytes": (out / name).stat().st_size, "sha256": _sha(out / name)}
    assert manifest["sha256"] == record.sha256 == weights_sha256(out)
    assert manifest["version"] == 3


def test_published_weights_load_in_transformers_in_the_publish_dtype(tiny, tmp_path):
    _, model = tiny
    record = publish_weights(model, tmp_path, 1, dtype=torch.bfloat16)
    out = Path(record.weights_uri)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_file(str(out / "model.safetensors"))
    for name, t in unique_state(model).items():
        assert loaded[name].dtype == torch.bfloat16
        torch.testing.assert_close(loaded[name], t.to(torch.bfloat16), rtol=0, atol=0)
    again = AutoModelForCausalLM.from_pretrained(out)
    assert next(again.parameters()).dtype == torch.bfloat16


def test_shards_have_an_index_and_the_record_checksum_spans_them(tiny, tmp_path):
    _, model = tiny
    snap = WeightsSnapshot(5, snapshot_to_host(unique_state(model), None), model.config, None, torch.float32)
    out = write_version(snap, tmp_path, max_shard_bytes=40_000)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(unique_state(model))
    assert read_manifest(out)["sha256"] == weights_sha256(out)
    again = AutoModelForCausalLM.from_pretrained(out)
    for name, t in again.state_dict().items():
        torch.testing.assert_close(t, model.state_dict()[name], rtol=0, atol=0)


def test_tied_weights_are_written_once_and_load_back(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = Path(publish_weights(model, tmp_path, 0).weights_uri)
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    again = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(again.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_remove_leftovers_deletes_only_hidden_temporary_folders(tmp_path):
    for name in (".tmp-v3-abc", ".old-v2-def", "v1"):
        (tmp_path / name).mkdir()
    assert sorted(remove_leftovers(tmp_path)) == [".old-v2-def", ".tmp-v3-abc"]
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]


# --- the background writer


def test_a_newer_job_replaces_the_waiting_one_and_one_write_runs_at_a_time():
    release, started = threading.Event(), threading.Event()
    ran: list[int] = []
    running = []

    def job(v):
        def write():
            running.append(v)
            assert len(running) == 1  # never two at once
            if v == 0:
                started.set()
                release.wait(10)
            ran.append(v)
            running.remove(v)

        return write

    done: list[tuple[str, int]] = []
    writer = BackgroundWriter(on_done=lambda kind, v, result, s: done.append((kind, v)))
    writer.submit("weights", 0, job(0))
    assert started.wait(10)
    for v in (1, 2, 3):  # 1 and 2 wait in turn and are replaced; 3 runs
        writer.submit("weights", v, job(v))
    writer.submit("checkpoint", 3, job(30))
    release.set()
    assert writer.flush(10)
    assert ran == [0, 3, 30] and writer.coalesced == 2
    assert done == [("weights", 0), ("weights", 3), ("checkpoint", 3)]
    writer.close(10)


def test_a_failed_write_is_raised_in_the_training_thread_once():
    writer = BackgroundWriter()

    def broken():
        raise ValueError("a bug")  # an OSError (a full disk) is retried instead: test_write_faults.py

    writer.submit("checkpoint", 7, broken)
    with pytest.raises(WriteFailed, match="checkpoint write of v7 failed: ValueError: a bug"):
        writer.flush(10)
    writer.raise_if_failed()  # reported once
    writer.close(10)


def test_weights_buffers_never_hand_out_the_set_being_written():
    release, started = threading.Event(), threading.Event()
    writer = BackgroundWriter()
    buffers = WeightsBuffers(writer)
    src = {"w": torch.ones(4)}

    first = snapshot_to_host(src, None, into=buffers.acquire())
    buffers.keep(first)

    def slow():
        started.set()
        release.wait(10)

    writer.submit("weights", 0, slow, buffers=first)
    assert started.wait(10)
    second = snapshot_to_host(src, None, into=buffers.acquire())
    buffers.keep(second)
    assert second["w"].data_ptr() != first["w"].data_ptr()
    writer.submit("weights", 1, lambda: None, buffers=second)
    third = snapshot_to_host(src, None, into=buffers.acquire())  # replaces the waiting v1: reuses its set
    assert third["w"].data_ptr() == second["w"].data_ptr() and writer.coalesced == 1
    release.set()
    writer.close(10)


def test_the_actors_verify_the_learners_manifest_without_and_with_hashing(tiny, tmp_path):
    """The manifest the learner writes is the one the actors read (actors/transport/verify.py): `manifest`
    mode
    accepts it by sizes and checksum, `full` by re-hashing; a changed byte is caught by `full`."""
    from offpolicy.actors.errors import WeightLoadError
    from offpolicy.actors.transport.verify import verify_folder

    folder, model = tiny
    record = publish_weights(model, tmp_path, 4, tokenizer=load_tokenizer(folder))
    out = Path(record.weights_uri)
    assert verify_folder(out, record.sha256, 4, "manifest") == "manifest"
    assert verify_folder(out, record.sha256, 4, "full") == "full"
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size: only hashing sees it
    (out / "model.safetensors").write_bytes(bytes(data))
    assert verify_folder(out, record.sha256, 4, "manifest") == "manifest"
    with pytest.raises(WeightLoadError, match="sha256"):
        verify_folder(out, record.sha256, 4, "full")


def test_pruning_never_leaves_a_half_deleted_version_visible(tmp_path, monkeypatch):
    """A crash in the middle of deleting an old version (here: rmtree fails after the rename) leaves no
    visible `vN` with missing files, only a hidden `.old-` folder, which the next start removes."""
    for v in (1, 2, 3):
        (tmp_path / f"v{v}").mkdir()
        (tmp_path / f"v{v}" / "model.safetensors").write_bytes(b"x")

    def crash(path, *a, **k):
        raise OSError("killed midway")

    monkeypatch.setattr(weights_mod.shutil, "rmtree", crash)
    with pytest.raises(OSError):
        prune_versions(tmp_path, keep=2)
    assert published_versions(tmp_path) == [2, 3]  # v1 is gone from view at once
    monkeypatch.undo()
    assert [n.startswith(".old-v1-") for n in remove_leftovers(tmp_path)] == [True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]
