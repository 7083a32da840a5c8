"""The quickstart's toy datasets (jsonl), small enough for a tiny random character-level model to learn:

- `write_target_token_dataset`: prompts whose reward (`target_token_share`) is the share of a target
  character in the completion (the single-turn toy task, and the guessing game's secret character);
- `write_sums_dataset`: prompts holding a sum `a+b` and its result as the answer (the calculator
  environment, `actors/rollout/environments.py`);
- `write_colour_squares_dataset`: prompts showing a square of one of three colours, the answer its
  initial (`target_token_share` reads it: the reward needs the image; `offpolicy quickstart --task vision`);
- `square_png`, `image_question_ids`: a drawn square's PNG and a question about images as a
  vision-language model's chat template renders it (the vision tests and benchmarks/vision.py).
"""

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


def write_sums_dataset(path: str | Path, num_prompts: int = 64, seed: int = 0, max_operand: int = 9) -> Path:
    """Write `num_prompts` records `{"id", "prompt": "What is 3+8?", "answer": "11"}` to `path` (jsonl);
    return it.

    Both operands are drawn uniformly from 1..`max_operand` (seeded). At the default 9 every result has
    one or two digits and more than half of them hold a 1, so the calculator's reward (the share of the
    answer's characters that are digits of the result) is within reach of the tiny model in ~20 learner
    steps (tests/e2e/test_environment_learns.py).
    """
    if max_operand < 1:
        raise ValueError(f"max_operand={max_operand} must be >= 1")
    rng = np.random.default_rng(seed)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for i in range(num_prompts):
            a, b = (int(x) for x in rng.integers(1, max_operand + 1, size=2))
            record = {"id": f"sum-{i}", "prompt": f"What is {a}+{b}?", "answer": str(a + b)}
            fh.write(json.dumps(record) + "\n")
    return out


def square_png(
    rgb: tuple[int, int, int], width: int, height: int | None = None, noise: int | None = None
) -> bytes:
    """A PNG (Pillow) of a square of colour `rgb` on grey, or on random pixels drawn with seed `noise` (so
    that the PNG does not compress to almost nothing)."""
    import io

    from PIL import Image, ImageDraw

    h = height or width
    if noise is None:
        img = Image.new("RGB", (width, h), (128, 128, 128))
    else:
        img = Image.fromarray(np.random.default_rng(noise).integers(0, 256, (h, width, 3), dtype=np.uint8))
    ImageDraw.Draw(img).rectangle((width // 4, h // 4, 3 * width // 4, 3 * h // 4), fill=rgb)
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def image_question_ids(tokenizer, n_images: int, question: str) -> list[int]:
    """Token ids of one user message showing `n_images` images, then `question`, through the tokenizer's
    chat template (one image placeholder each: the engine widens them), with the assistant's opening."""
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


COLOURS = {"r": (220, 40, 40), "g": (40, 180, 40), "b": (40, 40, 220)}
"""The vision toy's colours by the letter that answers them."""
_VISION_TEMPLATES = (
    "<image>The square's colour, by its letter: ",
    "<image>Colour? ",
    "<image>Which colour is it? ",
)


def write_colour_squares_dataset(path: str | Path, num_prompts: int = 48, seed: int = 0) -> Path:
    """Write `num_prompts` records `{"id", "prompt", "answer": letter, "images": ["images/<i>.png"]}` to
    `path` (jsonl; the PNGs beside it, 56x56: 4 image tokens for the tiny Qwen2.5-VL) and return it. Each
    image is a square of one of `COLOURS` at a random place and size, the answer its letter: the prompt
    never names it, so a policy above 1/3 of the reward reads the image."""
    rng = np.random.default_rng(seed)
    out = Path(path)
    images = out.parent / "images"
    images.mkdir(parents=True, exist_ok=True)
    letters = list(COLOURS)
    with out.open("w") as fh:
        for i in range(num_prompts):
            letter = letters[i % len(letters)]
            name = f"images/{i}.png"
            (out.parent / name).write_bytes(_square_at(COLOURS[letter], rng))
            record = {
                "id": f"colour-{i}",
                "prompt": _VISION_TEMPLATES[int(rng.integers(len(_VISION_TEMPLATES)))],
                "answer": letter,
                "images": [name],
            }
            fh.write(json.dumps(record) + "\n")
    return out


def _square_at(rgb: tuple[int, int, int], rng: np.random.Generator, px: int = 56) -> bytes:
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (px, px), (128, 128, 128))
    side = int(rng.integers(px // 3, px - 4))
    x, y = (int(rng.integers(0, px - side + 1)) for _ in range(2))
    ImageDraw.Draw(img).rectangle((x, y, x + side - 1, y + side - 1), fill=rgb)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
