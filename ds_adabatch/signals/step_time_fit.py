"""The step-time curve: its coefficients, their fit to measured shapes, and curves written by hand.

A step of ``GAS`` passes of ``m`` samples (tokens) per rank costs ``fixed + GAS x (per_pass + per_sample x
m)`` (:mod:`ds_adabatch.signals.throughput` says why, and how the measured shapes are kept).
:func:`fit_step_time` fits the three non-negative coefficients to measured shapes; :func:`carry_slope`
moves a fit to another world size from one shape measured there, :func:`carry_split` from shapes there
that share one micro-batch; :func:`parse_step_time_curve` reads a
curve given by hand (``ds-adabatch simulate``, the tests' simulated devices).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "SimulatedDevice",
    "StepTimeFit",
    "carry_slope",
    "carry_split",
    "fit_step_time",
    "parse_step_time_curve",
]

_TERMS = ("fixed", "per_pass", "per_sample")


@dataclass(frozen=True)
class StepTimeFit:
    """Fitted coefficients, in seconds: ``fixed + gas x (per_pass + per_sample x micro)``."""

    fixed: float
    per_pass: float
    per_sample: float
    shapes: int
    """Distinct shapes the fit rests on."""
    jitter: float = 0.0
    """A simulated curve's measurement noise (:func:`parse_step_time_curve`'s ``jitter``): each step is
    measured at the curve's value times a lognormal factor of mean 1 whose log has this standard
    deviation (:meth:`measure`); 0 for a fit and for a curve without it."""
    drift: float = 0.0
    """A simulated curve's change of speed (:func:`parse_step_time_curve`'s ``drift``): the device's
    times are all multiplied by a lognormal factor of mean 1 whose log has this standard deviation,
    drawn anew after ``drift_steps`` steps on average (:class:`SimulatedDevice`); 0 for a fit."""
    drift_steps: int = 50
    """The mean number of steps between two draws of ``drift``'s factor."""

    def predict(self, micro: int, gas: float) -> float:
        """Seconds of one optimizer step of ``gas`` passes of ``micro`` samples (tokens) per rank."""
        return self.fixed + gas * (self.per_pass + self.per_sample * micro)

    def measure(self, micro: int, gas: int, rng: random.Random) -> float:
        """What one step of that shape is measured at on the simulated device: :meth:`predict`, times
        ``exp(jitter x z - jitter^2 / 2)`` for a standard normal ``z`` drawn from ``rng`` (the curve's
        value on average)."""
        seconds = self.predict(micro, gas)
        if not self.jitter:
            return seconds
        return seconds * math.exp(self.jitter * rng.gauss(0.0, 1.0) - self.jitter**2 / 2)

    def describe(self) -> str:
        curve = (
            f"{self.fixed * 1e3:.3g} ms + GAS x ({self.per_pass * 1e3:.3g} ms + micro x "
            f"{self.per_sample * 1e3:.3g} ms)"
        )
        if self.jitter:
            curve += f", each step measured within a factor exp(+-{self.jitter:g}) about it (one sigma)"
        if self.drift:
            curve += (
                f", the device's speed changed by a factor exp(+-{self.drift:g}) (one sigma) every "
                f"{self.drift_steps} steps on average"
            )
        return (
            curve if not self.shapes else f"{curve} from {self.shapes} shape{'s' if self.shapes != 1 else ''}"
        )


class SimulatedDevice:
    """What a simulated curve's device measures, step after step: :meth:`StepTimeFit.measure` (the
    curve's value and its ``jitter``), times the device's current speed factor where the curve has a
    ``drift`` (a machine whose speed changes: other work on it, a turn between jobs). The factor is
    drawn at the first step and anew before each step with probability ``1 / drift_steps``, so the
    changes come at random steps, not in step with a schedule's decisions. Draws come from ``rng``;
    without a drift exactly as the curve's own.
    """

    def __init__(self, curve: StepTimeFit, rng: random.Random) -> None:
        self.curve, self.rng = curve, rng
        self.steps = 0
        self.speed = 1.0
        """The factor the device's times are multiplied by now."""

    def measure(self, micro: int, gas: int) -> float:
        drift = self.curve.drift
        if drift and (self.steps == 0 or self.rng.random() * self.curve.drift_steps < 1.0):
            self.speed = math.exp(drift * self.rng.gauss(0.0, 1.0) - drift**2 / 2)
        self.steps += 1
        return self.curve.measure(micro, gas, self.rng) * self.speed


