"""Delta versions (`publish.delta`): bytes of a delta version over a full one, and what it costs to make
and to apply, on a model trained with AdamW at RL learning rates.

    python benchmarks/weight_delta.py [--json] [--smoke] [--layers 2] [--versions 4] [--lrs 1e-6,1e-5]

The model: the widths of a 1.3B-class model (hidden 1536, MLP 8960, 12 heads / 2 KV heads, vocabulary
151,936; `--layers` of its 28 decoder layers, 2 by default, ~0.56B parameters: AdamW's fp32 state for the
whole 28 layers, 24 GB, does not fit this 2-core, 24 GiB machine; the embedding and head, the largest
tensors, are whole). Initialised as `make_tiny_model` does (normal, std 0.02), trained in fp32 with AdamW
(betas 0.9 / 0.999, no weight decay) on real next-token losses over random tokens (4 x 64 tokens a step),
published in bf16 after every step, `--versions` versions per learning rate:

- the learner (learner/persist/delta_versions.py): version 0 whole, then deltas (`publish.delta: on`);
  `encode_s` the write of a delta version (encode, hash each tensor, write, fsync) against `full_write_s`,
  the write of the same weights whole; `delta_bytes_share` the delta folder's weight files (`delta.*`)
  over the full version's `*.safetensors`; `changed_value_share` the bf16 values that changed;
- the actor (actors/transport/delta_chain.py): `apply_s` building the full folder from its copy of the
  previous version and the delta (read, verify, apply, hash each tensor, write), against
  `full_prepare_s`, the default prefetch of a full version (read every file once, check the manifest);
  `bit_equal`: the built folder holds exactly the learner's bf16 weights of that version.

- the transfer engine (weights/engines/delta_rounds.py, `engine`): the same versions through the `gloo`
  engine pair over a real two-rank gloo group in this process (the learner's trainer engine on one thread,
  a worker engine on another), each version sent twice: as a delta round against the previous version
  (`delta_bytes_share`: the bytes broadcast over a whole round's; `encode_s` the learner's encoding and
  checksums; `apply_s` the worker's receive, apply, checksums and load: its part of the engine's pause),
  then whole (`full_s`: the worker's receive and load of a whole round, the pause without deltas);
  `bit_equal`: the worker loaded exactly the learner's bf16 weights. The worker's model is a stand-in
  whose `load_weights` copies each tensor (vLLM's loaders into a live engine are what
  tests/integration/weights/test_transfer_delta.py runs: the engine then generates as from the files).

Medians over the versions after the first. Not measured here: the files path's engine pause (the engine
loads a full folder either way, the built one from local disk: unchanged by delta, `pause_note`), and the
`nccl` engine (deltas through it are not built). Target: `delta_bytes_share` <= 0.1 at lr 1e-6 (`target`),
against a full version of the same weights.

`--smoke`: the tiny Llama (hidden 128, 2 layers), 2 versions, both learning rates (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from offpolicy.actors.config import ReloadConfig
from offpolicy.actors.transport.delta_chain import DeltaChain
from offpolicy.actors.transport.prefetch import prefetch_folder
from offpolicy.learner.model import make_tiny_model
from offpolicy.learner.model.load import unique_state
from offpolicy.learner.persist.delta_versions import DeltaVersions
from offpolicy.learner.persist.file_generation import publish_weights
from offpolicy.learner.persist.version_folders import version_dir

SHAPES = {
    "1.3b-width": {"hidden_size": 1536, "num_heads": 12, "num_kv_heads": 2, "intermediate_size": 8960,
                   "vocab_size": 151936},
    "tiny": {"hidden_size": 128, "num_heads": 2, "intermediate_size": 256},
}  # fmt: skip
TARGET = 0.1
BUCKET = 512 << 20  # transfer.bucket_bytes' default
BATCH, SEQ = 4, 64


def _bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: t.detach().to(torch.bfloat16) for k, t in unique_state(model).items()}


def _bytes(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern))


def _bit_equal(folder: Path, want: dict[str, torch.Tensor]) -> bool:
    from safetensors.torch import load_file

    got: dict[str, torch.Tensor] = {}
    for f in folder.glob("*.safetensors"):
        got |= load_file(f)
    return sorted(got) == sorted(want) and all(
        torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want
    )


class EnginePair:
    """The gloo engine pair over a real two-rank group in this process: the learner's trainer engine (rank
    0, with `publish.delta: on`'s `DeltaSends`) and one worker engine (rank 1) whose model records what it
    loads; the trainer's client runs the worker's calls in line, as vLLM's would in the engine process."""

    def __init__(self) -> None:
        import socket
        import threading

        from offpolicy.weights.engines.delta_rounds import DeltaSends, RoundBase
        from offpolicy.weights.engines.gloo import (
            GlooTrainerWeightTransferEngine,
            GlooWeightTransferEngine,
            init_group,
        )

        class Loads(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weights: dict[str, torch.Tensor] = {}

            def load_weights(self, pairs):
                for name, t in pairs:
                    kept = self.weights.get(name)
                    if kept is None:
                        self.weights[name] = t.clone()
                    else:
                        kept.copy_(t)

        self.state: dict[str, torch.Tensor] = {}
        pair = self

        class Source:
            def metadata(self):
                from vllm.distributed.weight_transfer.base import ParamMeta

                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in pair.state.items()]

            def __iter__(self):
                return iter(pair.state.items())

        worker = object.__new__(GlooWeightTransferEngine)
        worker.model, worker.device, worker.base = Loads(), torch.device("cpu"), RoundBase()
        worker.bucket_bytes, worker.group = BUCKET, None
        worker.model_config = None
        self.worker, self.apply_s = worker, 0.0

        class Client:
            def init_weight_transfer_engine(self, info) -> None:
                pass

            def start_weight_update(self) -> None:
                pass

            def update_weights(self, info) -> None:
                t0 = time.perf_counter()
                worker.receive_weights(worker.parse_update_info(info))
                pair.apply_s = time.perf_counter() - t0

            def finish_weight_update(self, weight_version=None) -> None:
                pass

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        joined = threading.Thread(
            target=lambda: setattr(worker, "group", init_group("127.0.0.1", port, 1, 2, 120.0))
        )
        joined.start()
        self.trainer = GlooTrainerWeightTransferEngine(client=Client(), source=Source(), bucket_bytes=BUCKET)
        self.trainer.group = init_group("127.0.0.1", port, 0, 2, 120.0)
        joined.join()
        self.sends = DeltaSends("on", full_every=10**6, share=1.0)
        self.trainer.delta = self.sends

    def send(self, state: dict[str, torch.Tensor], whole: bool) -> dict:
        """Send `state` as a round (whole: the base dropped first); what it cost and whether it arrived."""
        self.state = state
        if whole:
            self.sends.drop()
        t0 = time.perf_counter()
        self.trainer.send_weights()
        seconds = time.perf_counter() - t0
        got = self.worker.model.weights
        return {
            "kind": self.sends.last_kind,
            "bytes": self.sends.last_bytes,
            "full_bytes": self.sends.last_full_bytes,
            "send_s": seconds,
            "apply_s": self.apply_s,
            "bit_equal": sorted(got) == sorted(state)
            and all(torch.equal(got[k].view(torch.int16), t.view(torch.int16)) for k, t in state.items()),
        }

    def close(self) -> None:
        self.trainer.shutdown()
        self.worker.shutdown()


