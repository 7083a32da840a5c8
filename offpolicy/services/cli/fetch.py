"""`offpolicy fetch-model [MODEL]`: a hub model into the Hugging Face cache once, before the services start.

The compose stack's `model-fetch` runs it (the learner's image, the `hf-cache` volume) and the learner and
the actors start after it succeeded: the first start of a 15 GB model downloads it once, outside every
health check's start period, instead of in each service at once. A model that is a folder here needs
nothing (exit 0); a hub id is downloaded with its weights, config and tokenizer files (`HF_TOKEN` for a
gated one); a failure says why and exits 1, so no service starts on a model it cannot load.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
"""What the learner and vLLM read of a model: weights, configs, tokenizer files and chat templates."""


def fetch_model(model: str) -> int:
    """Download `model` (a hub id) into the cache; 0 when it is there (or a folder), 1 when it cannot be."""
    if Path(model).is_dir():
        print(f"{model}: a folder here, nothing to fetch")
        return 0
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(model, allow_patterns=PATTERNS)
    except Exception as e:  # a bad id, the network, 401 / 404: each said, then exit 1
        print(f"{model}: cannot fetch it into the cache: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"{model}: in the cache at {folder}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    model = args.model or os.environ.get("OFFPOLICY_MODEL_PATH")
    if not model:
        print("fetch-model: name the model (or set OFFPOLICY_MODEL_PATH)", file=sys.stderr)
        return 2
    return fetch_model(model)


def add_fetch_parser(sub: argparse._SubParsersAction) -> None:
    """`offpolicy fetch-model [MODEL]`."""
    fetch = sub.add_parser(
        "fetch-model",
        help="download a hub model into the Hugging Face cache once (compose's model-fetch)",
        description=__doc__.split("\n\n", 1)[1].strip(),
    )
    fetch.add_argument("model", nargs="?", help="a hub id or a folder (default: $OFFPOLICY_MODEL_PATH)")
    fetch.set_defaults(func=_fetch)
