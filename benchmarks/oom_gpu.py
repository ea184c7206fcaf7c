"""A real out-of-memory error on one GPU, recovered: the learned micro-batch and its throughput.

A GPT-2-style model built from a config (no download) with a long sequence overflows the card at the
starting micro-batch. With ``"max_micro_batch_per_gpu": "auto"`` the runtime halves on the OOM, bisects
upward and settles; then a sweep of fixed micro-batches (``recover_from_oom: false``) finds the best
one by hand. Run on one CUDA GPU (single process, world 1)::

    python benchmarks/oom_gpu.py                      # GPT-2 medium-ish, seq 2048, global batch 128
    python benchmarks/oom_gpu.py --layers 12 --hidden 768 --heads 12 --seq 1024   # smaller card
    python benchmarks/oom_gpu.py --no-predict-peak    # the 'auto' run without the peak predictor

Writes ``benchmarks/results/oom_gpu/results.json`` and ``summary.md`` (a markdown table). Without a GPU,
``--simulate-budget N`` replaces the real OOM by ``ds_adabatch.testing.simulated_memory_limit(N)`` on a
tiny model (a smoke test of this script; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
for key, value in (
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29555"),
    ("RANK", "0"),
    ("WORLD_SIZE", "1"),
):
    os.environ.setdefault(key, value)
os.environ.setdefault("LOCAL_RANK", "0")

import torch  # noqa: E402

import ds_adabatch  # noqa: E402
from ds_adabatch.runtime.memory.oom import is_out_of_memory  # noqa: E402
from ds_adabatch.testing import simulated_memory_limit  # noqa: E402


class RandomTokens(torch.utils.data.Dataset):
    """Deterministic random token windows (throughput does not depend on the text)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=g)
        return {"input_ids": ids, "labels": ids}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.seq,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def ds_config(args: argparse.Namespace, max_micro: int | str, recover: bool) -> dict:
    memory: dict = {"recover_from_oom": recover}
    if max_micro == "auto":
        memory.update(
            micro_batch_ceiling=args.global_batch,
            grow_after_steps=args.grow_after,
            predict_peak=not args.no_predict_peak,
        )
    return {
        # torch_adam: torch's fused AdamW, no DeepSpeed op to compile first.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "bf16": {"enabled": torch.cuda.is_available()},
        "zero_optimization": {"stage": args.zero},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "adabatch": {
            "schedule": {"type": "constant", "value": args.global_batch},
            "max_micro_batch_per_gpu": max_micro,
            "allow_uneven": True,
            "memory": memory,
        },
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args: argparse.Namespace, data, max_micro: int | str, steps: int, recover: bool) -> dict:
    """``steps`` optimizer steps; per-step micro-batch and time. Raises on an OOM when not recovering."""
    engine, *_ = ds_adabatch.initialize(build_model(args), ds_config(args, max_micro, recover), data)
    rows = []
    try:
        for _ in range(steps):
            sync()
            t = time.perf_counter()
            engine.train_batch()
            sync()
            rows.append(
                {
                    "micro": engine.plan.micro_batch_per_gpu,
                    "gas": engine.plan.gradient_accumulation_steps,
                    "limit": engine.micro_batch_limit,
                    "oom_retries": int(engine.last_metrics.extra["oom_retries"]),
                    "seconds": time.perf_counter() - t,
                }
            )
        events = [e.to_dict() for e in engine.history]
    finally:
        engine.close()
        engine.destroy() if hasattr(engine, "destroy") else None
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"rows": rows, "history": events}


