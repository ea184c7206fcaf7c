"""Agreeing on an out-of-memory error inside a step, and discarding the step's partial gradients.

Why an agreement point, and where (DeepSpeed 0.19.8). A rank that raises ``torch.OutOfMemoryError``
stops issuing collectives; any other rank already inside one (a gradient reduce, a ZeRO-3 parameter
gather) would wait forever. So before the **first collective DeepSpeed issues in each forward/backward
pass**, every rank joins one small reduction of host integers (:mod:`ds_adabatch.runtime.distributed.agreement`:
recursive doubling, ``log2(world)`` message rounds of 16 bytes): a rank that is still healthy says 0; a
rank that has just caught an OOM jumps straight to it and says 1. If the sum is not 0, every rank then
learns which ranks failed, and in which micro-batch, from a second exchange of one flag per rank, and
the healthy ranks raise :class:`PeerOutOfMemory` from inside DeepSpeed *before* its collective, so no
rank is ever left in a collective the failed rank will not join. The same reduction carries the
smallest micro-batch limit the ranks' memory predictors allow (its minimum), so the predictor's verdict
is agreed without a collective of its own. The first collective of a pass is:

- ZeRO-0: ``DeepSpeedEngine.allreduce_gradients`` at the accumulation boundary (none before it);
- ZeRO-1/2 (and ZeRO-2 CPU offload): ``DeepSpeedZeroOptimizer.reduce_ipg_grads``, called when a
  gradient bucket fills during backward or at the end of backward (ZeRO-1 only at the boundary);
- ZeRO-3: the optimizer's ``__reduce_and_partition_ipg_grads`` and the parameter coordinator's
  ``__all_gather_params`` (a forward gathers parameters unless all are persistent).

An OOM on a rank that has already passed its agreement point in that pass cannot be recovered (the
others may be inside a later collective): it raises :class:`UnrecoverableOutOfMemory`, which names
where it happened. When nothing fails the cost is that one reduction per pass that has a collective
(ZeRO-0/1: once per optimizer step; ZeRO-2/3: once per micro-batch); in a world of one rank it costs
nothing. The flags are host facts (an exception was caught or not), so they travel over a gloo process
group of their own (:func:`~ds_adabatch.runtime.distributed.agreement.host_group`): the agreement never
synchronises a GPU.

Where it is armed: only where an out-of-memory error can be raised and survived, i.e. on an
accelerator (CUDA, ...). DeepSpeed's CPU accelerator allocates from host memory, where exhaustion ends
the process (the kernel's OOM killer) instead of raising, so on the CPU nothing is agreed and a steady
step stays free of collectives, unless a stand-in that raises them is installed (:mod:`.stand_ins`, e.g.
:func:`ds_adabatch.testing.simulated_memory_limit`).

:func:`discard_partial_step` then clears what the step accumulated, with each stage's own state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import deepspeed_internals as internals
from ..distributed.agreement import HostAgreement, host_group
from .stand_ins import oom_stand_in_installed

if TYPE_CHECKING:
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine

NO_VERDICT = 1 << 62
"""The predictor verdict of a rank that predicts nothing (the neutral value of the minimum)."""

__all__ = [
    "NO_VERDICT",
    "OomAgreement",
    "PeerOutOfMemory",
    "UnrecoverableOutOfMemory",
    "discard_partial_step",
    "is_out_of_memory",
]


class PeerOutOfMemory(RuntimeError):
    """Raised on a healthy rank, from DeepSpeed's first collective of a pass, when a rank ran out of memory."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"out of memory on rank(s) {ranks}; the step is re-planned")
        self.ranks = ranks


class UnrecoverableOutOfMemory(RuntimeError):
    """An out-of-memory error that cannot be turned into a smaller micro-batch (the message says why).

    Attributes:
        exit_code: the status to end the process with (``ds_adabatch.finish(exc.exit_code)``): 75 when
            the failing rank recorded a lower limit next to the checkpoints, so that a restart
            (``torchrun --max-restarts``) resumes below it; 1 when a restart cannot help (a micro-batch
            of one sample does not fit, or the error came from the optimizer step).
        record: the path of that record, or None.
    """

    exit_code: int = 1
    record: str | None = None


