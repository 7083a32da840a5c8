"""A LoRA learner's published version (`lora:` set): the adapter alone, as peft saves it and vLLM loads it
(`adapter_model.safetensors` under peft's names, `adapter_config.json`, `manifest.json`), a policy record
of kind `lora`, written by the trainer's path (`Persistence.publish` on one process) and checked by the
actors' verification as any version is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from offpolicy.actors.errors import WeightLoadError
from offpolicy.actors.transport.verify import verify_folder
from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.config.lora import LoraConfig
from offpolicy.learner.metrics import LearnerMetrics
from offpolicy.learner.model import lora, make_tiny_model
from offpolicy.learner.persist.durable_writes import Persistence
from offpolicy.learner.persist.file_generation import WeightsSnapshot, publish_weights, write_version
from offpolicy.weights.manifest import file_sha256, read_manifest
from offpolicy.weights.record import PolicyRecord

LORA = LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "down_proj"])
FILES = {"adapter_model.safetensors", "adapter_config.json", "manifest.json"}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=64, num_heads=1, num_layers=2)


def adapted(base: Path, seed: int = 0) -> torch.nn.Module:
    """The base model with the adapter injected and its B factors moved off zero (not the base)."""
    model = lora.inject(AutoModelForCausalLM.from_pretrained(base), LORA, seed=3)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


class _Store:
    """The policy store's two calls, in memory."""

    def __init__(self, record: PolicyRecord | None = None) -> None:
        self.record = record

    def publish(self, record: PolicyRecord) -> int:
        self.record = record
        return 0

    def read(self) -> PolicyRecord | None:
        return self.record


def test_the_adapter_folder_holds_the_adapter_as_peft_names_it_and_its_config(base, tmp_path):
    model = adapted(base)
    record = publish_weights(model, tmp_path / "w", 1, lora=LORA, base_model=str(base), dtype=torch.bfloat16)
    folder = Path(record.weights_uri)
    assert record.kind == "lora" and {p.name for p in folder.iterdir()} == FILES  # no config, no tokenizer
    tensors = load_file(folder / "adapter_model.safetensors")
    names = lora.adapter_names(model)
    assert len(names) == 2 * 3 * 2  # A and B of 3 modules in 2 layers
    state = model.state_dict()
    assert set(tensors) == {lora.published_name(n) for n in names}
    for name in names:
        got = tensors[lora.published_name(name)]
        assert got.dtype == torch.bfloat16 and torch.equal(got, state[name].to(torch.bfloat16))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    doc = json.loads((folder / "adapter_config.json").read_text())
    assert doc["peft_type"] == "LORA" and doc["r"] == 8 and doc["lora_alpha"] == 16.0
    assert doc["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert doc["base_model_name_or_path"] == str(base) and doc["bias"] == "none"
    manifest = read_manifest(folder)
    assert set(manifest["files"]) == FILES - {"manifest.json"}
    assert record.sha256 == manifest["sha256"] == file_sha256(folder / "adapter_model.safetensors")
    for mode in ("manifest", "full"):  # the actors' checks pass as for any version
        assert verify_folder(folder, record.sha256, 1, mode) == mode
    with (folder / "adapter_config.json").open("a") as fh:
        fh.write(" ")  # a changed file: its size no longer matches the manifest
    with pytest.raises(WeightLoadError, match="checksum"):
        verify_folder(folder, record.sha256, 1, "manifest")


def test_peft_loads_the_published_adapter_and_computes_the_learners_outputs(base, tmp_path):
    """The folder is a peft adapter: `PeftModel.from_pretrained` on the base gives the adapted logits."""
    from peft import PeftModel

    model = adapted(base).eval()
    record = publish_weights(model, tmp_path / "w", 2, lora=LORA, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), record.weights_uri).eval()
    ids = torch.tensor([[5, 9, 11, 3, 7, 2]])
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3  # the adapter is not the base


def test_the_trainers_path_publishes_the_adapter_with_a_lora_record(base, tmp_path):
    """One process: `Persistence.publish` snapshots the adapter's tensors alone and the writer writes the
    adapter folder; the record says `lora`. A full-weights record of the same version is not ours."""
    model = adapted(base)
    config = LearnerConfig.model_validate(
        {"model_path": str(base), "lora": LORA.model_dump(), "publish": {"weights_dir": str(tmp_path / "w")}}
    )
    store = _Store(PolicyRecord(0, str(tmp_path / "w" / "v0"), "0" * 64, 1.0, "full"))
    persist = Persistence(
        config,
        model,
        None,
        torch.bfloat16,
        store,
        LearnerMetrics(CollectorRegistry()),
    )
    try:
        assert persist.needs_publish(0), "a full record of the version is not the adapter's publish"
        persist.publish(1)
        persist.flush()
    finally:
        persist.close()
    record = store.record
    assert record is not None and record.kind == "lora" and record.version == 1
    folder = Path(record.weights_uri)
    assert {p.name for p in folder.iterdir()} == FILES
    assert set(load_file(folder / "adapter_model.safetensors")) == {
        lora.published_name(n) for n in lora.adapter_names(model)
    }
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    assert verify_folder(folder, record.sha256, 1, "full") == "full"


def test_base_weights_are_never_written_as_an_adapter(base, tmp_path):
    model = adapted(base)
    snap = WeightsSnapshot(
        version=1,
        tensors={"model.embed_tokens.weight": model.model.embed_tokens.weight.detach()},
        config=model.config,
        tokenizer=None,
        dtype=torch.float32,
        adapter=lora.adapter_config(LORA, model, str(base)),
    )
    with pytest.raises(ValueError, match="not its own"):
        write_version(snap, tmp_path / "w")
    assert not list((tmp_path / "w").iterdir())  # the temporary folder is gone too
