"""Out-of-memory recovery inside one optimizer step: agree, discard, re-plan, re-run the same samples.

The engine wraps one step's forward/backward passes in :meth:`OomRecovery.run`::

    snapshot RNG state and DeepSpeed's micro-step counter
    loop:
        attempt()                                  # the step's micro-batches; begin_pass() before each
        ok -> return
        OOM on some rank, agreed by every rank     # see ds_adabatch.runtime.memory.oom
        discard_partial_step(ds); free cached memory; restore the snapshot
        replan(failed ranks)                        # smaller limit -> new plan -> same samples re-cut

Nothing else moves during a retry: the optimizer, the LR scheduler, the step and sample counters
and the data cursor advance once, when the step finally completes. With recovery off (``memory.
recover_from_oom: false`` and an integer ``max_micro_batch_per_gpu``) :meth:`run` calls the attempt
once and an OOM propagates untouched.

Around it: the peak-memory predictor (:mod:`ds_adabatch.runtime.memory.predictor`) reads the allocator at
every pass and its agreed verdict caps the next step's limit; an OOM that cannot be re-planned is
recorded next to the checkpoints before it propagates (:mod:`ds_adabatch.runtime.memory.restart_record`), and
``load_checkpoint`` imposes such records on the learned limits.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ...plan import BatchPlan, plan_batch
from . import restart_record
from .limit import MicroBatchMemory
from .oom import (
    NO_VERDICT,
    OomAgreement,
    PeerOutOfMemory,
    UnrecoverableOutOfMemory,
    discard_partial_step,
    is_out_of_memory,
)
from .predictor import PeakPredictor

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ...config import AdaBatchConfig

__all__ = [
    "OomRecovery",
    "engine_oom_recovery",
    "memory_for",
    "optimizer_step_oom",
    "replan_after_oom",
    "resplit_micro_batches",
]

logger = logging.getLogger("ds_adabatch")
T = TypeVar("T")


class OomRecovery:
    """The learned micro-batch limit plus, when armed, the per-pass agreement and the retry loop."""

    def __init__(
        self,
        ds_engine: DeepSpeedEngine,
        config: AdaBatchConfig,
        *,
        rank: int,
        world_size: int,
        memory: MicroBatchMemory | None = None,
        model_communicates: bool = False,
        records: restart_record.RestartRecords | None = None,
    ) -> None:
        self.deepspeed = ds_engine
        self.memory = memory if memory is not None else memory_for(config)
        self.agreement: OomAgreement | None = None
        self.predictor: PeakPredictor | None = None
        self.rank = rank
        if config.memory.recover_from_oom:
            self.agreement = OomAgreement(
                ds_engine, rank=rank, world_size=world_size, device=ds_engine.device
            )
            # A model that communicates inside its forward and backward (tensor parallelism): its own
            # collectives are not agreement points, so each pass agrees before it starts and an OOM
            # inside one is survived through a restart (restart_record.py), never re-planned in place.
            self.agreement.agree_at_pass_start = model_communicates
            # It also tells a record which size failed, so it runs with predict_peak off too.
            self.predictor = PeakPredictor(
                ds_engine.module,
                device=ds_engine.device,
                unit="tokens" if config.token_budget else "samples",
                margin=config.memory.peak_margin,
                device_memory_bytes=config.memory.device_memory_bytes,
                key=lambda: self.memory.key,
                measure=config.memory.predict_peak,
            )
            if config.memory.predict_peak:
                self.agreement.local_verdict = self._local_verdict
        self.where = ""
        self.pass_index: int | None = None  # the micro-batch running now; None: the optimizer step
        self.in_optimizer_step = False  # the step's passes are done: DeepSpeed's optimizer step runs
        self.ooms = 0  # out-of-memory events recovered so far (global, identical on every rank)
        if records is None:
            records = restart_record.RestartRecords(rank, config.memory.record_dir)
            # Records an earlier start of this launch (or memory.record_dir) holds bound the first plan.
            records.start(self.memory, "tokens" if config.token_budget else "samples")
        self.records = records  # given: its owner imposed what it holds already

    def close(self) -> None:
        """Remove the predictor's module hook (the engine's ``close`` calls it)."""
        if self.predictor is not None:
            self.predictor.close()

    @property
    def armed(self) -> bool:
        return self.agreement is not None and self.agreement.armed

    def mode(self, off: str | None) -> str:
        """What an out-of-memory error leads to (``engine.oom_recovery``): ``off:<why>`` given ``off``,
        ``off:no_accelerator`` where nothing can raise one, ``restart`` or ``in_step``."""
        if off is not None:
            return f"off:{off}"
        if not self.armed:
            return "off:no_accelerator"
        return "restart" if self.agreement.agree_at_pass_start else "in_step"

    def max_memory_allocated(self) -> int:
        """The process's peak allocated accelerator memory (bytes): the predictor's, which folds in every
        per-pass reading it reset, else the accelerator's own counter."""
        measured = self.predictor.max_memory_allocated() if self.predictor is not None else None
        if measured is not None:
            return measured
        from deepspeed.accelerator import get_accelerator

        return int(get_accelerator().max_memory_allocated())

    def begin_pass(self, where: str, index: int | None = None) -> None:
        """Called before each micro-batch (``index``: its position in the step): a new pass, with its
        own agreement point."""
        self.in_optimizer_step = False
        if self.agreement is not None:
            self.where = where
            self.pass_index = index
            self.agreement.begin_pass()
            if self.armed:
                self.predictor.begin_pass()

    def failed_passes(self, ranks: list[int]) -> dict[int, int | None]:
        """The pass each of ``ranks`` ran out of memory in at the last agreement (None: unknown)."""
        known = self.agreement.failed_passes if self.agreement is not None else {}
        return {r: known.get(r) for r in ranks}

    def run(self, attempt: Callable[[], T], replan: Callable[[list[int]], None]) -> T:
        """``attempt()`` until it completes; after an agreed OOM, clean up and call ``replan(ranks)``."""
        if not self.armed:
            return attempt()
        snapshot = self._snapshot()
        while True:
            ok, value, ranks = self._try(attempt)
            if ok:
                self.take_verdict()
                return value  # type: ignore[return-value]
            self.predictor.discard_pass()
            self.ooms += 1
            # Outside the except block: the exception's traceback (and the activations its frames
            # hold) is gone, so the cache can really be freed.
            discard_partial_step(self.deepspeed)
            gc.collect()
            _empty_cache()
            self._restore(snapshot)
            replan(ranks)

    def take_verdict(self) -> None:
        """After a step that completed (:meth:`run`, or the last pass of the forward / backward / step
        loop): the predictor's verdict agreed in its passes caps the learned limit. Identical on every
        rank: the minimum over ranks."""
        if self.armed and self.agreement.local_verdict is not None:
            agreed = self.agreement.agreed_verdict
            self.memory.set_cap(None if agreed == NO_VERDICT else agreed)

    def _try(self, attempt: Callable[[], T]) -> tuple[bool, T | None, list[int]]:
        assert self.agreement is not None
        try:
            return True, attempt(), []
        except PeerOutOfMemory as exc:
            return False, None, exc.ranks
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            if self.in_optimizer_step:
                # No smaller plan helps and no record would either: say what to change instead.
                raise optimizer_step_oom(self.deepspeed, self.rank, self.where) from exc
            # Raises UnrecoverableOutOfMemory (chained to exc) when this pass already agreed.
            try:
                ranks = self.agreement.report_oom(self.where, self.pass_index)
            except UnrecoverableOutOfMemory as unrecoverable:
                self._record(unrecoverable)
                raise unrecoverable from exc
            return False, None, ranks

    def begin_optimizer_step(self, step: int) -> None:
        """The step's last pass is done: an out-of-memory error from now on is the optimizer step's.

        A last pass that issued no collective yet agrees here, before ``step()``: under caller-owned
        accumulation (``managed_gradient_accumulation: false``) ZeRO 0 and 1 reduce inside DeepSpeed's
        ``step()``, and a peer's failure must not be learned in there (DeepSpeed 0.19.8 leaves the engine
        inside its step, a boundary for every later backward on this rank only). Under managed
        accumulation the last pass always agreed already: nothing is exchanged."""
        if self.agreement is not None:
            self.agreement.agree_before_step()
        self.where = f"in the optimizer step of step {step}"
        self.pass_index = None
        self.in_optimizer_step = True

    def _local_verdict(self) -> int:
        verdict = self.predictor.verdict() if self.predictor is not None else None
        return NO_VERDICT if verdict is None else verdict

    # -- unrecoverable errors: recorded for the next start (restart_record.py) -------------------
    def _record(self, error: UnrecoverableOutOfMemory) -> None:
        size = self.predictor.pass_size if self.predictor is not None else None
        # The optimizer step, or a size never read: the limit in force is what failed.
        self.records.record(
            error, self.memory.key, size or self.memory.limit, where=self.where, good=self.memory.good_size()
        )

    def use_checkpoint_dir(self, folder: str) -> None:
        """``load_checkpoint(folder)`` is starting: impose the records an earlier process left there, and
        record there from now on. On every rank."""
        unit = self.predictor.unit if self.predictor is not None else "samples"
        self.records.impose(folder, self.memory, unit)

    def checkpoint_saved(self, folder: str) -> None:
        """A complete checkpoint in ``folder`` now holds what the imposed records taught. On every rank."""
        self.records.saved(folder)

    def _snapshot(self) -> dict[str, Any]:
        state: dict[str, Any] = {"micro_steps": self.deepspeed.micro_steps, "cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        # The retry draws the same random numbers (dropout) as a first attempt would have, and
        # DeepSpeed's micro-step counter counts each micro-batch of the completed step once.
        self.deepspeed.micro_steps = state["micro_steps"]
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])