def run_lr(model_dir: Path, work: Path, lr: float, versions: int, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    deltas = DeltaVersions("on", full_every=10**6, share=1.0)
    wdir, full_dir = work / f"lr{lr:g}", work / f"lr{lr:g}-full"
    actor = DeltaChain(work / f"actor-{lr:g}")
    rows = []
    publish_weights(model, wdir, 0, dtype=torch.bfloat16, keep_versions=2, delta=deltas)
    engine = EnginePair()
    engine.send(_bf16(model), whole=True)  # the group's first round
    for v in range(1, versions + 1):
        tokens = torch.randint(0, vocab, (BATCH, SEQ))
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        record = publish_weights(model, wdir, v, dtype=torch.bfloat16, keep_versions=2, delta=deltas)
        encode_s = time.perf_counter() - t0
        folder = version_dir(wdir, v)
        t0 = time.perf_counter()
        full_record = publish_weights(model, full_dir, v, dtype=torch.bfloat16, keep_versions=1)
        full_write_s = time.perf_counter() - t0
        full_folder = version_dir(full_dir, v)
        t0 = time.perf_counter()
        built = actor.build(folder, record.sha256, v)
        apply_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        prefetch_folder(full_folder, full_record.sha256, v, ReloadConfig(prefetch="page_cache"))
        full_prepare_s = time.perf_counter() - t0
        want = _bf16(model)
        sent = engine.send(want, whole=False)
        whole = engine.send(want, whole=True)
        rows.append({
            "version": v,
            "delta_bytes_share": _bytes(folder, "delta.*") / _bytes(full_folder, "*.safetensors"),
            "changed_value_share": deltas.last["changed_share"],
            "encode_s": encode_s,
            "full_write_s": full_write_s,
            "apply_s": apply_s,
            "full_prepare_s": full_prepare_s,
            "bit_equal": _bit_equal(built.folder, want),
            "loss": float(loss.detach()),
            "engine": {
                "kind": sent["kind"],
                "delta_bytes_share": sent["bytes"] / sent["full_bytes"],
                "encode_s": sent["send_s"] - sent["apply_s"],
                "apply_s": sent["apply_s"],
                "full_s": whole["apply_s"],
                "bit_equal": sent["bit_equal"] and whole["bit_equal"] and whole["kind"] == "full",
            },
        })  # fmt: skip
        actor.keep_only(built.folder)
    engine.close()
    shutil.rmtree(wdir, ignore_errors=True)
    shutil.rmtree(full_dir, ignore_errors=True)
    shutil.rmtree(actor.root, ignore_errors=True)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def emed(key: str) -> float:
        return statistics.median(r["engine"][key] for r in rows)

    return {
        "lr": lr,
        "params": sum(p.numel() for p in model.parameters()),
        "delta_bytes_share": med("delta_bytes_share"),
        "delta_bytes_share_max": max(r["delta_bytes_share"] for r in rows),
        "changed_value_share": med("changed_value_share"),
        "encode_s": med("encode_s"),
        "full_write_s": med("full_write_s"),
        "apply_s": med("apply_s"),
        "full_prepare_s": med("full_prepare_s"),
        "bit_equal": all(r["bit_equal"] for r in rows),
        "engine": {
            "delta_bytes_share": emed("delta_bytes_share"),
            "delta_bytes_share_max": max(r["engine"]["delta_bytes_share"] for r in rows),
            "delta_rounds": sum(r["engine"]["kind"] == "delta" for r in rows),
            "encode_s": emed("encode_s"),
            "apply_s": emed("apply_s"),
            "full_s": emed("full_s"),
            "bit_equal": all(r["engine"]["bit_equal"] for r in rows),
        },
        "versions": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.3b-width")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2 of the 1.3B's 28)")
    ap.add_argument("--versions", type=int, default=4, help="delta versions per learning rate")
    ap.add_argument("--lrs", default="1e-6,1e-5", help="learning rates, comma-separated")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the tiny Llama, 2 versions (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.versions = "tiny", 2
    torch.set_num_threads(os.cpu_count() or 1)
    lrs = [float(x) for x in args.lrs.split(",")]
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model_dir = make_tiny_model(work / "model", num_layers=args.layers, **shape)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_dir)
        runs = [run_lr(model_dir, work, lr, args.versions, cfg.vocab_size) for lr in lrs]
    first = runs[0]
    out = {
        "shape": args.shape,
        "layers": args.layers,
        "params": runs[0]["params"],
        "versions": args.versions,
        "runs": runs,
        "lr": first["lr"],
        "delta_bytes_share": first["delta_bytes_share"],
        "changed_value_share": first["changed_value_share"],
        "encode_s": first["encode_s"],
        "apply_s": first["apply_s"],
        "bit_equal": all(r["bit_equal"] for r in runs),
        "target": TARGET,
        "engine": first["engine"] | {"bit_equal": all(r["engine"]["bit_equal"] for r in runs)},
        "engine_note": "gloo engine pair, worker model a recording stand-in; nccl: deltas not built",
        "pause_note": "files path: unchanged by delta, the engine loads a full folder either way (built "
        "locally); engine path: apply_s (delta) against full_s (whole), the worker's part of the pause",
        "load_avg_1m": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(out), flush=True)  # flushed: the process may end without its buffers flushed
        return
    print(f"{args.shape} x {args.layers} layers ({out['params'] / 1e6:.0f}M parameters), bf16 versions")
    for r in runs:
        print(
            f"  lr {r['lr']:g}: delta {r['delta_bytes_share']:.4f} of a full version (max "
            f"{r['delta_bytes_share_max']:.4f}), {r['changed_value_share']:.4f} of values changed; write "
            f"{r['encode_s']:.2f} s (whole: {r['full_write_s']:.2f} s); actor build {r['apply_s']:.2f} s "
            f"(full prefetch: {r['full_prepare_s']:.2f} s); bit-equal {r['bit_equal']}"
        )
        e = r["engine"]
        print(
            f"    engine (gloo): delta round {e['delta_bytes_share']:.4f} of a whole one (max "
            f"{e['delta_bytes_share_max']:.4f}, {e['delta_rounds']} delta rounds); encode "
            f"{e['encode_s']:.2f} s; worker {e['apply_s']:.2f} s (whole round: {e['full_s']:.2f} s); "
            f"bit-equal {e['bit_equal']}"
        )
    print(f"  target: delta_bytes_share <= {TARGET} at lr {first['lr']:g}", flush=True)


if __name__ == "__main__":
    main()
