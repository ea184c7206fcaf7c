"""How well each form of the statistical efficiency matches what the time-to-target runs measured.

Every ``time_to_target.py`` run with a sweep of fixed batches measures the efficiency of each batch
``B`` against the smallest, ``M0``: the samples ``fixed-M0`` took from one validation loss to another
over the samples ``fixed-B`` took (``time_to_target.efficiencies``). The same run's ``goodput`` curve
carries the noise estimate it decided on (``noise_scale`` at each validation). This script reads any
number of stored ``results.json`` files and asks, for one span of validation losses:

- **at the estimate**: each form, given the B_noise the run's own ``goodput`` read over that span (the
  median of its validations there), against the efficiency measured. That is the error ``goodput``'s
  ratings carry: the mean of ``log(measured / form)`` per batch (above 0: the form underrates the
  batch), and its root mean square;
- **fitted**: the one B_noise (for each form) that fits every run's measured efficiencies best, in
  least squares on ``log``, and its residual: whether any B_noise would do.

The forms:

- ``linear``: Pollux's ``(B_noise + M0) / (B_noise + B)``;
- ``sqrt``: its square root (``goodput``'s under square-root LR scaling):
  both are :func:`ds_adabatch.signals.statistical_efficiency`;
- ``step``: one step of SGD on a quadratic, with the LR scaled by ``scale(B) = sqrt(B / M0)`` (the
  runs' ``lr_scaling``). A step at batch ``B`` and LR ``eta_B`` lowers the loss by
  ``eta_B |G|^2 (1 - x_B (1 + B_noise / B))``, ``x_B = eta_B L / 2``; per sample, against ``M0``::

      E(B) = (1 - r s (B_noise + B) M0 / ((B_noise + M0) B)) / (s (1 - r)),   s = scale(B)

  where ``r = x_M0 (1 + B_noise / M0)`` is how aggressive the LR is at ``M0``: 0 a vanishing LR (then a
  sample at ``B`` counts ``1 / s``), 0.5 the LR that makes a step at ``M0`` go farthest, above it an LR
  past that. Its second parameter is not measured by the runtime; here it is fitted (one ``r`` for
  every run, at each run's own estimate, and with B_noise fitted too). Read as the LR's aggressiveness,
  ``r`` would halve with the LR, and batches above ``M0`` would then count less; the runs at half the
  LR measured them counting more (BENCHMARKS.md), so this form describes the runs at one LR, and is not
  a model a schedule could use.

::

    python benchmarks/efficiency_forms.py benchmarks/results/time_to_target_cpu/*.json --span 2.2 1.9

prints one line per run and a summary for each LR the runs trained at (never pooled across), and with
``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from time_to_target import efficiencies, is_fixed  # noqa: E402

from ds_adabatch.signals.efficiency import statistical_efficiency  # noqa: E402

NOISE_GRID = [10 ** (k / 100) for k in range(0, 401)]
"""B_noise values a fit tries: 1 to 10,000 samples, 100 a decade."""
R_GRID = [k / 200 for k in range(0, 196)]
"""``r`` values a fit of the ``step`` form tries: 0 to 0.975."""


def step_efficiency(batch: float, noise: float, reference: float, r: float) -> float:
    """The ``step`` form (module docstring) under square-root LR scaling; can be negative where the
    LR at ``batch`` overshoots so far that a step raises the loss."""
    s = math.sqrt(batch / reference)
    penalty = r * s * (noise + batch) * reference / ((noise + reference) * batch)
    return (1.0 - penalty) / (s * (1.0 - r))


def form(name: str, batch: float, noise: float, reference: float, r: float = 0.0) -> float:
    """The efficiency of ``batch`` against ``reference`` at ``noise`` by the form ``name``."""
    if name == "linear":
        return statistical_efficiency(batch, noise, reference, 1.0)
    if name == "sqrt":
        return statistical_efficiency(batch, noise, reference, 0.5)
    if name == "step":
        return step_efficiency(batch, noise, reference, r)
    raise ValueError(f"unknown form {name!r}: linear, sqrt or step")


def estimate_over(results: dict[str, Any], high: float, low: float, policy: str = "goodput") -> float | None:
    """The median noise estimate ``policy`` read at its validations from ``high`` down to ``low``
    (inclusive); None where it has none there."""
    curve = results.get(policy, {}).get("curve", [])
    read = [p["noise_scale"] for p in curve if p.get("noise_scale") and low <= p["val"] <= high]
    return statistics.median(read) if read else None


def observations(paths: list[str], high: float, low: float, start: int) -> list[dict[str, Any]]:
    """Per results file with ``fixed-<start>``, another fixed batch reaching both losses and an estimate
    over the span: ``{"run", "lr", "noise", "measured": {batch: efficiency}}`` (``lr``: the run's LR at
    ``start``, None where its settings do not say)."""
    out = []
    for path in paths:
        with open(path) as f:
            stored = json.load(f)
        results = stored.get("results", {})
        if f"fixed-{start}" not in results:
            continue
        span = efficiencies(results, [high, low], start).get(f"{high}-{low}", {})
        measured = {int(n.split("-")[1]): e for n, e in span.items() if is_fixed(n) and e and e > 0}
        noise = estimate_over(results, high, low)
        if measured and noise:
            out.append(
                {
                    "run": os.path.basename(os.path.dirname(path))
                    if path.endswith("results.json")
                    else os.path.splitext(os.path.basename(path))[0],
                    "lr": stored.get("settings", {}).get("lr"),
                    "noise": noise,
                    "measured": measured,
                }
            )
    return out


def _errors(obs: list[dict[str, Any]], predict) -> dict[int, list[float]]:
    """``log(measured / predicted)`` per batch; a prediction at or below 0 is an infinite error."""
    errors: dict[int, list[float]] = {}
    for o in obs:
        for batch, e in o["measured"].items():
            p = predict(o, batch)
            errors.setdefault(batch, []).append(math.log(e / p) if p > 0 else math.inf)
    return errors


def _rms(errors: dict[int, list[float]]) -> float:
    flat = [v for vs in errors.values() for v in vs]
    return math.sqrt(sum(v * v for v in flat) / len(flat))


def _summary(errors: dict[int, list[float]], **params: float) -> dict[str, Any]:
    return {
        **params,
        "rms_log_error": _rms(errors),
        "mean_log_error": {b: statistics.fmean(v) for b, v in sorted(errors.items())},
    }


def compare(obs: list[dict[str, Any]], start: int) -> dict[str, Any]:
    """Each form at the runs' own estimates and fitted (module docstring)."""
    out: dict[str, Any] = {"at_estimate": {}, "fitted": {}}
    for name in ("linear", "sqrt"):
        out["at_estimate"][name] = _summary(_errors(obs, lambda o, b, n=name: form(n, b, o["noise"], start)))
        fits = ((_rms(_errors(obs, lambda o, b, n=name, z=z: form(n, b, z, start))), z) for z in NOISE_GRID)
        rms, z = min(fits)
        out["fitted"][name] = _summary(_errors(obs, lambda o, b, n=name, z=z: form(n, b, z, start)), noise=z)
    # step: one r at every run's own estimate, then r and one B_noise together
    fits = (
        (_rms(_errors(obs, lambda o, b, r=r: step_efficiency(b, o["noise"], start, r))), r) for r in R_GRID
    )
    _, r = min(fits)
    out["at_estimate"]["step"] = _summary(
        _errors(obs, lambda o, b: step_efficiency(b, o["noise"], start, r)), r=r
    )
    both = (
        (_rms(_errors(obs, lambda o, b, z=z, r=r: step_efficiency(b, z, start, r))), z, r)
        for z in NOISE_GRID[::2]
        for r in R_GRID
    )
    _, z, r = min(both)
    out["fitted"]["step"] = _summary(_errors(obs, lambda o, b: step_efficiency(b, z, start, r)), noise=z, r=r)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="time_to_target.py results (results.json or a stored copy)")
    p.add_argument(
        "--span",
        nargs=2,
        type=float,
        default=[2.2, 1.9],
        metavar=("HIGH", "LOW"),
        help="the validation losses the efficiency is measured between",
    )
    p.add_argument("--start", type=int, default=8, help="the reference batch (its fixed-START must have run)")
    p.add_argument("--out", help="write the observations and the comparison here as JSON")
    args = p.parse_args(argv)
    if not args.span[0] > args.span[1]:
        p.error(f"--span HIGH LOW: HIGH must be above LOW, got {args.span}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    high, low = args.span
    obs = observations(args.results, high, low, args.start)
    if not obs:
        print(
            f"no run has fixed-{args.start}, another fixed batch and a goodput estimate from {high} to {low}"
        )
        return 1
    for o in obs:
        said = ", ".join(f"{b}: {e:.3f}" for b, e in sorted(o["measured"].items()))
        print(f"{o['run']:24s} B_noise read {o['noise']:6.1f}; measured {said}")
    by_lr: dict[str, Any] = {}
    for lr in sorted({o["lr"] for o in obs}, key=lambda v: (v is None, v or 0.0)):
        group = [o for o in obs if o["lr"] == lr]  # the efficiency depends on the LR: never pooled across
        result = by_lr[str(lr)] = compare(group, args.start)
        print(
            f"\n{len(group)} runs at LR {lr}, efficiency from val {high} to {low} against batch {args.start}:"
        )
        for kind in ("at_estimate", "fitted"):
            for name, s in result[kind].items():
                params = ", ".join(f"{k} {s[k]:.3g}" for k in ("noise", "r") if k in s)
                bias = ", ".join(f"{b}: {math.expm1(v):+.1%}" for b, v in s["mean_log_error"].items())
                print(
                    f"  {kind:11s} {name:6s} {params:22s} rms {s['rms_log_error']:.3f}; measured / form {bias}"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"span": [high, low], "start": args.start, "observations": obs, "comparison_by_lr": by_lr},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
