"""Token-budget micro-batches against fixed-sample micro-batches on a heavy-tailed corpus.

Corpus: the paragraphs (blank-line separated blocks) of the Python standard library's ``.py`` files, 16 to
1024 bytes each, one token per byte; nothing is downloaded. Both sides train the same global batches in
tokens: a step of about ``--step-tokens`` tokens on ``--world`` ranks, with a peak of ``--budget`` tokens
per forward pass.

- fixed: micro-batches of ``budget // longest`` samples (sized so the longest sample fits the same peak),
  each padded to its own longest sample, ``ceil(samples / (world x micro))`` passes per step;
- tokens: ``micro_batch_tokens = budget`` (``pad_to_longest``), with and without a ``bucket_window``.

``count`` (default) measures what does not depend on the machine: padding fraction (padded tokens /
processed tokens, zero-weight pad passes included) and forward passes per rank per step. ``train`` also
runs both on ``--world`` gloo ranks with a small transformer and reports tokens/s and peak RSS; run it on
an idle machine. ``goodput`` trains the same model with the ``goodput`` schedule over token-budget steps
(from ``--first-batch`` samples, at most ``--max-batch``, measured step times) and reports its plan changes and,
before every step, the passes its throughput model expected the step to take against those it took.

Usage::

    python benchmarks/token_budget.py                              # count, writes results/token_budget.json
    python benchmarks/token_budget.py train --steps 30             # tokens/s on 2 CPU ranks (idle machine)
    python benchmarks/token_budget.py deepspeed --budget 4096      # against DeepSpeed's dynamic batching
    python benchmarks/token_budget.py goodput --steps 150 --budget 4096   # goodput over token steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["corpus", "main"]

HERE = Path(__file__).parent


def corpus(low: int = 16, high: int = 1024) -> list[bytes]:
    """Paragraphs of the standard library's sources with ``low <= len <= high`` bytes, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_bytes()
        except OSError:
            continue
        for block in text.split(b"\n\n"):
            block = block.strip(b"\n")
            if low <= len(block) <= high:
                out.append(block)
    return out


