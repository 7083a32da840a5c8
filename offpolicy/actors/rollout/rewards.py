"""Reward functions: the built-ins, the `length_penalty` wrapper, lookup by name or dotted path, scoring.

A reward function is `fn(completion: str, answer: str | None, metadata: dict[str, str]) -> float`.
verl's reward functions run as they are: `from_verl` calls `compute_score(data_source, solution_str,
ground_truth, extra_info)` as one (`reward.signature: verl`, or detected by `signature_of` from the
function's parameter names).
`score` calls one and translates anything it raises (or a non-finite / non-numeric result) into
`RewardError` with its reason, which the rollout loop counts as a failed group instead of crashing.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from offpolicy.actors.errors import RewardError
from offpolicy.actors.rollout.verl_scorers import import_reward_module
from offpolicy.buffer.types import REWARD_EXTRA_PREFIX

RewardFn = Callable[[str, str | None, Mapping[str, str]], float]
VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""The parameters of verl's `compute_score`, in its order."""

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
# dropped before a number is read: LaTeX spacing, `\left`/`\right`, escaped `$` and `%`, degrees
_LATEX_NOISE = re.compile(r"\\[,!;: ]|\\left|\\right|\\(?=[$%])|\^\{?\\circ\}?")
# trailing units: `\text{ cm}`, `\mbox{...}`, `\mathrm{...}` groups and plain words (`72 dollars`)
_UNITS = re.compile(r"(?:\s*\\(?:text|mbox|mathrm)\{[^{}]*\}|\s+[A-Za-z]+)+\.?\s*$")
_TEXT = re.compile(r"\\text\{[^{}]*\}")
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")  # a word outside LaTeX commands: prose, not an answer
_TOLERANCE = 1e-6


# --- built-ins


