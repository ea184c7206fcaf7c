"""Wall-clock time to a validation loss, per batch policy: does ``goodput`` beat a sweep of fixed batches?

Each policy trains the main job's byte-level GPT-2 (``runners/lm.py``) through
``ds_adabatch.initialize`` and ``engine.train_batch()`` on one device, in its own process (a fresh
allocator and clock for each), from the same initial weights, for the same budget of *training*
seconds: validation runs every ``--eval-every`` training seconds on fixed held-out windows, with the
device synchronised around it, and its time is left out (so is engine start-up). Policies:

==========================  =========================================================================
``fixed-B``                 global batch B throughout, for every B of ``--sweep``
``linear``                  ``--start`` -> the largest B of the sweep over ``--ramp-samples`` samples
``gradient_noise``          the ``gradient_noise`` schedule from ``--start``, defaults otherwise
``goodput``                 the ``goodput`` schedule from ``--start`` up to the largest B, defaults otherwise
``goodput-pollux``          the same with Pollux's efficiency (``efficiency: "linear"``), not the square root
                            that ``lr_scaling: sqrt`` selects by default (only where ``--only`` names it)
``goodput-adascale``        ``goodput`` with ``lr_scaling: {"rule": "adascale"}``: the LR multiplier set
                            before every step to AdaScale's gain ``(B / start) x (B_noise + start) /
                            (B_noise + B)`` (1 before the first noise estimate) raised to 0.5 (AdaptDL's
                            variant for Adam-type optimizers) in place of ``sqrt(B / start)`` (only where
                            ``--only`` names it)
``goodput-adascale-1``      the same with the gain itself (``gain_power`` 1, AdaScale's rule for SGD), on
                            AdamW, with goodput's efficiency kept at the square root
``goodput-short-memory``    ``goodput`` whose noise estimate remembers about 5 measurements, not 20
                            (``ema_beta`` 0.8), taken as it is (``max_relative_error`` null): the estimate
                            of one rank at GAS 1, measured one step in about 17, then lags some 85 steps
                            rather than 340 (only where ``--only`` names it)
``goodput-trend``           ``goodput`` whose noise estimate is read at its trend's value now
                            (``noise_trend``: ``ds_adabatch.signals.noise_trend``), not at its
                            measurements' mean age (only where ``--only`` names it)
``goodput-no-pause``        ``goodput`` whose runtime never flags a pause (``PAUSE_SECONDS`` infinite in its
                            process): the slower steps after a validation or another policy's turn are
                            kept as any (only where ``--only`` names it)
``goodput-no-drift``        ``goodput`` whose throughput model reads every shape's step times as they were
                            measured, not at the device's speed now (``RUNS_KEPT`` 0 in its process,
                            ``ds_adabatch.signals.drift``; only where ``--only`` names it)
``switch-A-B-at-S``         global batch A for the first S optimizer steps, then B (``piecewise`` by steps,
                            LR by ``sqrt`` as every policy): a path chosen in hindsight, which pays for no
                            measurement, against which ``goodput``'s own path and price are read (only
                            where ``--only`` names it, with any A, B and S)
``goodput@KEY=VALUE``       ``goodput`` with schedule key KEY set to VALUE (JSON; ``@`` again for more keys,
                            for example ``goodput@remeasure_after=150@hysteresis=0.02``): a setting
                            other than the default, side by side with it in one run (only where ``--only``
                            names it)
``NAME+again``              policy NAME once more, in a process of its own beside it: the same weights,
                            data and schedule, so what differs is the clock (the machine's noise). Not a
                            fixed batch of the sweep (never its best or median), reported as a policy
                            against it: how far a run's own repetition lands from its best fixed batch
==========================  =========================================================================

Every policy: AdamW at ``--lr`` for batch ``--start`` with ``lr_scaling: sqrt``, the same warm-up in
optimizer steps (DeepSpeed's ``WarmupLR``, ``--warmup-steps``), micro-batch = batch (one pass per step,
one device), bf16 and ZeRO 2 on a GPU, fp32 and ZeRO 0 on the CPU.

Outputs in ``--out``: ``<policy>.json`` (the curve: training seconds, the process's CPU seconds in
training, samples, steps, batch, validation loss), ``results.json`` (settings, each policy's time to
every target of ``--targets``, the curves) and ``time_to_target.png`` (validation loss against
training seconds). Usage::

    python benchmarks/time_to_target.py --device cuda --seconds 35          # the GPU measurement
    python benchmarks/time_to_target.py                                     # the CPU one (smaller model)
    python benchmarks/time_to_target.py --smoke                             # a tiny run, for CI
    python benchmarks/time_to_target.py --simulate-step-time fixed=0.04 --seconds 20 --seed 1
    python benchmarks/time_to_target.py --interleave                        # policies in turns
    python benchmarks/time_to_target.py --from-results OUT/results.json     # report an earlier run again

``--interleave`` starts every policy's process at once and lets them train in turns, one slice (up to the
next validation) each while the others wait, the first of each round rotating. Run one after the other,
a policy that happens to train while the machine is slower (a neighbour on shared hardware, a clock that
drops) loses time the others do not; the 2-core CPU ran fixed batch 8 at 205-251 samples/s from one
sequential run to the next and within one. In turns, such a drift falls on every policy alike. The
validation curves carry ``ended_at`` (the wall-clock time each slice ended), which shows the order.

``--simulate-step-time CURVE`` stands in a device whose step costs what CURVE says (the syntax of
``DS_ADABATCH_SIMULATED_STEP_TIME`` and ``ds-adabatch simulate --step-time``; ``fixed=0.04`` is a
host-bound GPU, where a step costs 40 ms whatever its batch): the training clock of every policy is the
sum of its steps' simulated times (each pass the step ran, a noise split's two included), and the goodput
schedule is given the same curve instead of its measurements. The training itself is real (the same
model, data, LR and exact steps), so the loss against samples is what the device would see; what the
figures then say is what the schedule makes of that device's costs. They do not depend on this
machine's speed or load, and a run is deterministic: ``--seed`` varies the data order and the initial
weights between runs.

The goal it measures (issue: goodput): on one GPU ``goodput`` reaches every target no later than the
best fixed batch of the sweep and at most 0.6x the median fixed batch's time; on the CPU within 1.05x the
best fixed batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Model sizes: the GPU model, a CPU one a 2-core machine trains in minutes, and a smoke one.
MODELS = {
    "gpu": {"layers": 6, "width": 384, "heads": 6, "context": 256},
    "cpu": {"layers": 2, "width": 128, "heads": 4, "context": 64},
    "smoke": {"layers": 1, "width": 32, "heads": 2, "context": 32},
}


FIRST_STEPS = 12
"""Steps at the start of each slice whose seconds the curve keeps (``first_steps_s``): what a pause (a
validation, another policy's turn) costs the steps after it."""

ADASCALE_POWERS = {"goodput-adascale": 0.5, "goodput-adascale-1": 1.0}
"""Policies whose ``lr_scaling`` is ``"adascale"`` with this ``gain_power`` (ds_adabatch.schedules.lr), on
``goodput``'s schedule: the LR coupling the issue asks to be measured against ``sqrt``."""

SHORT_MEMORY = {"ema_beta": 0.8, "max_relative_error": None}
"""The keys of ``goodput-short-memory`` over ``goodput``'s: a noise estimate of about 1 / (1 - 0.8) = 5
measurements, used without the confidence test (with ~5 measurements it would rarely pass)."""

ON_REQUEST = frozenset(
    {
        "goodput-pollux",
        "goodput-short-memory",
        "goodput-trend",
        "goodput-no-pause",
        "goodput-no-drift",
        *ADASCALE_POWERS,
    }
)
"""Policies run only where ``--only`` names them."""


AGAIN = "+again"
"""The suffix of a policy run a second time (module docstring)."""


def base_policy(name: str) -> str:
    """The policy ``name`` runs: itself, or the one it repeats (``NAME+again``)."""
    return name[: -len(AGAIN)] if name.endswith(AGAIN) else name


def is_fixed(name: str) -> bool:
    """Whether ``name`` is a fixed batch of the sweep (a repetition is not)."""
    return name.startswith("fixed-") and not name.endswith(AGAIN)


SWITCH = re.compile(r"^switch-(\d+)-(\d+)-at-(\d+)$")
"""``switch-A-B-at-S``: batch A for S optimizer steps, then B (module docstring)."""


SETTING = re.compile(r"^goodput((?:@[a-z_]+=[^@]+)+)$")
"""``goodput@KEY=VALUE[@KEY=VALUE...]``: ``goodput`` with those schedule keys (module docstring)."""


def policies(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each policy's ``"adabatch".schedule`` (the ``switch-A-B-at-S`` and ``goodput@KEY=VALUE`` ones that
    ``--only`` names)."""
    top = max(args.sweep)
    out: dict[str, dict[str, Any]] = {f"fixed-{b}": {"type": "constant", "value": b} for b in args.sweep}
    out["linear"] = {"type": "linear", "start": args.start, "end": top, "ramp_samples": args.ramp_samples}
    out["gradient_noise"] = {"type": "gradient_noise", "start": args.start}
    out["goodput"] = {"type": "goodput", "start": args.start, **dict(args.goodput_set)}
    # Pollux's efficiency, where the default (sqrt scaling here) takes its square root: the two side by side.
    out["goodput-pollux"] = {**out["goodput"], "efficiency": "linear"}
    out["goodput-short-memory"] = {**out["goodput"], **SHORT_MEMORY}
    out["goodput-trend"] = {**out["goodput"], "noise_trend": True}
    out["goodput-no-pause"] = out["goodput"]  # the runtime's constant differs (train_policy)
    out["goodput-no-drift"] = out["goodput"]  # likewise
    for name in ADASCALE_POWERS:  # the schedule of goodput (its square-root efficiency); the LR by ds_config
        out[name] = {**out["goodput"], "efficiency": "sqrt"}
    for name in args.only or ():
        switch = SWITCH.match(base_policy(name))
        if switch:
            first, then, at = (int(x) for x in switch.groups())
            out[switch.group(0)] = {"type": "piecewise", "unit": "steps", "points": [[0, first], [at, then]]}
        setting = SETTING.match(base_policy(name))
        if setting:
            try:
                keys = dict(_key_value(pair) for pair in setting.group(1).split("@")[1:])
            except ValueError as e:  # a VALUE that is not JSON
                raise SystemExit(f"error: --only {name}: {e} (write goodput@KEY=VALUE, VALUE in JSON)") from e
            out[setting.group(0)] = {**out["goodput"], **keys}
    return out


def ds_config(schedule: dict[str, Any], args: argparse.Namespace, name: str | None = None) -> dict[str, Any]:
    """The policy's ds_config: ``schedule`` in the common setting; policy ``name``'s LR coupling."""
    gpu = args.device == "cuda"
    scaling: dict[str, Any] = {"rule": "sqrt", "reference_batch": args.start}
    if name is not None and base_policy(name) in ADASCALE_POWERS:
        scaling.update(rule="adascale", gain_power=ADASCALE_POWERS[base_policy(name)])
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr, "warmup_num_steps": args.warmup_steps},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2 if gpu else 0},
        "bf16": {"enabled": gpu},
        "steps_per_print": 10**9,
        "adabatch": {
            "schedule": schedule,
            "max_micro_batch_per_gpu": max(args.sweep),
            "max_global_batch": max(args.sweep),
            "lr_scaling": scaling,
            "data": {"shuffle": True, "seed": args.seed, "num_workers": 0},
        },
    }


def _wait_turn() -> None:
    """A child of an interleaved run: say that this process waits, and wait for the parent's go."""
    print(TURN, flush=True)
    if not sys.stdin.readline():
        raise SystemExit("the interleaving parent went away")


def train_policy(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One policy in this process: its validation curve against training seconds (with ``--turns``,
    each slice between two validations waits for the parent's go: ``--interleave``)."""
    import torch

    import ds_adabatch
    from runners.lm import ByteCorpus, ByteWindows, ModelSpec, build_model

    spec = ModelSpec(**MODELS[args.model])
    corpus = ByteCorpus(max_bytes=args.corpus_bytes)
    train = ByteWindows(corpus.train, spec.context)
    held = ByteWindows(corpus.validation, spec.context)
    model = build_model(spec, seed=args.seed)
    cfg = ds_config(policies(args)[base_policy(name)], args, name)
    if args.split_budget is not None:  # an experiment on the library's constant, in this process only
        from ds_adabatch.runtime.noise import probe

        probe.SPLIT_BUDGET = args.split_budget
    if base_policy(name) == "goodput-no-pause":  # likewise: no step follows a pause
        from ds_adabatch.runtime.core import step_times

        step_times.PAUSE_SECONDS = math.inf
    if base_policy(name) == "goodput-no-drift":  # likewise: no speed change is read
        from ds_adabatch.signals import drift

        drift.RUNS_KEPT = 0
    engine, *_ = ds_adabatch.initialize(model, cfg, train)
    module = engine.module
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    count = min(args.eval_windows, len(held))
    stride = len(held) // count
    windows = torch.stack([held[i * stride]["input_ids"] for i in range(count)])

    @torch.no_grad()
    def evaluate() -> float:
        """Mean next-byte loss over fixed held-out windows, spread evenly (as runners/lm.py's)."""
        module.eval()
        total = 0.0
        for s in range(0, count, 64):
            ids = windows[s : s + 64].to(engine.device)
            total += float(module(input_ids=ids, labels=ids).loss) * len(ids)
        module.train()
        return total / count

    curve = [
        {
            "train_s": 0.0,
            "cpu_s": 0.0,
            "samples": 0,
            "steps": 0,
            "batch": engine.plan.global_batch_size,
            "val": evaluate(),
        }
    ]
    trained = cpu = 0.0
    next_eval = args.eval_every
    simulated = _step_cost(args.simulate_step_time)

    while trained < args.seconds:
        if args.turns:
            _wait_turn()
        sync()
        started, cpu_started = time.perf_counter(), time.process_time()
        if simulated is not None:  # the simulated device's clock: each step's simulated time
            while trained < min(next_eval, args.seconds):
                engine.train_batch()
                trained += simulated(engine.last_step_batch)
        else:
            first: list[float] = []  # the slice's first steps, each: after a pause a step may cost more
            while trained + (time.perf_counter() - started) < min(next_eval, args.seconds):
                began = time.perf_counter()
                engine.train_batch()
                if not cuda and len(first) < FIRST_STEPS:  # no added synchronisation on a GPU
                    first.append(time.perf_counter() - began)
            sync()
            trained += time.perf_counter() - started
        # The process's CPU time in training: on a loaded machine wall-clock figures mean little, CPU
        # seconds per sample still compare the policies' own costs (the schedule's measurement included).
        cpu += time.process_time() - cpu_started
        next_eval += args.eval_every
        curve.append(
            {
                "train_s": trained,
                "cpu_s": cpu,
                "samples": engine.global_samples,
                "steps": engine.global_steps,
                "batch": engine.plan.global_batch_size,
                "val": evaluate(),
                "ended_at": time.time(),  # when the slice ended: the order of an interleaved run
                "noise_scale": None if engine.noise is None else engine.noise.noise_scale,
                "lr_multiplier": engine.lr_multiplier,
                "first_steps_s": None if simulated is not None or cuda else first,
            }
        )
    engine.close()
    changes = [event.to_dict() for event in engine.history]
    return {
        "policy": name,
        "curve": curve,
        "batch_changes": changes,
        "config": cfg,
        "simulated": args.simulate_step_time,
    }


def _step_cost(text: str | None) -> Any:
    """The simulated seconds of a step (``engine.last_step_batch``: the passes it ran) on the curve
    ``text``, or None to time steps by the clock."""
    if text is None:
        return None
    from ds_adabatch.signals.throughput import parse_step_time_curve

    curve = parse_step_time_curve(text)

    def cost(step_batch: Any) -> float:
        # A pad pass (no real sample) still runs one sample, weighted 0.
        passes = [max(m.num_samples, 1) for m in step_batch.micro_batches]
        return curve.fixed + sum(curve.per_pass + curve.per_sample * m for m in passes)

    return cost


def time_to(curve: list[dict[str, Any]], target: float, key: str = "train_s") -> float | None:
    """Training seconds at which the validation loss first reaches ``target``; None if never (``key``
    "samples": the samples trained by then).

    Interpolated linearly between the last validation above the target and the first at or below it,
    so the figure is not rounded up to the next validation (a 4 s grid would make 32 s and 36 s, a
    ratio of 1.125, out of two curves 0.5 s apart)."""
    for i, point in enumerate(curve):
        if point["val"] <= target:
            if i == 0:
                return point[key]
            before = curve[i - 1]
            fall = before["val"] - point["val"]
            share = (before["val"] - target) / fall if fall > 0 else 1.0
            return before[key] + share * (point[key] - before[key])
    return None


def efficiencies(results: dict[str, dict[str, Any]], targets: list[float], start: int) -> dict[str, Any]:
    """Each fixed batch's measured statistical efficiency relative to ``fixed-<start>`` between two
    consecutive targets (and from the first to the last): the samples ``fixed-<start>`` took from one
    to the next over the samples that batch took (None where either did not reach both). What the
    goodput schedule's efficiency model predicts."""
    base = f"fixed-{start}"
    out: dict[str, Any] = {}
    if base not in results:
        return out
    spans = list(zip(targets, targets[1:]))
    if len(targets) > 2:  # the whole span too: single spans between close targets are noisy
        spans.append((targets[0], targets[-1]))
    for high, low in spans:
        taken = {}
        for name, r in results.items():
            if is_fixed(name):
                a, b = time_to(r["curve"], high, "samples"), time_to(r["curve"], low, "samples")
                taken[name] = None if a is None or b is None else b - a
        ref = taken[base]
        out[f"{high}-{low}"] = {n: (ref / v if ref and v else None) for n, v in taken.items() if n != base}
    return out


def summarise(results: dict[str, dict[str, Any]], targets: list[float]) -> dict[str, Any]:
    """Each policy's time (and samples) to every target, against the best and the median fixed batch.

    A fixed batch that never reached a target within the budget is later than every one that did, so
    it counts in the median as later than all of them: the median of 20.6 s, 22.5 s, 27.7 s and one
    that never got there is 25.1 s, not the 22.5 s of the three that did. Where the median itself is a
    batch that never got there, ``median_fixed`` is None and ``median_fixed_beyond`` True (later than
    the budget); an adaptive policy's ``to_median_fixed`` is then left out, not made up."""
    out: dict[str, Any] = {}
    fixed = [name for name in results if is_fixed(name)]
    for target in targets:
        times = {name: time_to(r["curve"], target) for name, r in results.items()}
        reached = [times[n] for n in fixed if times[n] is not None]
        best = min(reached) if reached else None
        ranked = [math.inf if times[n] is None else times[n] for n in fixed]
        median = statistics.median(ranked) if ranked else math.inf
        beyond = bool(ranked) and math.isinf(median)
        median = None if math.isinf(median) else median
        adaptive = {n: t for n, t in times.items() if not is_fixed(n) and t is not None}
        out[str(target)] = {
            "times": times,
            "samples": {name: time_to(r["curve"], target, "samples") for name, r in results.items()},
            "best_fixed": best,
            "median_fixed": median,
            "median_fixed_beyond": beyond,
            "to_best_fixed": {n: t / best for n, t in adaptive.items()} if best else {},
            "to_median_fixed": {n: t / median for n, t in adaptive.items()} if median else {},
        }
    return out


def report(summary: dict[str, Any], measured: dict[str, Any], start: int) -> None:
    """Print the time to every target and the measured efficiencies (:func:`summarise`, :func:`efficiencies`)."""
    for target, row in summary.items():
        cells = ", ".join(f"{n} {'-' if t is None else f'{t:.1f}s'}" for n, t in row["times"].items())
        ratios = ", ".join(
            f"{n} {r:.2f}x best"
            + (f" / {row['to_median_fixed'][n]:.2f}x median" if n in row["to_median_fixed"] else "")
            for n, r in row["to_best_fixed"].items()
        )
        best, median = row["best_fixed"], row["median_fixed"]
        median_text = (
            f"{median:.1f}s"
            if median is not None
            else "beyond the budget"
            if row.get("median_fixed_beyond")
            else "-"
        )
        print(
            f"to val {target}: {cells} (best fixed {'-' if best is None else f'{best:.1f}s'}, median fixed "
            f"{median_text}){'; ' + ratios if ratios else ''}"
        )
    for span, row in measured.items():
        cells = ", ".join(f"{n} {'-' if e is None else f'{e:.2f}'}" for n, e in row.items())
        print(f"efficiency relative to fixed-{start} from val {span.replace('-', ' to ')}: {cells}")


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        xs = [p["train_s"] for p in r["curve"]]
        ys = [p["val"] for p in r["curve"]]
        ax.plot(xs, ys, label=name, lw=2.2 if not is_fixed(name) else 1.2)
    ax.set_xlabel("training seconds (validation excluded)")
    settings = next(iter(results.values()), {}).get("simulated")
    if settings:
        ax.set_xlabel(f"simulated training seconds ({settings})")
    ax.set_ylabel("validation loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: write KEY=VALUE")
    return key, json.loads(value)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default="benchmarks/results/time_to_target")
    p.add_argument("--smoke", action="store_true", help="a tiny model for a few seconds per policy (CI)")
    p.add_argument("--seconds", type=float, default=None, help="training seconds per policy")
    p.add_argument("--eval-every", type=float, default=None, help="training seconds between validations")
    p.add_argument("--eval-windows", type=int, default=None)
    p.add_argument("--sweep", type=int, nargs="+", default=None, help="the fixed global batches")
    p.add_argument("--start", type=int, default=None, help="first batch of the adaptive policies")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW LR at batch --start")
    p.add_argument("--warmup-steps", type=int, default=64)
    p.add_argument("--ramp-samples", type=int, default=65536)
    p.add_argument("--targets", type=float, nargs="+", default=None)
    p.add_argument("--corpus-bytes", type=int, default=None)
    p.add_argument("--only", nargs="+", default=None, help="run only these policies")
    p.add_argument(
        "--simulate-step-time",
        default=None,
        metavar="CURVE",
        help="time steps on this simulated step-time curve instead of the clock (see the docstring)",
    )
    p.add_argument("--seed", type=int, default=0, help="data order and initial weights")
    p.add_argument(
        "--goodput-set",
        nargs="+",
        default=[],
        type=_key_value,
        metavar="KEY=VALUE",
        help="goodput schedule keys other than their defaults (VALUE in JSON), e.g. warmup_steps=10",
    )
    p.add_argument(
        "--split-budget",
        type=float,
        default=None,
        metavar="FRACTION",
        help="the share of training time the noise splits of one rank at GAS 1 may cost "
        "(ds_adabatch.runtime.noise.probe.SPLIT_BUDGET, set in each policy's process; default: the library's)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="start every policy's process at once and let them train in turns, one slice of "
        "--eval-every training seconds each, so that a machine whose speed drifts slows every policy alike",
    )
    p.add_argument(
        "--from-results",
        metavar="RESULTS_JSON",
        default=None,
        help="train nothing: report a results.json written earlier (its curves) with this version's "
        "summary, at its own targets or at --targets",
    )
    p.add_argument("--policy", default=None, help=argparse.SUPPRESS)  # a child: train this one policy
    p.add_argument("--turns", action="store_true", help=argparse.SUPPRESS)  # a child that waits for its turns
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    args.targets_given = args.targets is not None
    args.model = "smoke" if args.smoke else "gpu" if gpu else "cpu"
    defaults = {
        "seconds": 3.0 if args.smoke else 35.0 if gpu else 240.0,
        "eval_every": 1.0 if args.smoke else 2.5 if gpu else 15.0,
        "eval_windows": 16 if args.smoke else 512 if gpu else 128,
        "sweep": [4, 16] if args.smoke else [32, 64, 128, 256] if gpu else [8, 16, 32, 64],
        "start": 4 if args.smoke else 32 if gpu else 8,
        "targets": [3.0, 2.5] if args.smoke else [1.2, 1.0, 0.85, 0.7] if gpu else [2.2, 2.0, 1.8],
        "corpus_bytes": 4_000_000 if args.smoke else None,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.warmup_steps, args.ramp_samples = 4, 256
    return args


TURN = "@@time_to_target: waiting for my turn"


def _one_by_one(child: list[str], names: list[str]) -> tuple[str, int, str] | None:
    """One process per policy, one after the other: its own allocator, caches and clock. The first
    failure as ``(policy, exit code, output)``, else None."""
    for name in names:
        proc = subprocess.run([*child, "--policy", name], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            return name, proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    return None


def _interleaved(child: list[str], names: list[str]) -> tuple[str, int, str] | None:
    """Every policy's process at once (start-up and validation overlap, neither is timed); training in
    turns: each process trains one slice (up to its next validation) while the others wait, in rounds
    whose first policy rotates. A drift of the machine's speed over the run then falls on every policy
    alike instead of on whichever ran during it. The first failure as ``(policy, exit code, output)``."""
    import collections
    import tempfile

    with contextlib.ExitStack() as stack:
        errors = {name: stack.enter_context(tempfile.TemporaryFile("w+")) for name in names}
        said: dict[str, collections.deque[str]] = {name: collections.deque(maxlen=200) for name in names}
        procs = {
            name: subprocess.Popen(
                [*child, "--policy", name, "--turns"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors[name],
                text=True,
            )
            for name in names
        }
        for proc in procs.values():
            stack.callback(_reap, proc)

        def until_turn(name: str) -> bool:
            """Read ``name``'s output up to its next wait (True) or its end (False)."""
            for line in procs[name].stdout:
                if line.rstrip("\n") == TURN:
                    return True
                said[name].append(line)
            return False

        waiting = [name for name in names if until_turn(name)]  # started up, validated once
        rounds = 0
        while waiting:
            order = waiting[rounds % len(waiting) :] + waiting[: rounds % len(waiting)]
            for name in order:
                procs[name].stdin.write("go\n")
                procs[name].stdin.flush()
                if not until_turn(name):  # its last slice: it wrote its curve and exits
                    waiting.remove(name)
            rounds += 1
        for name in names:
            code = procs[name].wait()
            if code != 0:
                errors[name].seek(0)
                return name, code, "".join(said[name]) + errors[name].read()
    return None


def _reap(proc: subprocess.Popen) -> None:
    """Kill a child still running (the parent failed or was interrupted) and collect it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.from_results is not None:
        with open(args.from_results) as f:
            earlier = json.load(f)
        targets = args.targets if args.targets_given else earlier["settings"]["targets"]
        start = earlier["settings"]["start"]
        results = earlier["results"]
        report(summarise(results, targets), efficiencies(results, targets, start), start)
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device == "cuda" else "cpu")
    if args.simulate_step_time is not None:  # the goodput schedule sees the simulated device's costs
        from ds_adabatch.runtime.core.step_times import SIMULATED_STEP_TIME_ENV

        os.environ[SIMULATED_STEP_TIME_ENV] = args.simulate_step_time
    os.makedirs(args.out, exist_ok=True)
    if args.policy is not None:
        result = train_policy(args.policy, args)
        with open(os.path.join(args.out, f"{args.policy}.json"), "w") as f:
            json.dump(result, f)
        return 0
    names = args.only or [name for name in policies(args) if name not in ON_REQUEST]
    unknown = [name for name in names if base_policy(name) not in policies(args)]
    if unknown:
        known = ", ".join(policies(args))
        print(f"error: --only names no policy {' '.join(unknown)} (known: {known}, each also as NAME{AGAIN})")
        return 2
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    child = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
    failed = (_interleaved if args.interleave else _one_by_one)(child, names)
    if failed:
        name, code, output = failed
        sys.stderr.write(output[-6000:])
        print(f"policy {name} failed (exit {code})", file=sys.stderr)
        return 1
    results = {}
    for name in names:
        with open(os.path.join(args.out, f"{name}.json")) as f:
            results[name] = json.load(f)
        last = results[name]["curve"][-1]
        print(
            f"{name:>16}: val {last['val']:.3f} after {last['train_s']:.1f} s, {last['steps']} steps, batch "
            f"{last['batch']}, {last['samples'] / max(last['cpu_s'], 1e-9):.1f} samples per CPU second"
        )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    summary = summarise(results, args.targets)
    measured = efficiencies(results, args.targets, args.start)
    settings = {k: v for k, v in vars(args).items() if k != "policy"}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(
            {
                "settings": settings,
                "summary": summary,
                "efficiencies": measured,
                "results": results,
            },
            f,
            indent=1,
        )
    report(summary, measured, args.start)
    try:
        plot(results, os.path.join(args.out, "time_to_target.png"))
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
