"""Why ``gradient_noise`` lags on the convergence benchmark: the noise scale in two geometries.

``gradient_noise`` follows B_simple = tr(Sigma) / |G|^2, the noise scale of plain SGD (McCandlish et al.
2018). The convergence benchmark trains with AdamW, which divides every coordinate's step by the root
of its own second moment, so the batch that balances signal and noise *for the step AdamW takes* is
the same ratio measured with that per-coordinate weight:

    B_adam = sum_i P_i Sigma_ii / sum_i P_i G_i^2,   P_i = 1 / sqrt(v_i + (1 - beta2) g_i^2)

where ``v`` is AdamW's bias-corrected second moment and ``g_i^2`` the probe's mean squared micro-batch
gradient (the term a new gradient adds to ``v``; it keeps coordinates AdamW has not seen for a while —
rare bytes' embedding rows — from getting an unbounded weight, as AdamW's own step is bounded there).

The runtime measures the same geometry online (``gradient_noise.geometry: "adam"``, the default for
Adam-type optimizers), weighing with the denominator of the step just taken, ``sqrt(v_hat_t) + eps``,
whose ``v_hat_t`` already holds that step's reduced gradient: the online counterpart of the
``(1 - beta2) g_i^2`` term above. Weighing with the previous step's ``v`` alone left rare coordinates
unbounded there and the estimate scattered over orders of magnitude.

This script trains the convergence benchmark's baseline (global batch 8, the same model, optimiser, LR,
warmup and clipping; plain PyTorch on one process, no DeepSpeed) and every ``--every`` optimizer steps
draws ``--probe-count`` extra micro-batches of ``--probe-micro`` windows from a separate stream,
computes each one's full gradient, and forms both estimates from the small (one micro-batch) and big
(all of them) batch norms with ``ds_adabatch.signals.GradientNoiseEstimator`` (one per geometry, EMA
factor ``--ema-beta`` per measurement). Probe batches never update the model.

Outputs in ``--out``: ``noise_geometry.json`` (settings and every measurement) and ``summary.md`` (both
estimates at fixed sample counts, per seed).

Usage::

    python benchmarks/noise_geometry.py                 # seeds 0 and 1, 28,000 samples each (~5 min)
    python benchmarks/noise_geometry.py --quick         # smoke test: tiny corpus slice, 400 samples
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import convergence  # noqa: E402  (sets sys.path to the repository root)

GEOMETRIES = ("sgd", "adam")
REPORT_AT = (2_048, 4_096, 8_192, 12_288, 16_384, 20_480, 24_576, 28_000)
"""Sample counts the summary table reads both estimates at (the nearest measurement at or before)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--samples", type=int, default=28_000, help="training samples per seed")
    p.add_argument("--batch", type=int, default=8, help="global batch of the trajectory")
    p.add_argument("--every", type=int, default=25, help="optimizer steps between two measurements")
    p.add_argument("--probe-micro", type=int, default=4, help="windows per probe micro-batch (small batch)")
    p.add_argument("--probe-count", type=int, default=16, help="probe micro-batches per measurement")
    p.add_argument("--ema-beta", type=float, default=0.8, help="EMA factor per measurement")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 seed, 400 samples, small corpus")
    p.add_argument("--out", default=os.path.join(HERE, "results", "noise_geometry"))
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.samples, args.every = [0], 400, 10
    if args.probe_count < 2 or args.probe_micro < 1:
        p.error("--probe-count must be at least 2 and --probe-micro at least 1")
    return args


def measure(
    model: Any, opt: Any, params: list[Any], draw: Any, args: argparse.Namespace
) -> dict[str, tuple[float, float]]:
    """(small-batch, big-batch) squared norms in both geometries at the current weights (no update)."""
    import torch

    grads = []
    for _ in range(args.probe_count):
        opt.zero_grad(set_to_none=True)
        ids = draw(args.probe_micro)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]).double())
    opt.zero_grad(set_to_none=True)
    g = torch.stack(grads)
    mean_sq = g.pow(2).mean(0)
    beta2 = opt.param_groups[0]["betas"][1]
    second = []
    for p in params:
        state = opt.state[p]
        step = float(state["step"])
        second.append((state["exp_avg_sq"] / (1.0 - beta2**step)).reshape(-1))
    v = torch.cat(second).double()
    weights = {"sgd": None, "adam": 1.0 / (v + (1.0 - beta2) * mean_sq).sqrt().clamp_min(1e-12)}
    big_grad = g.mean(0)
    out = {}
    for name, w in weights.items():
        small = float((g.pow(2) if w is None else g.pow(2) * w).sum(1).mean())
        big = float((big_grad.pow(2) if w is None else big_grad.pow(2) * w).sum())
        out[name] = (small, big)
    return out