def optimizer_step_oom(ds_engine: DeepSpeedEngine, rank: int, where: str) -> UnrecoverableOutOfMemory:
    """The error for an out-of-memory error inside DeepSpeed's optimizer step: exit code 1, no record.

    The optimizer step allocates the optimizer state, the fp32 master weights and the step's buffers,
    none of which a smaller micro-batch shrinks, so neither an in-step re-plan nor a restart below the
    failed micro-batch can succeed. The message names the change that can, for this engine's ZeRO
    stage, offload and data-parallel size.
    """
    stage = int(ds_engine.zero_optimization_stage() or 0)
    offload = getattr(ds_engine.zero_offload_optimizer(), "device", None)
    offloaded = offload is not None and str(getattr(offload, "value", offload)) != "none"
    replicas = int(getattr(ds_engine, "dp_world_size", 1) or 1)
    if stage == 0 and replicas > 1:
        change = (
            "partition the optimizer state over the data-parallel ranks: set zero_optimization.stage "
            "to 1 (2 partitions the gradients as well)"
        )
    elif not offloaded:
        change = (
            'keep the optimizer state in host memory: zero_optimization.offload_optimizer {"device": '
            '"cpu"}' + (" with zero_optimization.stage 1 or more" if stage == 0 else "")
        )
    else:
        change = (
            "the optimizer state is already partitioned and offloaded: spread it over more GPUs, "
            "use ZeRO-3, or train a smaller model"
        )
    return UnrecoverableOutOfMemory(
        f"out of memory on rank {rank} {where}: the step cannot be re-planned, and a smaller "
        "micro-batch would not help (the optimizer step allocates the optimizer state, the fp32 master "
        "weights and its buffers, none of which depends on the micro-batch), so nothing is recorded "
        f"for a restart. To fit it, {change}. This process exits and the launcher stops the others"
    )


