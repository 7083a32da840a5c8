"""The quickstart's toy task: a jsonl of prompts whose reward (`target_token_share`) is the share of a
target character in the completion, which a tiny random character-level model can learn to raise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_TEMPLATES = (
    "Write the letter {t} again and again: {r}",
    "{r}",
    "Only {t}: {r}",
    "Say {t}. {r}",
    "{t} {t} {t}, and more {t}: {r}",
)


def write_target_token_dataset(
    path: str | Path, num_prompts: int = 64, target: str = "a", seed: int = 0
) -> Path:
    """Write `num_prompts` records `{"id", "prompt", "answer": target}` to `path` (jsonl); return it.

    Prompts mix a few templates with a run of 1-8 targets, so the reward depends on the prompt a little
    and the model can pick the pattern up in a few learner steps.
    """
    if len(target) != 1:
        raise ValueError(f"target {target!r} must be one character (one token of the char tokenizer)")
    rng = np.random.default_rng(seed)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for i in range(num_prompts):
            template = _TEMPLATES[i % len(_TEMPLATES)]
            run = target * int(rng.integers(1, 9))
            record = {"id": f"toy-{i}", "prompt": template.format(t=target, r=run), "answer": target}
            fh.write(json.dumps(record) + "\n")
    return out