def run_seed(seed: int, args: argparse.Namespace, train: Any, s: Any) -> list[dict[str, Any]]:
    import numpy as np
    import torch

    from ds_adabatch.signals import GradientNoiseEstimator
    from runners.lm import ModelSpec, build_model

    model = build_model(ModelSpec(), seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.base_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    train_rng, probe_rng = np.random.default_rng(seed), np.random.default_rng(10_000 + seed)

    def draw_from(rng: Any) -> Any:
        def draw(n: int) -> Any:
            idx = rng.integers(0, len(train), n)
            return torch.stack([train[int(i)]["input_ids"] for i in idx])

        return draw

    train_draw, probe_draw = draw_from(train_rng), draw_from(probe_rng)
    lr_peak = s.base_lr * math.sqrt(args.batch / s.reference_batch)
    estimators = {name: GradientNoiseEstimator(ema_beta=args.ema_beta) for name in GEOMETRIES}
    b_small, b_big = args.probe_micro, args.probe_micro * args.probe_count
    samples, step, rows = 0, 0, []
    loss_ema = None
    while samples < args.samples:
        if step > 0 and step % args.every == 0:
            norms = measure(model, opt, params, probe_draw, args)
            row: dict[str, Any] = {"seed": seed, "step": step, "samples": samples, "train_loss_ema": loss_ema}
            for name in GEOMETRIES:
                est = estimators[name]
                small, big = norms[name]
                row[f"{name}_noise_scale"] = est.update(b_small, small, b_big, big)
                row[f"{name}_grad_sq"], row[f"{name}_trace"] = est.last_grad_sq_norm, est.last_trace_sigma
            rows.append(row)
        for group in opt.param_groups:
            # Linear warmup over warmup_samples, then constant (the benchmark's WarmupLR in samples).
            group["lr"] = lr_peak * min(1.0, (samples + args.batch) / s.warmup_samples)
        opt.zero_grad(set_to_none=True)
        ids = train_draw(args.batch)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        loss = float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss_ema = loss if loss_ema is None else 0.98 * loss_ema + 0.02 * loss
        samples += args.batch
        step += 1
    return rows


def summary_markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Noise scale along a global-batch-{args.batch} AdamW trajectory (EMA factor {args.ema_beta} per "
        f"measurement, one measurement every {args.every} steps, small batch {args.probe_micro}, big batch "
        f"{args.probe_micro * args.probe_count}).",
        "",
        "| seed | samples | train loss (EMA) | B_simple (SGD geometry) | B_adam (AdamW geometry) | adam / sgd |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for seed in args.seeds:
        mine = [r for r in rows if r["seed"] == seed]
        shown: list[dict[str, Any]] = []
        for at in (*REPORT_AT, math.inf):
            before = [r for r in mine if r["samples"] <= at]
            if before and all(before[-1] is not r for r in shown):
                shown.append(before[-1])
        for r in shown:
            sgd, adam = r["sgd_noise_scale"], r["adam_noise_scale"]
            ratio = adam / sgd if sgd and adam else None
            cells = [
                str(seed),
                f"{r['samples']:,}",
                "-" if r["train_loss_ema"] is None else f"{r['train_loss_ema']:.3f}",
                "-" if sgd is None else f"{sgd:.1f}",
                "-" if adam is None else f"{adam:.1f}",
                "-" if ratio is None else f"{ratio:.2f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from runners.lm import ByteCorpus, ByteWindows, ModelSpec

    torch.set_num_threads(1)
    started = time.perf_counter()
    s = convergence.Settings()
    corpus = ByteCorpus(max_bytes=2_000_000 if args.quick else None)
    train = ByteWindows(corpus.train, ModelSpec().context)
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        rows += run_seed(seed, args, train, s)
        print(f"seed {seed}: {sum(r['seed'] == seed for r in rows)} measurements", flush=True)
    os.makedirs(args.out, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(base_lr=s.base_lr, warmup_samples=s.warmup_samples, reference_batch=s.reference_batch)
    command = "python benchmarks/noise_geometry.py" + (" " + " ".join(argv) if argv else "")
    doc = {"command": command, "settings": settings, "seconds": time.perf_counter() - started, "rows": rows}
    with open(os.path.join(args.out, "noise_geometry.json"), "w") as f:
        json.dump(doc, f, indent=1)
    table = summary_markdown(rows, args)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(f"Command: `{command}` ({doc['seconds']:.0f} s)\n\n{table}")
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