def replan_after_oom(
    memory: MicroBatchMemory, plan: BatchPlan, ranks: list[int], step: int, allow_uneven: bool
) -> tuple[BatchPlan, str, str]:
    """The same global batch with smaller micro-batches after ``ranks`` ran out of memory at ``plan``.

    Returns ``(new plan, reason for engine.history, the log line)``.

    Raises:
        UnrecoverableOutOfMemory: ``plan``'s micro-batch was 1 sample.
    """
    micro = plan.micro_batch_per_gpu
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    try:
        memory.on_oom(micro)
    except MemoryError:
        raise UnrecoverableOutOfMemory(
            f"out of memory on {who} at a micro-batch of 1 sample in step {step}: nothing smaller to "
            "try. One sample needs less memory: ZeRO-3, CPU offload, activation checkpointing or "
            "shorter sequences"
        ) from None
    # An epoch tail is planned unevenly whatever allow_uneven says (as the sampler plans it).
    new = plan_batch(
        plan.global_batch_size, plan.world_size, memory.limit, allow_uneven=allow_uneven or not plan.is_even
    )
    line = (
        f"step {step}: OOM on {who} at micro {micro} -> micro {new.micro_batch_per_gpu} x gas "
        f"{new.gradient_accumulation_steps}, same samples"
    )
    return new, f"out of memory on {who} at micro {micro}; same samples", line