def _solve(
    rows: list[list[float]], ys: list[float], ws: list[float], cols: tuple[int, ...]
) -> list[float] | None:
    """Weighted least squares on the columns ``cols`` (normal equations, Gauss-Jordan); None if singular."""
    k = len(cols)
    a = [[0.0] * (k + 1) for _ in range(k)]
    for row, y, w in zip(rows, ys, ws):
        xs = [row[c] for c in cols]
        for i in range(k):
            for j in range(k):
                a[i][j] += w * xs[i] * xs[j]
            a[i][k] += w * xs[i] * y
    scale = max(abs(a[i][i]) for i in range(k)) or 1.0
    for i in range(k):
        pivot = max(range(i, k), key=lambda r: abs(a[r][i]))
        if abs(a[pivot][i]) <= 1e-12 * scale:
            return None  # the columns are collinear over the measured shapes
        a[i], a[pivot] = a[pivot], a[i]
        for r in range(k):
            if r != i:
                f = a[r][i] / a[i][i]
                for c in range(i, k + 1):
                    a[r][c] -= f * a[i][c]
    return [a[i][k] / a[i][i] for i in range(k)]


def fit_step_time(points: Iterable[tuple[int, int, float, int]], spread: float = 0.0) -> StepTimeFit | None:
    """Non-negative weighted least squares over ``(micro, gas, seconds, count)`` points (module docstring).

    ``spread``: the variance of one step's log time about its shape's (0: exact times). The flat fit
    (``fixed`` alone) is then kept wherever the best fit lowers the weighted residual by no more than
    noise would, two standard errors of a median of such times for each term it adds (``4 x (pi / 2)
    x spread`` per term): a slope that noise alone could have drawn between two shapes' medians is not
    taken for one. Only the flat fit has that benefit of the doubt, as one measured shape has it: it
    predicts a larger batch to cost no more, which the goodput schedule then tries and measures, where
    a fit without ``fixed`` (cost in proportion to the samples) would rule out ever trying one."""
    pts = [p for p in points if p[2] > 0]
    if not pts:
        return None
    rows = [[1.0, float(g), float(g * m)] for m, g, _, _ in pts]
    ys = [t for _, _, t, _ in pts]
    ws = [n / (t * t) for _, _, t, n in pts]
    best: tuple[float, tuple[int, ...], list[float]] | None = None
    flat: tuple[float, tuple[int, ...], list[float]] | None = None
    total = sum(w * y * y for w, y in zip(ws, ys))
    # Subsets in order of preference: fewer terms first, then fixed < per_pass < per_sample.
    for size in (1, 2, 3):
        for cols in itertools.combinations(range(3), size):
            coef = _solve(rows, ys, ws, cols)
            if coef is None or any(c < 0 for c in coef):
                continue
            resid = sum(
                w * (y - sum(c * row[i] for c, i in zip(coef, cols))) ** 2 for row, y, w in zip(rows, ys, ws)
            )
            if cols == (0,):
                flat = (resid, cols, coef)
            # A richer fit must be better by more than rounding to displace a simpler one.
            if best is None or resid < best[0] - 1e-9 * total:
                best = (resid, cols, coef)
    noise = 2.0 * math.pi * max(0.0, spread)
    if flat is not None and best is not None and flat[0] <= best[0] + noise * (len(best[1]) - 1):
        best = flat  # the data do not tell the best fit's slope from noise (at spread 0: no slope at all)
    if best is None:
        return None
    values = [0.0, 0.0, 0.0]
    for c, i in zip(best[2], best[1]):
        values[i] = c
    return StepTimeFit(*values, shapes=len(pts))


def carry_slope(fit: StepTimeFit, micro: int, gas: int, seconds: float) -> StepTimeFit:
    """``fit`` (measured at other world sizes) moved to a world where one shape, ``gas`` passes of
    ``micro``, was measured at ``seconds``: its slope (``per_pass``, ``per_sample``) kept, ``fixed`` set so
    that this shape is predicted exactly. A rank's passes cost what they did on any number of ranks; a
    step's fixed cost (the gradient reduction's share of it) does not. Where the slope alone costs more
    than the shape measured, it is scaled down to it, with no fixed cost."""
    slope = gas * (fit.per_pass + fit.per_sample * micro)
    if not slope > 0:  # a flat fit: flat here too
        return StepTimeFit(seconds, 0.0, 0.0, shapes=fit.shapes + 1)
    if slope <= seconds:
        return StepTimeFit(seconds - slope, fit.per_pass, fit.per_sample, shapes=fit.shapes + 1)
    scale = seconds / slope
    return StepTimeFit(0.0, fit.per_pass * scale, fit.per_sample * scale, shapes=fit.shapes + 1)


