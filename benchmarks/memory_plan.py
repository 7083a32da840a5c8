"""The learner's memory plan per GPU for 1.5B, 7B and 70B models on 1 and 8 H100s (learner/plan/memory.py).

Not a measurement: the estimate the learner makes at start and refuses to run past, for the default
config on CUDA (bf16_mixed, packed micro-batches of 16,384 tokens, activation checkpointing on, LM-head
chunks of 4,096 tokens), with and without `fsdp.cpu_offload`. Model shapes are Llama-style configs of
Qwen2.5-1.5B, Qwen2.5-7B and Llama-3.1-70B, parameters counted on the meta device (nothing downloaded).
An H100 has 79.6 GiB; a plan may use 90 % of it.

    python benchmarks/memory_plan.py [--json] [--smoke] [--lora RANK]

`--json`: one object, `{"h100_gib", "headroom", "rows": [one per model, GPU count and offload]}`.
`--smoke`: the 1.5B model only (the same estimate, CI). `--lora RANK`: the learner trains a LoRA adapter of
that rank on every linear layer (`lora.target_modules: all-linear`) of the frozen model: gradients and AdamW
only for the adapter (docs/lora.md).
"""

from __future__ import annotations

import argparse
import json

from transformers import LlamaConfig

from offpolicy.learner.config import LearnerConfig
from offpolicy.learner.plan.memory import GIB, HEADROOM, ModelShape, estimate

H100_GIB = 79.6


def llama(h: int, i: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
    )  # fmt: skip


MODELS = {
    "1.5B": llama(1536, 8960, 28, 12, 2, 151936, tied=True),
    "7B": llama(3584, 18944, 28, 28, 4, 152064, tied=False),
    "70B": llama(8192, 28672, 80, 64, 8, 128256, tied=False),
}


def rows(models: list[str], lora_rank: int | None = None) -> list[dict]:
    out = []
    lora = None if lora_rank is None else {"rank": lora_rank}
    for name in models:
        hf = MODELS[name]
        for gpus, offload in ((1, False), (8, False), (8, True)):
            cfg = LearnerConfig(model_path="unused", fsdp={"cpu_offload": offload}, lora=lora)
            shape = ModelShape.of(hf, cfg.lora)
            plan = estimate(cfg, shape, gpus, sharded=gpus > 1, checkpointing=True, cuda=True)
            out.append(
                {
                    "model": name,
                    "params_b": shape.params / 1e9,
                    "lora_rank": lora_rank,
                    "adapter_params_m": shape.adapter / 1e6 if lora_rank else 0.0,
                    "gpus": gpus,
                    "cpu_offload": offload,
                    **{f"{k}_gib": round(v, 1) for k, v in plan.as_dict().items()},
                    "fits": plan.total <= HEADROOM * H100_GIB * GIB,
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the 1.5B model only (CI)")
    ap.add_argument("--lora", type=int, metavar="RANK", help="a LoRA adapter of this rank, the model frozen")
    args = ap.parse_args()
    table = rows(["1.5B"] if args.smoke else list(MODELS), args.lora)
    if args.json:
        print(json.dumps({"h100_gib": H100_GIB, "headroom": HEADROOM, "rows": table}))
        return
    head = ("model", "H100s", "cpu_offload", "weights+grads+AdamW", "bf16 copies", "activations",
            "LM-head chunk",
            "total per GPU", "fits")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for r in table:
        states = r["weights_gib"] + r["gradients_gib"] + r["optimizer_gib"]
        cells = (
            f"{r['model']} ({r['params_b']:.1f}B)", r["gpus"], "yes" if r["cpu_offload"] else "no",
            f"{states:.1f}",
            f"{r['compute_copies_gib']:.1f}", f"{r['activations_gib']:.1f}", f"{r['lm_head_chunk_gib']:.1f}",
            f"{r['total_gib']:.1f} GiB", "✔" if r["fits"] else "✘",
        )  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