def throughput(rows: list[dict], global_batch: int, last: int) -> float:
    """Samples per second over the median of the last ``last`` steps."""
    return global_batch / statistics.median(r["seconds"] for r in rows[-last:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--global-batch", type=int, default=128, help="samples per optimizer step")
    p.add_argument("--zero", type=int, default=2, help="ZeRO stage")
    p.add_argument("--auto-steps", type=int, default=30, help="optimizer steps of the 'auto' run")
    p.add_argument("--grow-after", type=int, default=3, help="memory.grow_after_steps of the 'auto' run")
    p.add_argument("--sweep", default="8,12,16,20,24,28,32,40,48", help="fixed micro-batches to try")
    p.add_argument("--sweep-steps", type=int, default=6, help="steps per fixed micro-batch (first 2 warm-up)")
    p.add_argument("--simulate-budget", type=int, default=None, help="CPU smoke test: simulated budget")
    p.add_argument(
        "--no-predict-peak",
        action="store_true",
        help="the 'auto' run without memory.predict_peak (compare its OOMs with the default run's)",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "oom_gpu"))
    args = p.parse_args()
    if args.simulate_budget is not None:
        args.layers, args.hidden, args.heads, args.seq, args.vocab = 2, 64, 2, 32, 256
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/oom_gpu.py needs a CUDA GPU (or --simulate-budget N for a CPU smoke test)")

    ds_adabatch.init_distributed()
    n = args.global_batch * max(args.auto_steps, args.sweep_steps)
    data = RandomTokens(n, args.seq, args.vocab)
    budget = simulated_memory_limit(args.simulate_budget or 10**9).install() if args.simulate_budget else None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (simulated budget)"

    auto = run(args, data, "auto", args.auto_steps, recover=True)
    micros = [r["micro"] for r in auto["rows"]]
    settled = micros[-1]
    last = max(3, args.auto_steps // 3)
    auto_tput = throughput(auto["rows"], args.global_batch, last)

    sweep = []
    for m in (int(x) for x in args.sweep.split(",")):
        if m > args.global_batch:
            continue
        try:
            result = run(args, data, m, args.sweep_steps, recover=False)
        except Exception as exc:  # noqa: BLE001 - an OOM (or an OOM-caused error) marks the size as too big
            if not is_out_of_memory(exc):
                raise
            sweep.append({"micro": m, "oom": True})
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        tput = throughput(result["rows"], args.global_batch, max(1, args.sweep_steps - 2))
        sweep.append({"micro": m, "oom": False, "samples_per_s": tput})
    fitting = [s for s in sweep if not s["oom"]]
    best = max(fitting, key=lambda s: s["samples_per_s"]) if fitting else None
    if budget is not None:
        budget.remove()

    results = {
        "device": device,
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "vocab")},
        "global_batch": args.global_batch,
        "zero": args.zero,
        "auto": {
            "micro_per_step": micros,
            "limit_per_step": [r["limit"] for r in auto["rows"]],
            "oom_retries_per_step": [r["oom_retries"] for r in auto["rows"]],
            "settled_micro": settled,
            "samples_per_s_last_steps": auto_tput,
            "history": auto["history"],
        },
        "sweep": sweep,
        "best_fixed": best,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    ooms = sum(r["oom_retries"] for r in auto["rows"])
    lines = [
        f"{device}; GPT-2-style {args.layers} layers x {args.hidden}, seq {args.seq}; global batch "
        f"{args.global_batch}; ZeRO-{args.zero}, bf16 on GPU",
        "",
        "| run | micro-batch | samples/s | note |",
        "|---|---|---|---|",
        f"| 'auto' (starts at {args.global_batch}) | {settled} (per step: {', '.join(map(str, micros))}) | "
        f"{auto_tput:.2f} | {ooms} OOMs recovered; median of the last {last} steps |",
    ]
    for s in sweep:
        if s["oom"]:
            lines.append(f"| fixed | {s['micro']} | - | out of memory |")
        else:
            mark = " (best)" if best is s else ""
            lines.append(f"| fixed | {s['micro']} | {s['samples_per_s']:.2f} | {mark.strip()} |")
    if best is not None:
        lines += ["", f"'auto' / best fixed throughput: {auto_tput / best['samples_per_s']:.3f}"]
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
    ds_adabatch.finish()