def carry_split(fit: StepTimeFit, own: StepTimeFit, micro: int) -> StepTimeFit:
    """``own`` (fitted at one world size from shapes that all run ``micro`` samples a pass, so it cannot
    tell a pass's cost from its samples': :func:`fit_step_time` puts it all in ``per_pass``) with its
    cost of a pass of ``micro`` split between ``per_pass`` and ``per_sample`` as ``fit`` (measured at
    other world sizes) splits it there: a rank's passes cost what they did on any number of ranks, and
    another micro-batch here is then predicted from what the other worlds measured of it."""
    total = own.per_pass + own.per_sample * micro
    theirs = fit.per_pass + fit.per_sample * micro
    if not theirs > 0:  # a flat fit tells no split
        return own
    share = fit.per_sample * micro / theirs
    return StepTimeFit(
        own.fixed, total * (1.0 - share), total * share / micro, shapes=own.shapes + fit.shapes
    )


def parse_step_time_curve(text: str) -> StepTimeFit:
    """A step-time curve written by hand, for ``ds-adabatch simulate`` and for tests.

    Either the coefficients in seconds, ``"fixed=0.03,per_pass=0.002,per_sample=0.0004"`` (missing ones
    are 0), or a table of step times by shape, fitted as the runtime fits measured steps: one-pass steps
    by micro-batch, ``"8:0.031,32:0.034,128:0.052"``, and steps of several passes as ``MICROxGAS``,
    ``"8x4:0.060"``. One-pass steps alone cannot tell a pass's own cost from the step's (the optimizer,
    the reduction): the fit then puts it in ``fixed``, so that further passes cost only their samples,
    which prices gradient accumulation low; one entry of two or more passes (or ``per_pass=``) prices it.

    With the coefficients, ``jitter=S`` (unitless, default 0) makes the simulated steps' measured times
    noisy, as a real device's are: each is the curve's value times a lognormal factor of mean 1 whose log
    has standard deviation ``S`` (:meth:`StepTimeFit.measure`; 0.25: about +-25%). The curve itself is
    the mean; ``jitter`` is what the goodput schedule's measurements see, not a cost. ``drift=S``
    (unitless) does the same to the device's speed: after ``drift_steps=N`` steps on average (default
    50; at random steps) all its times are multiplied by a new lognormal factor of mean 1 whose log has standard deviation ``S``
    (:class:`SimulatedDevice`), as a machine slows down and speeds up with the other work on it.

    Raises:
        ValueError: the text is neither, naming what is wrong.
    """
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(
            "an empty step-time curve: give fixed=...,per_pass=...,per_sample=... or micro:seconds pairs"
        )
    if all("=" in item for item in items):
        values = {
            "fixed": 0.0,
            "per_pass": 0.0,
            "per_sample": 0.0,
            "jitter": 0.0,
            "drift": 0.0,
            "drift_steps": 50.0,
        }
        given: set[str] = set()
        for item in items:
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in values:
                raise ValueError(f"unknown step-time term {name!r} in {text!r}; known: {', '.join(values)}")
            if name in given:
                raise ValueError(f"step-time term {name} is given twice in {text!r}: give it once")
            given.add(name)
            unit = " seconds" if name in _TERMS else ""
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"step-time term {name} must be a number{unit}, got {value!r}") from None
            if not values[name] >= 0 or not math.isfinite(values[name]):
                raise ValueError(f"step-time term {name} must be a finite number >= 0{unit}, got {value!r}")
        if values["drift_steps"] != int(values["drift_steps"]) or values["drift_steps"] < 1:
            raise ValueError(f"step-time term drift_steps must be a whole number >= 1 (steps) in {text!r}")
        if not any(values[term] for term in _TERMS):
            raise ValueError(
                f"the step-time curve {text!r} is zero everywhere: give at least one positive term"
            )
        return StepTimeFit(**{**values, "drift_steps": int(values["drift_steps"])}, shapes=0)
    if any("=" in item for item in items):
        raise ValueError(
            f"the step-time curve {text!r} mixes terms (name=value) with table entries (micro:seconds): "
            "give one form (jitter=... and drift=... go with fixed=...,per_pass=...,per_sample=...)"
        )
    points = []
    for item in items:
        shape, sep, seconds = item.partition(":")
        micro, times, gas = shape.lower().partition("x")
        try:
            if not sep:
                raise ValueError
            points.append((int(micro), int(gas) if times else 1, float(seconds), 1))
        except ValueError:
            raise ValueError(
                f"step-time table entry {item!r} is not micro:seconds or microxgas:seconds (e.g. 8:0.031, "
                "8x4:0.060); or give fixed=...,per_pass=...,per_sample=..."
            ) from None
        m, g, t, _ = points[-1]
        if m < 1 or g < 1 or not (t > 0 and math.isfinite(t)):
            raise ValueError(
                f"step-time table entry {item!r} needs a micro-batch and passes >= 1 and seconds > 0"
            )
        if (m, g) in {(m0, g0) for m0, g0, _, _ in points[:-1]}:
            raise ValueError(f"step-time table gives micro {m} x gas {g} twice in {text!r}: give it once")
    fit = fit_step_time(points)
    assert fit is not None  # every point has a positive time
    return fit