def replan_token_step_after_oom(
    memory: MicroBatchMemory, sampler: Any, step: Any, failed: dict[int, int | None], number: int
) -> tuple[Any, str, str]:
    """The same token-budget step cut with a lower token budget after some ranks ran out of memory.

    ``step`` is the :class:`~ds_adabatch.data.tokens.TokenStep` that failed and ``failed`` maps each
    failed rank to the pass it failed in (None: not in a pass, e.g. the optimizer step, when every pass
    of that rank counts; see :attr:`~ds_adabatch.runtime.memory.oom.OomAgreement.failed_passes`). The learned
    limit (tokens per pass) drops below the failed pass's padded tokens, ``sampler.pass_budget`` follows
    it, and the step's samples are re-cut (a sample above the lower budget runs alone). Returns ``(the
    re-cut step, reason for engine.history, the log line)``.

    Raises:
        UnrecoverableOutOfMemory: every failed pass held a single sample: nothing smaller to cut.
    """
    ranks = sorted(failed)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    costs = [
        step.pass_cost(r, p)
        for r in ranks
        for p in ([failed[r]] if failed[r] is not None else range(step.passes))
    ]
    splittable = [cost for cost, samples in costs if samples > 1]
    if not splittable:
        cost = max(cost for cost, _ in costs)
        raise UnrecoverableOutOfMemory(
            f"out of memory on {who} in step {number}, in a pass of one sample ({cost} tokens "
            "with padding): nothing smaller to cut. Lower adabatch.micro_batch_tokens with "
            "truncate_long_samples, or make one sample need less memory (ZeRO-3, CPU offload, "
            "activation checkpointing)"
        )
    cost = max(splittable)
    old_budget = step.budget
    memory.on_oom(cost)
    sampler.pass_budget = memory.limit  # its ceiling is micro_batch_tokens (memory_for)
    new = sampler.repack(step)
    line = (
        f"step {number}: OOM on {who} at {cost} tokens per pass -> token budget {old_budget} -> "
        f"{new.budget}, {step.passes} -> {new.passes} passes, same samples"
    )
    return new, f"out of memory on {who} at {cost} tokens per pass; same samples", line


