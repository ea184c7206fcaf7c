"""Gradient norms for the noise-scale estimate, read during the ordinary backward passes.

A tensor hook on each parameter sees the gradient of the current backward pass before it is
accumulated or reduced: under every ZeRO stage, because DeepSpeed 0.19.8 reduces gradients in
post-accumulation hooks, and under torch DDP, whose reducer also runs after accumulation. Divided by
the micro-batch's loss weight, that is the gradient of one micro-batch's mean loss on this rank (the
small batch). The reduced gradient of the whole global batch (the big batch) comes from DeepSpeed's
global gradient norm (ZeRO 1-3, bf16) or, under plain ZeRO 0 and DDP, from the all-reduced ``.grad``
tensors before the optimizer step clears them. No extra forward or backward pass.

Everything stays on the device until the step's one all-reduce: the hooks add squared norms into a
device scalar, so a GPU is never synchronised per parameter.

With ``geometry: "adam"`` both norms are taken of the gradient divided elementwise by the denominator
``sqrt(v_hat) + eps`` of the Adam step the measured step takes (:class:`AdamPreconditioner`): the noise
scale of the step an Adam-type optimizer takes rather than of plain SGD's. The hooks then add squared
gradients per coordinate instead of their sum, for this rank's share of the coordinates (its partition
under ZeRO 1-3, 1/world of the parameters under ZeRO 0), and a post-step hook on the optimizer weighs
them (:mod:`ds_adabatch.runtime.noise.adam_geometry`). No collective is added in either geometry.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ds_adabatch.config.schedules import measures_noise
from ds_adabatch.signals import GradientNoiseEstimator

from .adam_geometry import AdamPreconditioner, configured_geometry, measured_geometry, noise_preconditioner

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds_adabatch.config.schedules import ScheduleConfig

__all__ = ["SPLIT_EVERY", "NoiseCadence", "NoiseProbe", "loss_scale", "noise_estimator", "update_estimator"]

logger = logging.getLogger("ds_adabatch")


def loss_scale(ds_engine: DeepSpeedEngine) -> float:
    """fp16 multiplies the loss by a dynamic scale before backward; bf16 and fp32 use 1."""
    if not ds_engine.fp16_enabled():
        return 1.0
    opt = ds_engine.optimizer
    for name in ("cur_scale", "loss_scale"):
        value = getattr(opt, name, None)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return 1.0


class NoiseProbe:
    """Collects a measured optimizer step's small- and big-batch squared gradient norms on this rank.

    A new probe measures the next step; after it, :meth:`stop` leaves its hooks in place, idle, and
    :meth:`start` measures another step without registering them again (the engine keeps one probe
    for the run); :meth:`close` removes them.

    Args:
        parameters: the model's parameters; a hook on each trainable one reads its micro-batch gradient.
        device: where the running sums live (the parameters' device).
        grad_scale: the factor the loss was multiplied by before backward (fp16's loss scale), read at
            each use; ``None``: 1.
        reduced_norm: returns the big batch's gradient norm after the step (DeepSpeed's global norm),
            or ``None`` where it has none; ``None`` (the argument): use :meth:`read_reduced_norm`.
        read_grads: whether :meth:`read_reduced_norm` reads the reduced ``.grad`` tensors (where
            ``reduced_norm`` may have no value).
        preconditioner: measure in Adam's geometry; ``None``: plain gradients.

    :meth:`for_deepspeed` builds one for a DeepSpeed engine.
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        device: torch.device | str,
        *,
        grad_scale: Callable[[], float] | None = None,
        reduced_norm: Callable[[], Any] | None = None,
        read_grads: bool = True,
        preconditioner: AdamPreconditioner | None = None,
    ) -> None:
        self.params = [p for p in parameters if p.requires_grad]
        self._grad_scale = grad_scale or (lambda: 1.0)
        self._reduced_norm = reduced_norm
        self.read_grads = read_grads
        self.device = device
        self._acc = torch.zeros((), dtype=torch.float32, device=device)
        self._weight = 0.0
        self._samples = 0
        self.preconditioner = preconditioner
        self._factor = 0.0
        self._active = False
        self._step_sums: torch.Tensor | None = None
        if preconditioner is None:
            self._handles = [p.register_hook(self._hook) for p in self.params]
        else:
            # Adam geometry: the hooks add squared gradients per coordinate of this rank's share; a
            # post-step hook on the optimizer that holds exp_avg_sq weighs them, and the reduced
            # gradient, with this step's denominator: (weighted small-batch sum, reduced weighted,
            # reduced plain).
            self._handles = [
                p.register_hook(functools.partial(self._adam_hook, p))
                for p in self.params
                if preconditioner.measures(p)
            ]
            self._handles.append(preconditioner.optimizer.register_step_post_hook(self._after_step))
        self.start()

    def start(self) -> None:
        """Measure the next optimizer step (a new probe starts measuring at once): fresh sums; the
        previous step's :meth:`local_sums` stay valid."""
        self._sq_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._n = 0
        self._inv_b = 0.0
        self._big: torch.Tensor | None = None
        if self.preconditioner is not None:
            self.preconditioner.begin_step()
            self._step_sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        self._active = True

    def stop(self) -> None:
        """After the measured step's optimizer step: the hooks stay, idle, until :meth:`start` (an idle
        hook returns at once) and the per-coordinate buffer is dropped."""
        self._active = False
        self._factor = 0.0
        if self.preconditioner is not None:
            self.preconditioner.release()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._active:
            self.preconditioner.after_step(optimizer, self._step_sums)

    @classmethod
    def for_deepspeed(cls, ds_engine: DeepSpeedEngine, geometry: str | None = None) -> NoiseProbe:
        """Hooks on the engine's module; the big batch from DeepSpeed's global gradient norm (ZeRO 1-3,
        bf16) or, under plain ZeRO 0, from the all-reduced ``.grad`` tensors.

        ``geometry`` is ``"sgd"`` or ``"adam"``; ``None``: the ``gradient_noise`` schedule's
        (:func:`configured_geometry`, resolved by :func:`measured_geometry`).
        """
        if geometry is None:
            geometry = measured_geometry(ds_engine, configured_geometry(ds_engine), caller_resolves=False)
        return cls(
            ds_engine.module.parameters(),
            ds_engine.device,
            grad_scale=lambda: loss_scale(ds_engine),
            reduced_norm=ds_engine.get_global_grad_norm,
            read_grads=ds_engine.zero_optimization_stage() == 0,
            preconditioner=noise_preconditioner(ds_engine) if geometry == "adam" else None,
        )

    def _hook(self, grad: torch.Tensor) -> None:
        if not self._active:
            return
        g = grad.detach().reshape(-1)
        g = g if g.dtype == torch.float32 else g.float()
        self._acc.add_(torch.dot(g, g))

    def _adam_hook(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        if self._factor:
            self.preconditioner.accumulate(param, grad, self._factor)

    def begin(self, weight: float, samples: int) -> None:
        """Before a micro-batch's backward (of a step being measured): its loss weight and real sample
        count."""
        self._acc.zero_()
        self._weight = weight
        self._samples = samples
        if self.preconditioner is not None:
            # Pads are skipped; the gradient is of the weighted (and fp16-scaled) loss.
            scale = weight * self._grad_scale()
            self._factor = 1.0 / (scale * scale) if samples > 0 and weight > 0 else 0.0

    def end(self) -> None:
        """After the backward: fold the micro-batch's squared norm in (pads are skipped)."""
        if self._samples <= 0 or self._weight <= 0:
            return
        scale = self._weight * self._grad_scale()
        self._sq_sum.add_(self._acc.double() / (scale * scale))
        self._n += 1
        self._inv_b += 1.0 / self._samples

    def read_reduced_norm(self) -> None:
        """After the last micro-batch's backward (gradients reduced), before the optimizer step."""
        if not self.read_grads:
            return
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        if grads:
            norms = torch._foreach_norm([g if g.dtype == torch.float32 else g.float() for g in grads])
            self._big = torch.stack(norms).double().square().sum() / self._grad_scale() ** 2

    def reduced_sq_norm(self) -> float | None:
        """The big batch's squared gradient norm (the same on every rank), after the step."""
        return self.reduced_sq_norm_later()()

    def reduced_sq_norm_later(self) -> Callable[[], float | None]:
        """Capture the big batch's norm now (after the step) without reading it on the host.

        Returns a function that gives :meth:`reduced_sq_norm`'s value when called, so a GPU is only
        synchronised when the measurement is folded into the estimate.
        """
        norm = self._reduced_norm() if self._reduced_norm is not None else None
        if isinstance(norm, torch.Tensor):
            norm = norm.detach().clone()  # DeepSpeed may reuse its buffer in the next step
        big = self._big

        def value() -> float | None:
            if norm is None:
                return None if big is None else float(big)
            n = float(norm)
            return n * n if math.isfinite(n) else None

        return value

    def local_sums(self) -> list[torch.Tensor | float]:
        """This rank's (sum of small-batch squared norms, micro-batches measured, sum of 1/size), to be
        summed over ranks. Read after the optimizer step.

        In Adam's geometry, over this rank's share of the coordinates: the first sum is instead the
        mean over this rank's micro-batches of their weighted squared norms (summed over ranks, the
        small-batch mean over all coordinates), and three more follow: the reduced gradient's weighted
        squared norm, its plain squared norm, and 1 where this rank holds a share but measured no
        micro-batch (the step is then not fed).
        """
        if self._step_sums is None:
            return [self._sq_sum, float(self._n), self._inv_b]
        small, weighted, plain = self._step_sums.unbind()
        missing = float(self.preconditioner.unsettled or (self.preconditioner.holds_share and self._n == 0))
        mean = small / self._n if self._n else small
        return [mean, float(self._n), self._inv_b, weighted, plain, missing]

    def close(self) -> None:
        """Remove the hooks and drop the per-coordinate buffer (after the step's optimizer step)."""
        self.stop()
        for h in self._handles:
            h.remove()
        self._handles = []


def noise_estimator(
    ds_engine: Any, config: ScheduleConfig, schedule: object
) -> tuple[GradientNoiseEstimator, str | None]:
    """The run's noise-scale estimate and the geometry it is measured in (None where no schedule reads
    the noise scale). The geometry is resolved against ``ds_engine``'s optimizer now (a ConfigError for
    "adam" without a second moment), an unset scale takes that geometry's default, and a schedule that
    reads the geometry (goodput) is told it."""
    if not measures_noise(config):  # gradient_noise and goodput read the noise scale
        return GradientNoiseEstimator(), None
    geometry = measured_geometry(ds_engine, config.geometry)
    use_geometry = getattr(schedule, "use_geometry", None)
    if use_geometry is not None:
        use_geometry(geometry)
    return GradientNoiseEstimator(**config.estimator_settings()), geometry


def update_estimator(
    estimator: GradientNoiseEstimator, sums: Sequence[Any], total_samples: int, sq_big: float | None
) -> None:
    """Feed one step's measurement to ``estimator``.

    ``sums`` are :meth:`NoiseProbe.local_sums` summed over ranks, ``total_samples`` the global batch's
    real samples and ``sq_big`` :meth:`NoiseProbe.reduced_sq_norm`. The small batch is the harmonic mean
    of the measured micro-batch sizes; nothing is fed when no micro-batch was measured, the big norm is
    missing, or the global batch is not larger than the small one. In Adam's geometry (six sums) the
    first sum is already the small-batch mean (the sum of each rank's share's mean), the big norm is
    ``sq_big`` times the ratio of the reduced gradient's weighted to plain squared norm, and a step in
    which a rank that holds a share measured no micro-batch is not fed.
    """
    sq_sum, n_micro, inv_b_sum, *step = (float(s) for s in sums)
    if n_micro < 1 or sq_big is None:
        return
    mean_small = sq_sum / n_micro
    if step:
        weighted, plain, missing = step
        if missing > 0:
            return  # a share of the coordinates has no small-batch measurement this step
        if not (plain > 0 and math.isfinite(weighted) and math.isfinite(plain)):
            return  # the optimizer did not step (an overflow) or its gradient was not finite
        sq_big = sq_big * weighted / plain
        mean_small = sq_sum
    b_small = n_micro / inv_b_sum
    if total_samples <= b_small:
        return
    estimator.update(b_small, mean_small, total_samples, sq_big)


SPLIT_EVERY = 4
"""On one rank at GAS 1, at most one due measurement in this many is taken (as a step of two half
passes); fewer where a split step costs more (:data:`SPLIT_BUDGET`)."""

SPLIT_BUDGET = 0.02
"""The share of training time the split steps may cost: where the split steps measured so far cost
``extra`` more than the whole step the throughput model predicts (0.25: a quarter more), one due step in
``max(SPLIT_EVERY, ceil(extra / SPLIT_BUDGET))`` is split."""


class NoiseCadence:
    """Which optimizer steps measure the noise scale: every ``measure_every`` steps of a
    ``gradient_noise`` or ``goodput`` schedule, when the step has at least two micro-batches over all
    ranks (the estimator compares one micro-batch with the whole global batch).

    A step with a single micro-batch in total (one rank, GAS 1) has none to compare. Where the runtime
    can cut that step's samples into two half passes (``can_split``: the training data is its own, and
    the batch holds two samples or more), one due step in :data:`SPLIT_EVERY` is measured that way: the
    same samples and the same exact update, for the price of one more pass in that step (its per-pass
    overhead and the probe's work; the per-sample work is the same). Where the runtime knows that price
    (``split_cost``: the goodput schedule's throughput model times its split steps apart from the whole
    ones), fewer steps are split, so that they cost about :data:`SPLIT_BUDGET` of the training time: one
    in 13 where a split step costs a quarter more, one in 17 where it costs a third more (the 2-core CPU
    benchmark's), one in 50 where it costs twice the whole step. Two consecutive steps are not paired
    instead (free, but the second gradient follows an update the first one's noise moved: on the CPU
    benchmark's model that read the noise scale 1.3-1.5x too high; BENCHMARKS.md). Otherwise the
    step is skipped with a warning, once per run: the schedule then holds its batch until a step can be
    measured (``goodput`` with its default warm-up decides on step cost meanwhile).
    """

    def __init__(self, schedule_config: Any, *, splits: bool = True) -> None:
        self.every = int(schedule_config.measure_every) if measures_noise(schedule_config) else 0
        self.schedule = str(schedule_config.type)
        # goodput with its default warm-up still moves by step cost where the noise cannot decide.
        self.by_cost = self.schedule == "goodput" and getattr(schedule_config, "warmup_steps", 0) is None
        self.splits = splits  # whether a step can ever be split here (not in the Trainer's steps)
        self.warned = False
        self.last_split: int | None = None
        """The latest step split for a measurement; checkpointed (:meth:`state_dict`, in the step core's
        state), so a resumed run splits the steps the uninterrupted one would."""

    def state_dict(self) -> dict[str, Any]:
        return {"last_split": self.last_split}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        last = state.get("last_split")
        self.last_split = None if last is None else int(last)

    def split_interval(self, split_cost: float | None) -> int:
        """Due steps between two split ones, for a split step costing ``split_cost`` more than whole."""
        if split_cost is None or not split_cost > 0:
            return SPLIT_EVERY
        return max(SPLIT_EVERY, math.ceil(split_cost / SPLIT_BUDGET))

    def due(
        self,
        step: int,
        world_size: int,
        gradient_accumulation_steps: int,
        *,
        can_split: bool = False,
        split_cost: Callable[[], float | None] | None = None,
    ) -> bool:
        """Whether optimizer step ``step`` (completed steps before it) is measured; at one pass in total
        only where it ``can_split`` (see the class docstring), which counts it as split.
        ``split_cost``: what a split step costs more than the whole one (a fraction), asked only once
        :data:`SPLIT_EVERY` due steps have passed since the last split."""
        if not self.every or step % self.every:
            return False
        if world_size * gradient_accumulation_steps > 1:
            return True
        if can_split:
            if self.last_split is not None:
                since = step - self.last_split
                if since < SPLIT_EVERY * self.every:
                    return False
                if since < self.split_interval(split_cost() if split_cost else None) * self.every:
                    return False
            self.last_split = step
            return True
        if not self.warned:
            self.warned = True
            split = (
                f", or let ds_adabatch.initialize's training_data feed the steps (it then measures one step "
                f"in {SPLIT_EVERY} as two half passes)"
                if self.splits
                else ""
            )
            holds = "goodput decides on step cost alone" if self.by_cost else "the batch holds"
            logger.warning(
                "%s: step %d is a single micro-batch on a single rank, so the noise scale cannot be "
                "measured and %s until a step of two or more passes measures it; make "
                "max_micro_batch_per_gpu smaller than the global batch (two or more accumulation steps) or "
                "train on more ranks%s",
                self.schedule,
                step,
                holds,
                split,
            )
        return False
