"""benchmarks/learning_signal.py's help says the defaults the experiment runs with: every "(default X)" of
its command line is `Setup`'s value of that flag (`--groups-per-step` and `--n` said 8 after the defaults
became 4 x 4)."""

from __future__ import annotations

import re

import learning_signal

DEFAULT = re.compile(r"\(default ([^;)]+)")


def test_every_default_in_the_help_is_the_setups():
    setup = learning_signal.Setup()
    checked = []
    for action in learning_signal.build_parser()._actions:
        said = DEFAULT.search(action.help or "")
        if said is None or not hasattr(setup, action.dest):
            continue
        value = getattr(setup, action.dest)
        if action.dest == "arms":
            assert said.group(1) == "all" and value == learning_signal.ARMS
        elif isinstance(value, tuple):
            assert said.group(1) == " ".join(map(str, value)), action.dest
        else:
            assert float(said.group(1)) == value, action.dest
        checked.append(action.dest)
    assert {"groups_per_step", "n", "seeds", "steps", "lr", "threshold", "distill_steps"} <= set(checked)
