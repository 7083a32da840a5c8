"""Reward functions: the built-ins, the `length_penalty` wrapper, lookup by name or dotted path, scoring.

A reward function is `fn(completion: str, answer: str | None, metadata: dict[str, str]) -> float`.
`score` calls one and translates anything it raises (or a non-finite / non-numeric result) into
`RewardError`, which the rollout loop counts as a failed group instead of crashing.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Mapping

from actors.errors import RewardError

RewardFn = Callable[[str, str | None, Mapping[str, str]], float]

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"^(-?)\\d?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TOLERANCE = 1e-6


# --- built-ins


def exact_match(completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """1.0 when the completion equals the answer after stripping surrounding whitespace, else 0.0."""
    return 1.0 if completion.strip() == _require_answer(answer, "exact_match").strip() else 0.0


def math_answer(completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """1.0 when the completion's final answer equals `answer` numerically (relative tolerance 1e-6).

    The final answer is the content of the last `\\boxed{...}` if there is one, else the last number in
    the text (integers, decimals, `1,000`, `a/b`, `\\frac{a}{b}`). No number in the completion is 0.0;
    an `answer` that is not a number is a data error (`RewardError`).
    """
    expected = parse_number(_require_answer(answer, "math_answer"))
    if expected is None:
        raise RewardError(f"math_answer: the answer {answer!r} is not a number")
    got = final_answer(completion)
    if got is None:
        return 0.0
    return 1.0 if abs(got - expected) <= _TOLERANCE * max(1.0, abs(expected)) else 0.0


def target_token_share(completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """The toy task: the share of the completion's characters covered by the target string (0..1).

    The target is `answer`, or `metadata["target"]`; an empty completion scores 0.0. With a character
    tokenizer and a one-character target this is the share of generated tokens equal to the target token.
    """
    target = answer if answer is not None else metadata.get("target")
    if not target:
        raise RewardError("target_token_share: no target (neither `answer` nor metadata['target'])")
    if not completion:
        return 0.0
    return completion.count(target) * len(target) / len(completion)


BUILTINS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math_answer": math_answer,
    "target_token_share": target_token_share,
}


def length_penalty(fn: RewardFn, coef: float, max_chars: int) -> RewardFn:
    """`fn` minus `coef * min(len(completion), max_chars) / max_chars` (longer answers cost up to `coef`)."""

    def penalized(completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
        return fn(completion, answer, metadata) - coef * min(len(completion), max_chars) / max_chars

    penalized.__name__ = f"length_penalty({getattr(fn, '__name__', 'reward')})"
    return penalized


# --- lookup and scoring


def resolve_reward(name: str, length_coef: float | None = None, length_max_chars: int = 1024) -> RewardFn:
    """The built-in `name`, or the function at dotted path `pkg.mod.fn`; wrapped in `length_penalty`
    when `length_coef` is set. An unknown name fails here, at start-up, not in the loop."""
    if name in BUILTINS:
        fn = BUILTINS[name]
    elif "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {name!r}: cannot import {attr!r} from {module_name!r}: {e}") from e
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
    else:
        raise ValueError(f"unknown reward {name!r}; built-ins: {sorted(BUILTINS)} or a dotted path")
    return fn if length_coef is None else length_penalty(fn, length_coef, length_max_chars)


def score(fn: RewardFn, completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """`fn(...)` as a finite float; anything else (an exception included) raises `RewardError`."""
    try:
        value = fn(completion, answer, metadata)
    except Exception as e:  # translated: a user reward function may raise anything
        raise RewardError(f"{getattr(fn, '__name__', fn)!s} raised {type(e).__name__}: {e}") from e
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(f"{getattr(fn, '__name__', fn)!s} returned {value!r}, not a finite number")
    return float(value)


# --- parsing numbers


def _require_answer(answer: str | None, who: str) -> str:
    if answer is None:
        raise RewardError(f"{who}: the prompt has no `answer`")
    return answer


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed); None when there is none or it is
    unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def parse_number(text: str) -> float | None:
    """A number written as `42`, `-3.5`, `1,000`, `3/4`, `\\frac{3}{4}`, `$5`, `50%`->50; else None."""
    s = text.strip().strip("$").replace(" ", "").replace("\\!", "").rstrip(".").rstrip("%")
    frac = _FRAC.match(s)
    if frac:
        sign, num, den = frac.groups()
        n, d = parse_number(num), parse_number(den)
        return None if n is None or d in (None, 0.0) else (-1.0 if sign else 1.0) * n / d
    if not re.fullmatch(_NUMBER, s):
        return None
    s = s.replace(",", "")
    if "/" in s:
        num, den = s.split("/")
        return None if float(den) == 0.0 else float(num) / float(den)
    return float(s)


def final_answer(completion: str) -> float | None:
    """The number a completion ends on: its last `\\boxed{}` if any, else its last number."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return parse_number(boxed)
    found = _NUMBER.findall(completion)
    return parse_number(found[-1]) if found else None
