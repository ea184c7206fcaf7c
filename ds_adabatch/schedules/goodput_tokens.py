"""Goodput under token budgets (``micro_batch_tokens``): the shape of a step whose samples are packed.

With token budgets the global batch is still a number of samples, but no planner splits it: the
step's samples are packed into passes of at most the token budget, longest first, and dealt to the
ranks (:mod:`ds_adabatch.data.tokens`). A pass costs about its budget whatever its samples, so what a
batch costs is the number of passes it takes. The goodput schedule rates a batch ``B`` by a
:class:`PackedShape`: micro-batch = the token budget, GAS = the passes per rank the recent steps say
``B`` takes (:meth:`~ds_adabatch.signals.ThroughputModel.passes_for`: the recent samples' lengths packed
by the runtime's packer in runs of ``B``; until enough lengths were seen, the samples a full pass
held, each rank's last pass counted half full). Its time is predicted at that expected number of passes (not an
integer: the packing varies with the lengths); the nearest whole number keys the shape, so a batch
that takes as many passes as one measured is rated from that measurement and a batch that takes more
than any measured is a trial, as with whole micro-batches.

What the runtime feeds the model: every step's time with its token budget, its passes per rank and
its samples (:func:`ds_adabatch.runtime.core.step_times.step_shape`). The learned budget after an
out-of-memory error is a budget of its own (a new micro-batch to the fit), and the expected passes
follow the budget the next step is cut with (``ScheduleContext.pass_budget``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PackedShape", "describe_split", "packed_shape"]


@dataclass(frozen=True)
class PackedShape:
    """How a token-budget step of ``global_batch_size`` samples is expected to run (the module docstring):
    passes of ``micro_batch_per_gpu`` tokens, ``passes`` per rank (expected), and
    ``gradient_accumulation_steps`` that rounded (at least 1), the shape a trial is keyed by."""

    global_batch_size: int
    world_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    passes: float


def packed_shape(throughput: Any, batch: int, world: int, budget: int) -> PackedShape | None:
    """The :class:`PackedShape` of ``batch`` samples on ``world`` ranks with passes of ``budget`` tokens,
    from ``throughput`` (a :class:`~ds_adabatch.signals.ThroughputModel`); None before it has seen a
    token-budget step."""
    passes = throughput.passes_for(batch, world, budget)
    if passes is None:
        return None
    return PackedShape(int(batch), int(world), int(budget), max(1, round(passes)), passes)


def describe_split(plan: Any) -> str:
    """How a rated batch runs, for the plan-change line: ``micro 8 x gas 2``, or with token budgets
    ``2.4 passes of 512 tokens``."""
    if isinstance(plan, PackedShape):
        return (
            f"{plan.passes:.3g} pass{'' if plan.passes == 1 else 'es'} of {plan.micro_batch_per_gpu} tokens"
        )
    return f"micro {plan.micro_batch_per_gpu} x gas {plan.gradient_accumulation_steps}"