def exact_match(completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """1.0 when the completion equals the answer after stripping surrounding whitespace, else 0.0."""
    return 1.0 if completion.strip() == _require_answer(answer, "exact_match").strip() else 0.0


def math_answer(completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """1.0 when the completion's final answer equals the reference `answer`, else 0.0.

    The reference is the text after GSM8K's last `####`, else its last `\\boxed{...}`, else all of it.
    The completion's final answer is its last `\\boxed{...}` (nested braces), else the text after its
    last `####`, else its last number. Numbers are compared by `parse_number` (relative tolerance 1e-6;
    `1,234`, `$5`, `3/4`, `\\frac{3}{4}`, `\\dfrac`, `50%`, trailing units and periods); anything
    else (`\\frac{\\sqrt{2}}{2}`, `x+1`, intervals) by math-verify, symbolically. A completion with no
    final answer scores 0.0; a reference that neither reads is a data error (`RewardError`, reason
    `bad_answer`), as is a missing one (`no_answer`).
    """
    reference = reference_answer(_require_answer(answer, "math_answer"))
    expected = parse_number(reference)
    final = final_answer_text(completion)
    if expected is not None:
        got = parse_number(final) if final is not None else last_number(completion)
        if got is not None:
            return 1.0 if abs(got - expected) <= _TOLERANCE * max(1.0, abs(expected)) else 0.0
        if final is None:
            return 0.0
    # math-verify reads a stated answer as a box's content, and finds the last expression of a text itself
    return 1.0 if _symbolic_equal(reference, completion if final is None else f"\\boxed{{{final}}}") else 0.0


def target_token_share(completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """The toy task: the share of the completion's characters covered by the target string (0..1).

    The target is `answer`, or `metadata["target"]`; an empty completion scores 0.0. With a character
    tokenizer and a one-character target this is the share of generated tokens equal to the target token.
    """
    target = answer if answer is not None else metadata.get("target")
    if not target:
        raise RewardError(
            "target_token_share: no target (neither `answer` nor metadata['target'])", "no_answer"
        )
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
        value = fn(completion, answer, metadata)
        penalized_ = value - coef * min(len(completion), max_chars) / max_chars
        return Score(penalized_, value.extra) if isinstance(value, Score) else penalized_

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
            fn = getattr(import_reward_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {name!r}: cannot import {attr!r} from {module_name!r}: {e}") from e
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
    else:
        raise ValueError(f"unknown reward {name!r}; built-ins: {sorted(BUILTINS)} or a dotted path")
    return fn if length_coef is None else length_penalty(fn, length_coef, length_max_chars)


def signature_of(fn: Callable[..., Any], configured: str | None) -> str:
    """How `fn` is called: `configured`, or when None `verl` if its first parameters are named as verl's
    (`VERL_PARAMETERS`), else `text`. `text` for a function with verl's parameters is refused (it would be
    called with its arguments swapped)."""
    names = tuple(inspect.signature(fn).parameters)[: len(VERL_PARAMETERS)]
    if configured is None:
        return "verl" if names == VERL_PARAMETERS else "text"
    if configured == "text" and names == VERL_PARAMETERS:
        raise ValueError(
            f"reward {getattr(fn, '__name__', fn)!s} takes verl's ({', '.join(VERL_PARAMETERS)}): set "
            "reward.signature: verl (or leave it null), not text"
        )
    return configured


def from_verl(fn: Callable[..., Any]) -> Callable[..., Any]:
    """verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` as a reward function
    `(completion, answer, metadata)`: the answer is the ground truth, `metadata["data_source"]` the data
    source (None without one), `metadata["extra_info"]` decoded from JSON (`DatasetConfig.verl` stores the
    object so; None without one). Its result may be a number or verl's `{"score": ..., ...}`: the score."""

    def args(completion: str, answer: str | None, metadata: Mapping[str, str]) -> tuple[Any, ...]:
        extra = metadata.get("extra_info")
        return metadata.get("data_source"), completion, answer, None if extra is None else _json(extra)

    if inspect.iscoroutinefunction(fn):

        async def acall(completion: str, answer: str | None, metadata: Mapping[str, str]) -> Any:
            return _verl_score(await fn(*args(completion, answer, metadata)))

        reward: Callable[..., Any] = acall
    else:

        def call(completion: str, answer: str | None, metadata: Mapping[str, str]) -> Any:
            return _verl_score(fn(*args(completion, answer, metadata)))

        reward = call
    reward.__name__ = f"verl({getattr(fn, '__name__', 'compute_score')})"
    return reward


class Score(float):
    """A reward with the named figures a verl reward returned beside its `score` (`{"score": 1.0, "acc":
    True}`: `extra == {"acc": 1.0}`): each finite number or bool, the rest (a parsed answer's text) left
    out. Behaves as the float it is everywhere else."""

    __slots__ = ("extra",)

    def __new__(cls, value: float, extra: dict[str, float]) -> Score:
        out = super().__new__(cls, value)
        out.extra = extra
        return out


def extra_means(rewards: Sequence[float]) -> dict[str, float]:
    """Each extra figure's mean over the completions whose `Score` has it; {} without a `Score`."""
    sums: dict[str, list[float]] = {}
    for r in rewards:
        for key, value in getattr(r, "extra", {}).items():
            sums.setdefault(key, []).append(value)
    return {key: sum(v) / len(v) for key, v in sorted(sums.items())}


def reward_extras(rewards: Sequence[float]) -> dict[str, str]:
    """The group metadata of its rewards' extra figures (`{"reward_extra/acc": "0.6"}`: `extra_means`)."""
    return {f"{REWARD_EXTRA_PREFIX}{key}": repr(mean) for key, mean in extra_means(rewards).items()}


def _verl_score(value: Any) -> Any:
    """verl's result as a reward: a number as it is, `{"score": s, ...}` as `s` with its other numbers."""
    if not (isinstance(value, Mapping) and "score" in value):
        return value
    score_, extra = value["score"], {}
    for key, v in value.items():
        if key != "score" and isinstance(v, numbers.Real) and math.isfinite(v):
            extra[str(key)] = float(v)
    finite = isinstance(score_, numbers.Real) and not isinstance(score_, bool) and math.isfinite(score_)
    return Score(score_, extra) if extra and finite else score_


def _json(text: str) -> Any:
    """A metadata value as verl stored it: the decoded JSON of an object, else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def score(fn: RewardFn, completion: str, answer: str | None, metadata: Mapping[str, str]) -> float:
    """`fn(...)` as a finite float; anything else (an exception included) raises `RewardError`."""
    try:
        value = fn(completion, answer, metadata)
    except RewardError:
        raise  # already says why (`no_answer`, `bad_answer`, ...)
    except Exception as e:  # translated: a user reward function may raise anything
        raise RewardError(f"{getattr(fn, '__name__', fn)!s} raised {type(e).__name__}: {e}") from e
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(
            f"{getattr(fn, '__name__', fn)!s} returned {value!r}, not a finite number", reason="not_finite"
        )
    return value if isinstance(value, Score) else float(value)


# --- parsing answers


def _require_answer(answer: str | None, who: str) -> str:
    if answer is None:
        raise RewardError(f"{who}: the prompt has no `answer`", reason="no_answer")
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


def after_hashes(text: str) -> str | None:
    """GSM8K's final answer: the first line after the last `####`; None when there is none."""
    _, found, tail = text.rpartition("####")
    return tail.strip().split("\n", 1)[0].strip() if found else None


def reference_answer(answer: str) -> str:
    """The part of a reference answer to compare: after its last `####` (a GSM8K solution), else its last
    `\\boxed{}`, else all of it."""
    tail = after_hashes(answer)
    if tail is not None:
        return tail
    boxed = last_boxed(answer)
    return answer.strip() if boxed is None else boxed


def final_answer_text(completion: str) -> str | None:
    """The completion's stated final answer: its last `\\boxed{}`, else after its last `####`; None
    when it states neither (the last number is then its answer: `last_number`)."""
    boxed = last_boxed(completion)
    return boxed if boxed is not None else after_hashes(completion)


def parse_number(text: str) -> float | None:
    """A number written as `42`, `-3.5`, `1,000`, `3/4`, `\\frac{3}{4}`, `\\dfrac{3}{4}`, `$5`, `\\$5`,
    `50%`->50, `72 dollars`, `5\\text{ cm}`, `7.`; else None."""
    s = _UNITS.sub("", _LATEX_NOISE.sub("", text)).strip().strip("$").replace(" ", "").rstrip(".").rstrip("%")
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


def last_number(text: str) -> float | None:
    """The last number written in `text` (`1,234` as one number); None when there is none."""
    found = _NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def final_answer(completion: str) -> float | None:
    """The number a completion ends on: its final answer (`final_answer_text`) as a number, else its
    last number."""
    final = final_answer_text(completion)
    return parse_number(final) if final is not None else last_number(completion)


def _symbolic_equal(reference: str, prediction: str) -> bool:
    """math-verify's verdict on a reference answer (read as a box's content) that is not a plain number,
    or on a prediction that is not one. Its signal-based timeouts work only on the main thread, so they
    are off: the group's `reward.timeout_s` bounds a slow comparison instead."""
    from math_verify import parse, verify  # sympy: imported on the first non-numeric answer only

    gold = (
        []
        if _PROSE.search(_TEXT.sub("", reference))
        else parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
    )
    if not gold:
        raise RewardError(
            f"math_answer: the answer {reference!r} is not a number, nor an expression math-verify reads",
            reason="bad_answer",
        )
    return bool(verify(gold, parse(prediction, parsing_timeout=None), timeout_seconds=None))
