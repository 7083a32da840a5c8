"""`make_tiny_model` and `offpolicy make-tiny-model DIR`: a random Llama with head_dim 64 and a character
tokenizer that transformers loads from disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from offpolicy.learner.model.tiny import CHARACTERS, SPECIAL_TOKENS, make_tiny_model

TEXT = "Hello, world! 1 + 2 = 3\n\tok ~{}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_loads_in_transformers_with_head_dim_64(tiny: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny)
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert cfg.head_dim == 64
    assert cfg.vocab_size == len(SPECIAL_TOKENS) + len(CHARACTERS) == 4 + 97  # printable ASCII - \r\v\f
    ids = torch.tensor([[1, 40, 41, 42]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 4, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    assert (tiny / "model.safetensors").exists()


def test_tokenizer_round_trips_text(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT)  # one id per character
    assert tok.decode(ids) == TEXT
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", "</s>")
    assert tok.convert_tokens_to_ids(list("ab")) == [4 + CHARACTERS.index("a"), 4 + CHARACTERS.index("b")]


def test_head_dim_other_than_64_or_128_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim = hidden_size / num_heads = 32"):
        make_tiny_model(tmp_path / "m", hidden_size=64, num_heads=2)


def test_cli_make_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    cli = Path(sys.executable).with_name("offpolicy")
    done = subprocess.run(
        [str(cli), "make-tiny-model", str(out), "--seed", "3"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert f"tiny model written to {out}" in done.stdout
    assert json.loads((out / "config.json").read_text())["head_dim"] == 64
    assert AutoTokenizer.from_pretrained(out).decode([4 + CHARACTERS.index("x")]) == "x"
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 2
