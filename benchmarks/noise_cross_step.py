"""The noise scale of one rank at GAS 1: split steps against consecutive steps, in Adam's geometry.

On one rank with one pass per step, the runtime measures the gradient-noise scale by running a step now
and then as two half passes (a split step, about a third dearer on the CPU, so ``SPLIT_BUDGET`` allows one
in about 13-17): the halves are the small batch, the step the big one. A measurement that costs nothing
would pair two *consecutive* steps instead: each step's gradient the small batch (``B``), their mean the
big one (``2B``), the same estimator (``GradientNoiseEstimator.update(B, mean of the two squared norms, 2B,
squared norm of the mean)``), one measurement per step. It keeps one gradient, but it is biased: the
second gradient is taken after the optimizer stepped with the first, whose noise moved the parameters,
so with Hessian ``H``, preconditioner ``P`` and LR ``eta`` the expected product of the two gradients is
``|G|^2 - eta (G.HPG + tr(HP Sigma) / B)``, not ``|G|^2``: the signal reads low and the noise high by a
share that grows with the LR. This script measures how much.

It trains the goodput benchmark's CPU model (``benchmarks/time_to_target.py``: AdamW at ``--lr`` x
sqrt(B / 8), its warm-up of 64 steps, clipping 1.0, weight decay 0.01; plain PyTorch, one process) at
global batch ``--batch``, every step as two half passes, and feeds these estimators of the same steps (EMA
0.95 per measurement, the runtime's default; Adam's geometry ``g / (sqrt(v_hat) + eps)`` with the step's
own second moment, as the runtime weighs):

* ``split``: every step's halves (the reference: unbiased at the parameters of the step);
* ``sparse``: the halves of one step in ``--split-every`` only (what the runtime does on one rank);
* ``cross``: consecutive steps (the free measurement above), every step;
* ``calibrated``: ``cross`` divided by its bias as the split steps measure it: the ratio of two EMAs fed
  only at the ``sparse`` steps, one with that step's split measurement and one with its consecutive-step
  measurement (both lag alike, so their ratio does not), i.e. ``cross`` x ``sparse`` / ``cross_at_splits``.

Outputs in ``--out``: ``noise_cross_step.json`` (settings, every ``--report-every``-th step's
estimates, and per LR scale each estimator's median ratio to ``split`` from step ``--from-step`` on, and
how far from 1 that ratio typically is). Usage::

    python benchmarks/noise_cross_step.py                      # LR x1 and x0.25, 700 steps each (~8 min)
    python benchmarks/noise_cross_step.py --steps 40 --from-step 10 --lr-scales 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from time_to_target import MODELS  # noqa: E402  (the goodput benchmark's CPU model, trained here)
from time_to_target import parse as benchmark_defaults  # noqa: E402

from ds_adabatch.runtime.noise.adam_geometry import SETTLED_STEPS  # noqa: E402  (as the runtime weighs)

WARMUP_STEPS = benchmark_defaults([]).warmup_steps  # the goodput benchmark's LR warm-up, in steps


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8, help="global batch (even: two halves per step)")
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW LR at batch 8 (sqrt-scaled to --batch)")
    p.add_argument("--lr-scales", type=float, nargs="+", default=[1.0, 0.25], help="runs at LR x each")
    p.add_argument("--split-every", type=int, default=13, help="the sparse estimator's split cadence")
    p.add_argument("--from-step", type=int, default=250, help="first step of the medians")
    p.add_argument("--report-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/noise_cross_step")
    args = p.parse_args(argv)
    if args.batch < 2 or args.batch % 2:
        p.error("--batch must be even and at least 2: each step runs as two halves")
    return args


def run(args: argparse.Namespace, lr_scale: float) -> list[dict[str, Any]]:
    """One training run; every ``--report-every``-th step's estimates."""
    import torch

    from ds_adabatch.signals.noise import GradientNoiseEstimator
    from runners.lm import ByteCorpus, ByteWindows, ModelSpec, build_model

    spec = ModelSpec(**MODELS["cpu"])
    train = ByteWindows(ByteCorpus().train, spec.context)
    model = build_model(spec, seed=args.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * (args.batch / 8) ** 0.5 * lr_scale
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    est = {name: GradientNoiseEstimator(0.95, 8) for name in ("split", "sparse", "cross", "cross_at_splits")}
    half, prev, rows = args.batch // 2, None, []

    def weight() -> Any:  # 1 / (sqrt(v_hat) + eps) after the step, every coordinate
        parts = []
        for p in params:
            state = opt.state[p]
            step = float(state["step"])
            v_hat = state["exp_avg_sq"] / (1 - opt.defaults["betas"][1] ** step)
            parts.append((v_hat.sqrt() + opt.defaults["eps"]).reshape(-1))
        return 1.0 / torch.cat(parts)

    for step in range(args.steps):
        picks = order[step * args.batch : (step + 1) * args.batch]
        halves = []
        for part in (picks[:half], picks[half:]):
            ids = torch.stack([train[int(i)]["input_ids"] for i in part])
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            halves.append(torch.cat([p.grad.reshape(-1) for p in params]))
        full = (halves[0] + halves[1]) / 2
        offset = 0
        for p in params:
            p.grad = full[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / WARMUP_STEPS)
        opt.step()
        if step >= SETTLED_STEPS - 1:
            w = weight()
            a, b, f = halves[0] * w, halves[1] * w, full * w
            small, big = float((a.square().sum() + b.square().sum()) / 2), float(f.square().sum())
            est["split"].update(half, small, args.batch, big)
            if step % args.split_every == 0:
                est["sparse"].update(half, small, args.batch, big)
            if prev is not None:
                q = prev * w
                pair_small = float((q.square().sum() + f.square().sum()) / 2)
                pair_big = float(((q + f) / 2).square().sum())
                est["cross"].update(args.batch, pair_small, 2 * args.batch, pair_big)
                if step % args.split_every == 0:
                    est["cross_at_splits"].update(args.batch, pair_small, 2 * args.batch, pair_big)
            prev = full
        if step % args.report_every == 0 or step == args.steps - 1:
            scales = {name: e.noise_scale for name, e in est.items()}
            bias = (
                scales["cross_at_splits"] / scales["sparse"]
                if scales["cross_at_splits"] and scales["sparse"]
                else None
            )
            scales["calibrated"] = scales["cross"] / bias if bias and scales["cross"] else None
            rows.append(
                {"step": step, "loss": float(loss)}
                | scales
                | {f"{name}_relative_error": e.relative_error for name, e in est.items()}
            )
            print(f"LR x{lr_scale} " + " ".join(f"{k} {v:.4g}" for k, v in rows[-1].items() if v), flush=True)
    return rows


def ratios(rows: list[dict[str, Any]], from_step: int) -> dict[str, float | None]:
    """Over the rows from ``from_step``: per estimator the median of its ratio to ``split`` and the
    median of that ratio's distance from 1 in factors (``exp |log ratio|``: 1.3 = within 30% half the
    time)."""
    out: dict[str, float | None] = {}
    for name in ("sparse", "cross", "calibrated"):
        values = [r[name] / r["split"] for r in rows if r["step"] >= from_step and r[name] and r["split"]]
        out[f"{name}_to_split"] = statistics.median(values) if values else None
        out[f"{name}_spread"] = (
            math.exp(statistics.median(abs(math.log(v)) for v in values)) if values else None
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    for scale in args.lr_scales:
        rows = run(args, scale)
        runs[str(scale)] = {"rows": rows, "medians": ratios(rows, args.from_step)}
        print(f"LR x{scale}: medians from step {args.from_step}: {runs[str(scale)]['medians']}", flush=True)
    with open(os.path.join(args.out, "noise_cross_step.json"), "w") as fh:
        json.dump({"settings": vars(args), "runs": runs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
