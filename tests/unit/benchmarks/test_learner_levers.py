"""benchmarks/learner_levers.py's runner without the runs: `--lever-rows` runs the chosen rows alone, each
with the levers of every row before it; each finished row reaches stderr as it ends (a GPU run cut by its
time limit keeps them); an out-of-memory row is reported and the next runs; `--profile` is the last run
row's. The runs themselves: tests/integration/benchmarks/test_learner_levers.py."""

from __future__ import annotations

import argparse
import json

import torch

import learner_levers

FLAGS = ("attention", "logprob_head", "gradient_checkpointing", "micro_batch_tokens", "compile_layers")


def args(**kw) -> argparse.Namespace:
    base = {"shape": "longtail-4b", "smoke": True, "device": "cuda", "model_dir": "/m", "profile": True,
            "lever_rows": None, "attention": None, "logprob_head": None, "gradient_checkpointing": None,
            "micro_batch_tokens": None, "no_grad_micro_batch_tokens": None,
            "compile_layers": False}  # fmt: skip
    return argparse.Namespace(**(base | kw))


def fake_runs(monkeypatch, oom: bool = False, broken: int | None = None) -> list[dict]:
    """`run_shape` replaced: it records the lever flags of each run; with `oom` the first run fails; the
    run numbered `broken` raises some other error."""
    seen: list[dict] = []

    def run_shape(flags):
        seen.append({k: getattr(flags, k) for k in (*FLAGS, "profile")})
        if len(seen) == 1 and oom:
            raise torch.OutOfMemoryError("CUDA out of memory")
        if len(seen) == broken:
            raise RuntimeError("inductor: a kernel failed to build")
        return (
            {k: 1.0 for k in learner_levers.LEVER_KEYS}
            | {"settings": {}, "device": "cuda"}
            | ({"profile": {"kinds": {}}} if flags.profile else {})
        )

    monkeypatch.setattr(learner_levers, "run_shape", run_shape)
    return seen


def test_chosen_rows_run_alone_with_the_levers_before_them(monkeypatch, capsys):
    seen = fake_runs(monkeypatch)
    out = learner_levers.run_levers(args(lever_rows=[0, 5]))
    assert [r["lever"] for r in out["levers"]] == ["baseline", "+ compiled layers"]
    base, compiled = seen
    assert base["attention"] == "sdpa_varlen" and base["logprob_head"] == "chunked" and not base["profile"]
    # row 5 carries rows 1-4's levers: auto attention, the fused head, auto checkpointing and budgets
    assert compiled == {"attention": None, "logprob_head": None, "gradient_checkpointing": "auto",
                        "micro_batch_tokens": "auto", "compile_layers": True, "profile": True}  # fmt: skip
    assert out["profile"] == {"kinds": {}}
    lines = [json.loads(line.removeprefix("lever row: ")) for line in capsys.readouterr().err.splitlines()
             if line.startswith("lever row: ")]  # fmt: skip
    assert [r["lever"] for r in lines] == ["baseline", "+ compiled layers"]


def test_every_row_by_default_and_an_out_of_memory_row_is_reported(monkeypatch):
    seen = fake_runs(monkeypatch, oom=True)
    out = learner_levers.run_levers(args())
    assert len(seen) == len(learner_levers.LEVERS)
    assert out["levers"][0]["error"].startswith("out of memory") and "error" not in out["levers"][1]
    assert [s["profile"] for s in seen] == [False] * (len(seen) - 1) + [True]


def test_a_row_that_breaks_otherwise_is_reported_and_the_rest_still_run(monkeypatch, capsys):
    seen = fake_runs(monkeypatch, broken=2)
    out = learner_levers.run_levers(args())
    assert len(seen) == len(learner_levers.LEVERS)
    assert out["levers"][1]["error"] == "RuntimeError: inductor: a kernel failed to build"
    assert all("error" not in r for i, r in enumerate(out["levers"]) if i != 1)
    err = capsys.readouterr().err
    assert "Traceback" in err and '"error": "RuntimeError: inductor' in err
    assert out["mfu"] == 1.0 and out["profile"] == {"kinds": {}}