def is_out_of_memory(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` (CUDA, and the accelerators that raise it) and the
    ``RuntimeError("... out of memory ...")`` some accelerator back-ends raise instead."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class OomAgreement:
    """The per-pass agreement on out-of-memory errors, installed on one DeepSpeed engine.

    ``begin_pass()`` before every micro-batch; ``report_oom()`` from the rank that caught an OOM
    (returns the ranks that failed); DeepSpeed's wrapped collectives call ``_before_collective()``.
    ``armed`` False makes the wrappers pass straight through (no collective, no cost but a branch).
    """

    agree_at_pass_start = False
    """Agree when a pass begins rather than at its first DeepSpeed collective: for models whose forward
    and backward communicate themselves (tensor parallelism; see OomRecovery)."""

    def __init__(
        self, ds_engine: DeepSpeedEngine, *, rank: int, world_size: int, device: torch.device
    ) -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            # Every rank takes part (with model parallelism too: any rank's collective can hang).
            rank, world_size = dist.get_rank(), dist.get_world_size()
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.enabled = True
        self._can_raise = torch.device(device).type != "cpu"
        self.host = HostAgreement(rank, world_size, host_group())
        self._agreed = False
        # The last agreement's failed ranks and the micro-batch each failed in (None: not known).
        self.failed_passes: dict[int, int | None] = {}
        self.agreements = 0  # number of agreements issued (tests and benchmarks read it)
        # This rank's memory-predictor verdict (a micro-batch limit) and the minimum over ranks agreed last.
        self.local_verdict: Callable[[], int] | None = None
        self.agreed_verdict = NO_VERDICT
        self._install(ds_engine)

    @property
    def armed(self) -> bool:
        """Whether passes agree: enabled, and an out-of-memory error can be raised here (see above)."""
        if not self.enabled:
            return False
        return self._can_raise or oom_stand_in_installed()

    # -- the agreement ----------------------------------------------------------------------------
    def begin_pass(self) -> None:
        self._agreed = False
        if self.agree_at_pass_start and self.armed:
            failed = self._exchange(False)
            if failed:
                raise PeerOutOfMemory(failed)

    @property
    def passed_agreement(self) -> bool:
        """True once this pass's agreement ran (an OOM after it is not recoverable)."""
        return self._agreed

    def _exchange(self, failed: bool, pass_index: int | None = None) -> list[int]:
        self._agreed = True
        self.agreements += 1
        verdict = self.local_verdict() if self.local_verdict is not None else NO_VERDICT
        # A constant payload whatever the world size: whether any rank failed, and the smallest verdict
        # (the maximum of its negation: one operation for both elements keeps each round cheap).
        anyone, neg_verdict = self.host.reduce([int(failed), -verdict], ["max", "max"])
        self.agreed_verdict = -neg_verdict
        if not anyone:
            self.failed_passes = {}
            return []
        # Someone failed (every rank knows it now): which ranks, and where. A failed rank's flag is 1,
        # or 2 + the index of the micro-batch that failed when it knows it.
        flag = 0.0 if not failed else 1.0 if pass_index is None else 2.0 + pass_index
        values = self.host.gather_flags(flag)
        self.failed_passes = {r: (None if v < 2 else int(v) - 2) for r, v in enumerate(values) if v > 0}
        return list(self.failed_passes)

    def _before_collective(self) -> None:
        if not self.armed or self._agreed:
            return
        failed = self._exchange(False)
        if failed:
            raise PeerOutOfMemory(failed)

    def agree_before_step(self) -> None:
        """The agreement of a pass that reaches the optimizer step without one (caller-owned
        accumulation at ZeRO 0/1 reduces only inside ``step()``); nothing when this pass agreed already.

        Raises:
            PeerOutOfMemory: a rank ran out of memory in this pass.
        """
        self._before_collective()

    def report_oom(self, where: str, pass_index: int | None = None) -> list[int]:
        """This rank caught an OOM (in micro-batch ``pass_index`` of the step, when known); tell the
        others and return every rank that failed (:attr:`failed_passes` says where each failed).

        Raises:
            UnrecoverableOutOfMemory: this pass already passed its agreement point.
        """
        if self._agreed:
            if self.agree_at_pass_start:
                why = (
                    "under tensor parallelism every pass agrees when it begins (the model's own "
                    "collectives are not agreement points), so any out-of-memory error inside a pass ends "
                    "the step: lower max_micro_batch_per_gpu or the token budget"
                )
            else:
                why = (
                    "after the pass's agreement point (its first DeepSpeed collective): the other ranks "
                    "may be inside a later collective, so the step cannot be re-planned. This happens "
                    "inside the optimizer step, after a gradient bucket filled during backward, or under "
                    "ZeRO-3 after a forward gathered parameters. Lower max_micro_batch_per_gpu (or "
                    "adabatch.memory.initial_micro_batch_per_gpu), raise reduce_bucket_size, or raise "
                    "stage3_param_persistence_threshold"
                )
            raise UnrecoverableOutOfMemory(
                f"out of memory on rank {self.rank} {where}, {why}. This process exits and the launcher "
                "stops the others"
            )
        return self._exchange(True, pass_index)

    # -- wiring into DeepSpeed ----------------------------------------------------------------------
    def _install(self, ds: DeepSpeedEngine) -> None:
        plain = _bf16_zero1(ds.optimizer, int(ds.zero_optimization_stage()))
        for owner, name, when in internals.gradient_collective_gates(ds, plain_data_parallel=plain):
            internals.wrap_method(owner, name, self._before_collective, when)


def discard_partial_step(ds: DeepSpeedEngine) -> None:
    """Drop every gradient the current (unfinished) optimizer step accumulated, on this rank.

    Nothing is stepped: the optimizer, LR scheduler and counters are left alone. After it, the next
    micro-batch starts a fresh accumulation exactly as the first micro-batch of a step does.
    """
    stage = int(ds.zero_optimization_stage())
    opt = ds.optimizer
    if stage == 0 or _bf16_zero1(opt, stage):
        # Plain data parallel (0.19.8): gradients accumulate in param.grad (DeepSpeedEngine.zero_grad
        # sets them to None); the bf16 optimizer keeps fp32 accumulators (clear_hp_grads).
        ds.zero_grad()
        if hasattr(opt, "clear_hp_grads"):
            opt.clear_hp_grads()
        if hasattr(opt, "clear_lp_grads"):
            opt.clear_lp_grads(set_to_none=True)
    elif stage in (1, 2):
        internals.discard_zero12_accumulation(opt)
    else:
        internals.discard_zero3_accumulation(ds, opt)
    internals.reset_backward_depth(opt)


def _bf16_zero1(opt: DeepSpeedOptimizer | torch.optim.Optimizer, stage: int) -> bool:
    """ZeRO-1 with bf16 and fp32 gradient accumulation (``data_types.grad_accum_dtype: "fp32"``):
    DeepSpeed 0.19.8 runs it on its BF16_Optimizer, which reduces gradients like plain data parallel
    (``allreduce_gradients``) and keeps fp32 accumulators (``clear_hp_grads``), not ZeRO-1's buckets."""
    return stage == 1 and not hasattr(opt, "reduce_ipg_grads") and hasattr(opt, "clear_hp_grads")