def _fixed_steps(lengths: np.ndarray, steps: int, step_tokens: int, world: int, budget: int, seed: int):
    """Fixed-sample baseline: same global order, same mean tokens per step, micro sized for the longest."""
    from ds_adabatch.data import epoch_order

    micro = max(1, budget // int(lengths.max()))
    per_step = max(1, round(step_tokens / float(lengths.mean())))
    order = epoch_order(len(lengths), seed=seed, epoch=0, shuffle=True)
    real = processed = passes_total = 0
    for s in range(steps):
        idx = order.take(s * per_step, (s + 1) * per_step)
        lens = lengths[idx]
        passes = -(-len(idx) // (world * micro))
        # Slots step-major as BatchPlan lays them out; an empty slot runs a one-sample pad.
        for k in range(passes * world):
            chunk = lens[k * micro : (k + 1) * micro]
            processed += len(chunk) * int(chunk.max()) if len(chunk) else int(lens.min())
        real += int(lens.sum())
        passes_total += passes
    return {"micro_batch_samples": micro, "samples_per_step": per_step, "real": real, "processed": processed,
            "passes_per_step": passes_total / steps}  # fmt: skip


def _token_steps(
    lengths: np.ndarray, steps: int, step_tokens: int, world: int, budget: int, seed: int, window: int
):
    from ds_adabatch.data import SampleLengths, TokenBudgetSampler

    sampler = TokenBudgetSampler(SampleLengths(len(lengths), lengths=lengths), micro_batch_tokens=budget,
                                 bucket_window=window, seed=seed)  # fmt: skip
    real = processed = passes = samples = 0
    for _ in range(steps):
        step = sampler.next_step(step_tokens, world)
        real += step.tokens
        processed += step.padded_tokens
        passes += step.passes
        samples += step.size
    return {"bucket_window": window, "real": real, "processed": processed, "passes_per_step": passes / steps,
            "samples_per_step": samples / steps}  # fmt: skip


def count(args: argparse.Namespace) -> dict:
    texts = corpus()
    lengths = np.array([len(t) for t in texts], dtype=np.int64)
    rows = {"fixed": _fixed_steps(lengths, args.steps, args.step_tokens, args.world, args.budget, args.seed)}
    for window in (0, args.window):
        rows[f"tokens_w{window}"] = _token_steps(
            lengths, args.steps, args.step_tokens, args.world, args.budget, args.seed, window
        )
    for row in rows.values():
        row["padding_fraction"] = 1 - row["real"] / row["processed"]
    pct = np.percentile(lengths, [50, 90, 99]).tolist()
    return {
        "corpus": {"samples": len(lengths), "tokens": int(lengths.sum()), "mean": float(lengths.mean()),
                   "p50_p90_p99": pct, "max": int(lengths.max()), "python": platform.python_version()},
        "settings": {"world": args.world, "budget": args.budget, "step_tokens": args.step_tokens,
                     "steps": args.steps, "seed": args.seed},
        "rows": rows,
    }  # fmt: skip


# -- deepspeed: what DeepSpeed's dynamic batching trains per step on the same data -------------------


def deepspeed_compare(args: argparse.Namespace) -> dict:
    """DeepSpeed 0.19.8's ``batch_by_seqlens`` (``data_efficiency.dynamic_batching``) against token steps.

    Both pack micro-batches by the sum of lengths (``packed``) under the same budget, over the first
    ``--ds-samples`` samples in the same order (DeepSpeed's ``sequence_picking_order: "dataloader"``), on
    ``--world`` ranks with ``--ds-gas`` micro-batches per rank per step on DeepSpeed's side (its
    ``effective_batch_size``). Token steps get DeepSpeed's mean tokens per step as their target; their
    spreads leave out the epoch's smaller last step (reported as ``tail_step_tokens``).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import batch_by_seqlens

    from ds_adabatch.data import SampleLengths, TokenBudgetSampler

    lengths = np.array([len(t) for t in corpus()], dtype=np.int64)[: args.ds_samples]
    per_step = args.world * args.ds_gas
    micro_ids, batch_sizes, _ = batch_by_seqlens(
        lengths.tolist(), args.budget, effective_batch_size=per_step, sequence_picking_order="dataloader"
    )
    ds_steps = [micro_ids[k : k + per_step] for k in range(0, len(micro_ids), per_step)]
    ds_tokens = [sum(int(lengths[i]) for _, ids in step for i in ids) for step in ds_steps]
    ds_micro = [sum(int(lengths[i]) for i in ids) for _, ids in micro_ids]
    trained = {i for _, ids in micro_ids for i in ids}
    target = round(float(np.mean(ds_tokens)))
    sampler = TokenBudgetSampler(SampleLengths(len(lengths), lengths=lengths), micro_batch_tokens=args.budget,
                                 padding="packed", shuffle=False)  # fmt: skip
    ours, passes, micro_max = [], [], 0
    while not ours or sampler.position < len(lengths):
        step = sampler.next_step(target, args.world)
        ours.append(step.tokens)
        passes.append(step.passes)
        micro_max = max(
            micro_max,
            max(c for layout in step.layouts for c, m in zip(layout.costs, layout.micro_batches) if m),
        )

    def spread(values: list[int]) -> dict:
        v = np.array(values, dtype=float)
        return {"steps": len(v), "mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()),
                "cv": float(v.std() / v.mean())}  # fmt: skip

    return {
        "settings": {"samples": len(lengths), "budget": args.budget, "world": args.world, "ds_gas": args.ds_gas},
        "deepspeed": {"tokens_per_step": spread(ds_tokens), "samples_per_step": spread(batch_sizes),
                      "samples_not_trained": len(lengths) - len(trained), "largest_micro_tokens": max(ds_micro),
                      "passes_per_rank_per_step": args.ds_gas},
        "token_steps": {"target": target, "tokens_per_step": spread(ours[:-1]), "tail_step_tokens": ours[-1],
                        "samples_not_trained": 0, "largest_micro_tokens": micro_max,
                        "passes_per_rank_per_step": spread(passes[:-1])},
    }  # fmt: skip


# -- train: tokens/s on gloo ranks --------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    import torch

    import ds_adabatch

    texts = corpus()
    lengths = [len(t) for t in texts]

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(texts)

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.frombuffer(bytearray(texts[i]), dtype=torch.uint8).long()

    def collate(samples):
        longest = max(len(s) for s in samples)
        ids = torch.zeros(len(samples), longest, dtype=torch.long)
        labels = torch.full((len(samples), longest), -100, dtype=torch.long)
        for r, s in enumerate(samples):
            ids[r, : len(s)] = s
            labels[r, : len(s) - 1] = s[1:]
        return {"input_ids": ids, "labels": labels}

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), layer, torch.nn.Linear(64, 256))

    def loss_fn(engine, batch):
        logits = engine(batch["input_ids"])
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
        )

    fixed = args.mode == "fixed"
    micro = max(1, args.budget // max(lengths))
    per_step = max(1, round(args.step_tokens / (sum(lengths) / len(lengths))))
    section = {"loss_normalization": "token", "data": {"seed": args.seed}, "allow_uneven": True}
    if args.mode == "goodput":
        section |= {"schedule": {"type": "goodput", "start": args.first_batch}, "max_global_batch": args.max_batch,
                    "micro_batch_tokens": args.budget, "bucket_window": args.window}  # fmt: skip
    elif fixed:
        section |= {"schedule": {"type": "constant", "value": per_step}, "max_micro_batch_per_gpu": micro}
    else:
        section |= {"schedule": {"type": "constant", "unit": "tokens", "value": args.step_tokens},
                    "micro_batch_tokens": args.budget, "bucket_window": args.window}  # fmt: skip
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
           "steps_per_print": 10**6, "adabatch": section}  # fmt: skip
    extra = {} if fixed else {"lengths": lengths}
    count = lambda b: int((b["labels"] != -100).sum())  # noqa: E731
    engine, *_ = ds_adabatch.initialize(model, cfg, Data(), collate_fn=collate, loss_fn=loss_fn,
                                        token_count_fn=count, **extra)  # fmt: skip
    if args.mode == "goodput":
        _goodput_steps(engine, args)
        return
    engine.train_batch()  # warm-up
    start, real = time.perf_counter(), 0
    for _ in range(args.steps):
        engine.train_batch()
        # Real tokens (sample lengths) of the step's samples over all ranks, the same unit on both sides.
        step = engine.last_step_batch.global_batch
        idx = step.all_indices() if fixed else step.indices.tolist()
        real += sum(lengths[i] for i in idx)
    engine.resolve_losses()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if engine.global_rank == 0:
        out = {"mode": args.mode, "tokens_per_s": real / elapsed,
               "steps": args.steps, "seconds": elapsed, "peak_rss_mib_rank0": peak / 1024}  # fmt: skip
        Path(args.out).write_text(json.dumps(out))
    engine.close()


def _goodput_steps(engine, args: argparse.Namespace) -> None:
    """``goodput`` mode: every step's batch, passes taken and passes expected; the plan changes."""
    schedule, world, rows = engine.controller.schedule, engine.world_size, []
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.next_plan()
        expected = schedule.throughput.passes_for(
            engine.plan.global_batch_size, world, engine.micro_batch_limit
        )
        engine.train_batch()
        step = engine.last_step_batch.global_batch
        rows.append(
            {"samples": step.size, "tokens": step.tokens, "passes": step.passes, "expected": expected}
        )
    engine.resolve_losses()
    elapsed = time.perf_counter() - start
    if engine.global_rank == 0:
        # Steps the model predicted, that did not run a noise measurement's two half passes.
        errors = [abs(r["expected"] - r["passes"]) / r["passes"] for r in rows if r["expected"] is not None]
        # The first step at each new batch: what the model expected before it had run that batch.
        moved = [
            {"step": e.step, "batch": rows[e.step]["samples"], "expected": rows[e.step]["expected"],
             "passes": rows[e.step]["passes"]}
            for e in engine.history if e.step < len(rows) and rows[e.step]["expected"] is not None
        ]  # fmt: skip
        out = {
            "mode": "goodput", "steps": args.steps, "seconds": elapsed,
            "tokens_per_s": sum(r["tokens"] for r in rows) / elapsed,
            "final_batch": rows[-1]["samples"], "noise_scale": engine.noise.noise_scale,
            "passes_expected_error": {"mean": float(np.mean(errors)), "max": float(np.max(errors))} if errors else None,
            # From step 20 on: the passes expected over those taken, summed (a fractional expectation
            # against whole passes has a per-step error however right its mean is).
            "passes_expected_over_taken_from_step_20": (
                sum(r["expected"] for r in rows[20:] if r["expected"] is not None)
                / max(1, sum(r["passes"] for r in rows[20:] if r["expected"] is not None))
            ),
            "first_steps_of_a_batch": moved,
            "changes": [{"step": e.step, "from": e.old_global_batch, "to": e.new_global_batch, "reason": e.reason}
                        for e in engine.history],
            "steps_run": rows,
        }  # fmt: skip
        Path(args.out).write_text(json.dumps(out, indent=1))
    engine.close()


def _launcher(world: int) -> list[str]:
    """torchrun on ``world`` ranks at a free port: DeepSpeed's CPU shared-memory allreduce names its
    buffers by the master port, so two launches at the default port on one machine would share them."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world}",
        f"--master-port={port}",
    ]


def goodput(args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix="token_budget_goodput_")) / "run.json"
    cmd = [*_launcher(args.world), __file__,
           "_worker", "--mode", "goodput", "--out", str(out), "--steps", str(args.steps), "--budget",
           str(args.budget), "--window", str(args.window), "--first-batch", str(args.first_batch), "--max-batch",
           str(args.max_batch), "--seed", str(args.seed)]  # fmt: skip
    subprocess.run(cmd, check=True, env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    result = json.loads(out.read_text())
    out.unlink()
    out.parent.rmdir()
    return result


def train(args: argparse.Namespace) -> dict:
    rows = {}
    for mode in ("fixed", "tokens"):
        out = HERE / "results" / f"token_budget_{mode}.json"
        cmd = [*_launcher(args.world), __file__,
               "_worker", "--mode", mode, "--out", str(out), "--steps", str(args.steps),
               "--budget", str(args.budget), "--step-tokens", str(args.step_tokens), "--window", str(args.window)]  # fmt: skip
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env)
        rows[mode] = json.loads(out.read_text())
        out.unlink()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "what", nargs="?", default="count", choices=["count", "train", "deepspeed", "goodput", "_worker"]
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--budget", type=int, default=8192, help="peak tokens per forward pass")
    parser.add_argument("--step-tokens", type=int, default=65536, help="tokens per optimizer step")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--window", type=int, default=1024, help="bucket_window of the bucketed row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first-batch", type=int, default=16, help="goodput: its start (samples)")
    parser.add_argument("--max-batch", type=int, default=1024, help="goodput: max_global_batch (samples)")
    parser.add_argument("--mode", default="tokens")
    parser.add_argument("--ds-samples", type=int, default=3000, help="samples of the DeepSpeed comparison")
    parser.add_argument(
        "--ds-gas", type=int, default=4, help="DeepSpeed side: micro-batches per rank per step"
    )
    parser.add_argument(
        "--out", default=None, help="where the results go (default: results/token_budget[_MODE].json)"
    )
    args = parser.parse_args(argv)
    if args.what == "_worker":
        _worker(args)
        import ds_adabatch

        ds_adabatch.finish()  # a gloo group can abort a finished rank in the interpreter's teardown
    result = {"count": count, "train": train, "deepspeed": deepspeed_compare, "goodput": goodput}[args.what](
        args
    )
    default = HERE / "results" / f"token_budget{'' if args.what == 'count' else '_' + args.what}.json"
    out = Path(args.out) if args.out else default
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