def resplit_micro_batches(micro: list[tuple[Any, int]], gas: int) -> list[tuple[Any, int]]:
    """This rank's ``(batch, samples)`` micro-batches (pads have 0) re-cut into ``gas`` ones, in order:
    a retry of a ``train_batch(data_iter)`` step runs the same samples with the new plan's GAS."""
    real = [b for b, n in micro if n]
    if not real:
        return [(micro[0][0], 0)] * gas
    whole = _concat(real)
    total = sum(n for _, n in micro)
    out = []
    for k in range(gas):
        lo, hi = total * k // gas, total * (k + 1) // gas
        out.append((_slice(whole, lo, hi), hi - lo) if hi > lo else (_slice(whole, 0, 1), 0))
    return out


def _concat(batches: list[Any]) -> Any:
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, dict):
        return {k: _concat([b[k] for b in batches]) for k in first}
    if isinstance(first, (list, tuple)):
        parts = [_concat([b[i] for b in batches]) for i in range(len(first))]
        return type(first)(parts) if not hasattr(first, "_fields") else type(first)(*parts)
    raise TypeError(
        f"an out-of-memory retry cannot re-split a micro-batch of type {type(first).__name__}; "
        "pass training_data to ds_adabatch.initialize instead of train_batch(data_iter)"
    )


def _slice(batch: Any, lo: int, hi: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi]
    if isinstance(batch, dict):
        return {k: _slice(v, lo, hi) for k, v in batch.items()}
    parts = [_slice(v, lo, hi) for v in batch]
    return type(batch)(parts) if not hasattr(batch, "_fields") else type(batch)(*parts)


def memory_for(config: AdaBatchConfig) -> MicroBatchMemory:
    """The learned micro-batch limit an ``"adabatch"`` section (:class:`AdaBatchConfig`) asks for: in
    samples per pass, or with ``micro_batch_tokens`` in tokens per pass (that budget is its ceiling)."""
    if config.token_budget:
        budget = int(config.micro_batch_tokens)
        return MicroBatchMemory(
            budget,
            budget,
            grow_after_steps=config.memory.grow_after_steps,
            backoff_factor=config.memory.backoff_factor,
        )
    return MicroBatchMemory(
        config.initial_micro_batch_limit,
        config.micro_batch_limit,
        grow_after_steps=config.memory.grow_after_steps,
        backoff_factor=config.memory.backoff_factor,
    )


def _empty_cache() -> None:
    try:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().empty_cache()
    except Exception:  # pragma: no cover - a CPU accelerator without a cache
        pass


def engine_oom_recovery(
    ds_engine: DeepSpeedEngine,
    cfg: AdaBatchConfig,
    *,
    rank: int,
    agreement_world: int,
    model_communicates: bool,
    recovers_from_oom: bool = True,
) -> tuple[OomRecovery, str | None]:
    """An adaptive engine's out-of-memory recovery over ``ds_engine``, and why it is off (``"config"``,
    ``"pipeline"``) or None. ``recovers_from_oom`` False: the engine's passes cannot be recovered (the
    pipeline's), whatever ``memory.recover_from_oom`` (``cfg``, the ``"adabatch"`` section) says."""
    off = None if cfg.memory.recover_from_oom else "config"
    memory_cfg = cfg
    if not recovers_from_oom:
        if off is None and rank == 0:
            # On by default everywhere else: say so once, loudly (the JSONL says it every step).
            logger.warning(
                "out-of-memory recovery is off under pipeline parallelism (a stage that fails "
                "mid-schedule leaves its neighbours blocked in point-to-point transfers): an "
                "out-of-memory error ends the job. Size max_micro_batch_per_gpu to fit, and set "
                "adabatch.memory.recover_from_oom to false to acknowledge it and silence this line"
            )
        off = off or "pipeline"
        memory_cfg = cfg.model_copy(
            update={"memory": cfg.memory.model_copy(update={"recover_from_oom": False})}
        )
    recovery = OomRecovery(
        ds_engine, memory_cfg, rank=rank, world_size=agreement_world, model_communicates=model_communicates
    )
    return recovery, off
