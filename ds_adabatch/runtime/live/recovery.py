"""Live elasticity: a lost node costs the survivors seconds and no sample, in the same processes.

``adabatch.live_elastic.enabled`` arms it (``docs/clusters.md``). Each ``engine.train_batch()`` then
runs inside :meth:`LiveRecovery.run_step`::

    step      the optimizer step, its loss resolved over ranks (a failure surfaces here, not later)
    snapshot  every snapshot_every steps: own partition + a buddy's copy in host memory (live_snapshot)
    failure   a collective raised (peer reset, closed, timed out) ->
      teardown    the DeepSpeed engine, the process groups, partial gradients (live_world)
      agree       the survivors agree on who is left, on the launcher's store
      re-form     a new default group among them; DeepSpeed's group seeded with the timeout
      assemble    the newest step every partition of which a survivor holds, broadcast, made whole
      unpartition ZeRO 3: the model's parameters whole again from it, no collective (live_zero3)
      rebuild     the same initialize() on the smaller world; the state restored; the same global
                  batch re-planned (micro-batch / GAS up); the steps after the snapshot trained again

Every failure of that path (a node and its buddy both lost, the store's host lost, a survivor left out,
the agreement past its timeout, more than ``max_shrinks``) raises :class:`LiveRecoveryFailed` with one
log line saying why: the process exits, torchrun restarts the workers and the job resumes from the last
complete checkpoint (the restart path). Workers that torchrun restarts (a node joining, the restart
path) restore from the host-memory snapshots when every partition is still held, before any checkpoint.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from ..core.step_core import plan_change
from ..distributed.process_group import restart_safe_namespace
from .failures import LiveRecoveryFailed, is_peer_failure
from .snapshot import (
    NoCompleteSnapshot,
    Snapshots,
    assemble,
    coverage_problem,
    prune_families,
    restore,
    snapshot_root,
)
from .units import Assembled
from .world import LeftOut, LiveWorld, StoreLost, teardown_process_groups
from .zero3 import full_shapes, unpartition_model

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.distributed import ProcessGroup

    from ...config.live import LiveElasticConfig
    from ...plan import BatchPlan
    from ..core.loss import StepLoss
    from ..engine.data_parallel import AdaptiveBatchEngine
    from ..pipeline.engine import AdaptivePipelineEngine

__all__ = [
    "LiveRecovery",
    "LiveRecoveryFailed",
    "attach_live_recovery",
    "is_peer_failure",
    "prepare_live_world",
]

logger = logging.getLogger("ds_adabatch")


def prepare_live_world(
    live: LiveElasticConfig,
    *,
    pipelined: bool,
    mpu: Any,
    training_data: Any,
    optimizer: Any,
    lr_scheduler: Any,
) -> tuple[LiveWorld | None, str | None]:
    """The live world for an engine about to be built, or None and why live recovery is off.

    Called before ``deepspeed.initialize`` so that DeepSpeed's group can be seeded with the timeout.
    """
    if not live.enabled:
        return None, "off:config"
    reason = None
    if pipelined:
        reason = "pipeline parallelism (a stage's state has no copy on another stage)"
    elif mpu is not None:
        reason = "tensor parallelism (an mpu)"
    elif training_data is None:
        reason = "train_batch(data_iter) (micro-batches the job cannot draw again); pass training_data"
    elif isinstance(training_data, torch.utils.data.IterableDataset):
        reason = "an IterableDataset (its stream cannot be re-sharded); use a map-style dataset"
    elif isinstance(optimizer, torch.optim.Optimizer) or (
        lr_scheduler is not None and not callable(lr_scheduler)
    ):
        # A rebuild on the smaller world needs a fresh optimizer: DeepSpeed's ZeRO optimizer rewrites
        # the param_groups of the instance it wraps.
        reason = (
            "an optimizer or LR scheduler instance (the engine is rebuilt after a loss: give them in the "
            "ds_config's optimizer / scheduler sections, or pass callables)"
        )
    elif restart_safe_namespace() is None or not torch.distributed.is_initialized():
        reason = (
            "a launch other than torchrun (use ds-adabatch-run or torchrun with one agent per node: "
            "--nnodes MIN:MAX --nproc-per-node N --rdzv-backend c10d)"
        )
    if reason is not None:
        return None, f"off:{reason}"
    world = LiveWorld(
        restart_safe_namespace(),
        backend=torch.distributed.get_backend(),
        timeout=timedelta(seconds=live.collective_timeout_s),
        heartbeat_period=live.heartbeat_period_s,
        dead_after=live.dead_after_s,
        agree_timeout=live.agree_timeout,
    )
    return world, None


def attach_live_recovery(
    engine: AdaptiveBatchEngine | AdaptivePipelineEngine,
    live: LiveElasticConfig,
    world: LiveWorld | None,
    off: str | None,
    model: torch.nn.Module,
    rebuild: Callable[[], Any],
) -> None:
    """Arm live recovery on a freshly built engine, or record why it is off (one warning on rank 0)."""
    if world is not None:
        problem = coverage_problem(engine.deepspeed)
        if problem is not None:
            world.close()
            world, off = None, f"off:{problem}"
    if world is None:
        engine.attach_live(None, off)
        if off != "off:config" and engine.rank == 0:
            logger.warning(
                "adabatch.live_elastic is enabled but not available with %s: a lost node takes the restart "
                "path (exit, torchrun restart, resume from the last complete checkpoint)",
                off[len("off:") :],
            )
        return
    recovery = LiveRecovery(engine, live, world, model, rebuild)
    engine.attach_live(recovery, None)
    recovery.start()


class CurrentOptimizer:
    """The optimizer ``initialize`` returns while live recovery is armed: the current DeepSpeed engine's.

    A recovery rebuilds the DeepSpeed engine, and with it the optimizer, on the smaller world. A script
    that kept the optimizer ``initialize`` returned (to read ``param_groups``, save ``state_dict()``, call
    ``zero_grad()``) keeps this handle, which reads and calls whatever optimizer the engine drives now.
    """

    def __init__(self, engine: AdaptiveBatchEngine) -> None:
        object.__setattr__(self, "_engine", engine)

    @property
    def current(self) -> Any:
        """The DeepSpeed engine's optimizer now (None during a recovery)."""
        ds = object.__getattribute__(self, "_engine").deepspeed
        return None if ds is None else ds.optimizer

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.current, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.current, name, value)

    def __repr__(self) -> str:
        return f"CurrentOptimizer({self.current!r})"


class SnapshotCadence:
    """When to snapshot: every ``every`` steps, or with ``"auto"`` the smallest interval at which
    snapshots cost at most ``AUTO_BUDGET`` of the step time.

    ``"auto"`` measures the first ``3 x AUTO_PROBES`` steps of a world with a snapshot every third
    step: one snapshot costs its own time plus what the buddy copy in flight adds to the step after it
    (that step's time minus the third, clean step's). Every rank then takes the largest interval any
    rank needs (one all-reduce), so all ranks snapshot the same steps.
    """

    AUTO_PROBES = 3
    AUTO_BUDGET = 0.02

    def __init__(self, every: int | str) -> None:
        self.every = every if isinstance(every, int) else None
        self.last = 0
        self._since: list[float] = []  # step times since the last snapshot, while measuring
        self._costs: list[float] = []
        self._clean: list[float] = []
        self._snap_s = 0.0

    def step_done(self, seconds: float) -> None:
        if self.every is None:
            self._since.append(seconds)

    def due(self, step: int) -> bool:
        return step - self.last >= (self.every or 3)

    def snapshot_taken(self, step: int, seconds: float, group: ProcessGroup | None) -> None:
        self.last = step
        if self.every is not None:
            return
        if len(self._since) == 3:  # the step with the last snapshot's copy in flight, then two clean ones
            after, clean = self._since[0], statistics.median(self._since[1:])
            self._costs.append(self._snap_s + max(0.0, after - clean))
            self._clean.append(clean)
        self._since = []
        self._snap_s = seconds
        if len(self._costs) < self.AUTO_PROBES:
            return
        cost, step_s = statistics.median(self._costs), statistics.median(self._clean)
        need = torch.tensor([max(1, math.ceil(cost / (self.AUTO_BUDGET * max(step_s, 1e-9))))])
        torch.distributed.all_reduce(need, op=torch.distributed.ReduceOp.MAX, group=group)
        self.every = int(need.item())
        logger.info(
            "live elasticity: a snapshot costs %.1f ms against a %.1f ms step: one every %d step(s)",
            cost * 1e3,
            step_s * 1e3,
            self.every,
        )


def _remove_module_hooks(ds: DeepSpeedEngine) -> None:
    """DeepSpeed 0.19.8 puts a forward pre- and post-hook on the model (``_create_module_forward_*_hook``)
    that ``destroy()`` leaves: on the model, which outlives the engine, they would keep the failed engine
    (and its process groups) alive and run in every later forward."""
    for name in ("module_forward_pre_hook", "module_forward_post_hook"):
        handle = getattr(ds, name, None)
        if handle is not None:
            handle.remove()
            setattr(ds, name, None)


class LiveRecovery:
    """The step wrapper and the recovery of one process (see the module docstring)."""

    def __init__(
        self,
        engine: AdaptiveBatchEngine,
        live: LiveElasticConfig,
        world: LiveWorld,
        model: torch.nn.Module,
        rebuild: Callable[[], AdaptiveBatchEngine],
    ) -> None:
        self.engine = engine
        self.cfg = live
        self.world = world
        self.model = model
        self.rebuild = rebuild
        self.root = snapshot_root(live.snapshot_dir)
        self.shapes = full_shapes(model)
        # Under ZeRO 3 the model itself is partitioned over the world a loss breaks.
        self.zero3 = int(engine.deepspeed.zero_optimization_stage()) == 3
        self.shrinks = 0
        self.events: list[dict[str, Any]] = []
        self.restored_step: int | None = None
        self.snapshots: Snapshots | None = None
        self._group: ProcessGroup | None = None
        self._cadence = SnapshotCadence(live.snapshot_every)
        self._first_step_after: tuple[float, dict[str, Any]] | None = None

    # ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """At engine build: restore from host memory where a restarted incarnation finds a whole
        snapshot of this launch (a node joined, or the restart path), then take the first snapshot."""
        started = time.monotonic()
        self._group = self._host_group()
        try:
            state = assemble(self.root, self.world.job_id, self.shapes, self._group)
        except NoCompleteSnapshot:
            state = None
        if state is not None:
            self._load(state)
            self.restored_step = state.step
            if self.engine.rank == 0:
                logger.warning(
                    "restored step %d from host-memory snapshots on %d ranks in %.2f s (world %s of that "
                    "snapshot); a checkpoint older than it is not loaded",
                    state.step,
                    self.world.size,
                    time.monotonic() - started,
                    state.family,
                )
        self._new_snapshots()

    def _family(self) -> str:
        return f"{self.world.incarnation[:12]}g{self.world.generation}"

    def _host_group(self) -> ProcessGroup | None:
        """A gloo group of the whole world for what moves host memory (the assembly, the buddy copies,
        the cadence's agreement), whatever the backend of the default group."""
        return self.world.new_group(backend="gloo")

    @property
    def snapshot_every(self) -> int | None:
        """Steps between snapshots in this world: ``snapshot_every``, or the interval ``"auto"`` chose
        (None while it is still measuring)."""
        return self._cadence.every

    def _new_snapshots(self) -> None:
        """Snapshots of this world (after :meth:`_host_group`), the first one taken now."""
        self._cadence = SnapshotCadence(self.cfg.snapshot_every)
        self.snapshots = Snapshots(
            self.engine.deepspeed,
            root=self.root,
            job_id=self.world.job_id,
            family=self._family(),
            group=self._group,
        )
        self.world.publish_ports()
        self.snapshot_now()
        prune_families(self.root, self.world.job_id, keep=self._family())

    def snapshot_now(self) -> None:
        """Snapshot the engine's state now (after a step, a restore or a checkpoint load)."""
        self.engine.resolve_losses()
        started = time.perf_counter()
        self.snapshots.take(self.engine.global_steps, self.engine.adabatch_state_dict())
        self._cadence.snapshot_taken(self.engine.global_steps, time.perf_counter() - started, self._group)

    # ---------------------------------------------------------------------------------------------
    def run_step(self, step: Callable[[], StepLoss]) -> StepLoss:
        """Run one optimizer step; on a lost peer recover and run the step again on the new world."""
        while True:
            failure = None
            self.world.step_began()
            try:
                started = time.perf_counter()
                loss = step()
                # Resolved inside the step: a peer lost in that collective is caught here too.
                self.engine.resolve_losses()
                seconds = time.perf_counter() - started
                self._cadence.step_done(seconds)
                if self._cadence.due(self.engine.global_steps):
                    self.snapshot_now()
                self.world.step_ended(seconds)
            except RuntimeError as err:
                self.world.step_ended(None)
                if not is_peer_failure(err):
                    raise
                # First of all: the peers blocked on this process fail now, not at their timeout.
                self.world.break_connections()
                failure = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                if self.world.broken_by_watchdog:
                    failure = f"{self.world.broken_by_watchdog} ({failure})"
                    self.world.broken_by_watchdog = None
            if failure is None:
                self.world.arm()
                self._after_first_step()
                return loss
            # The step in progress, numbered as every step line numbers it (the first train_batch() is
            # step 0): this one, or the next where the snapshot exchange after it failed (the rollback
            # then undoes this one too).
            failed_step = self.engine.global_steps
            # Outside the except block: the exception's frames no longer hold the failed engine.
            logger.warning(
                "rank %d (process %d of the first world) lost a peer in step %d: %s",
                self.world.rank,
                self.world.origin,
                failed_step,
                failure,
            )
            self._recover(failure, time.monotonic(), failed_step)

    def _after_first_step(self) -> None:
        if self._first_step_after is None:
            return
        detected, event = self._first_step_after
        self._first_step_after = None
        event["first_step_s"] = time.monotonic() - detected
        if self.engine.rank == 0:
            logger.warning(
                "live shrink: first step on %d ranks done %.2f s after the loss was detected",
                self.world.size,
                event["first_step_s"],
            )

    def _recover(self, failure: str, detected: float, failed_step: int) -> None:
        """Recover from ``failure`` (detected at ``detected``, in step ``failed_step``): the new world
        formed, the engine rebuilt on it and restored from the snapshot; the recovery recorded."""
        old_size, old_plan = self.world.size, self.engine.plan
        phases: dict[str, float] = {}
        try:
            state, lost = self._rebuild_on_survivors(phases)
        except LiveRecoveryFailed as err:
            self._fail(str(err), failure)
        except (NoCompleteSnapshot, StoreLost, LeftOut, TimeoutError) as err:
            self._fail(str(err), failure)
        self.shrinks += 1
        redo = failed_step - state.step  # the steps before the failed one trained again
        event = {
            "kind": "shrink" if lost else "reform",
            "failed_step": failed_step,
            "rolled_back_to": state.step,
            "steps_redone": redo,
            "lost": lost,
            "world_size": self.world.size,
            "old_world_size": old_size,
            **phases,
            "recovery_s": time.monotonic() - detected,
        }
        self.events.append(event)
        self._first_step_after = (detected, event)
        self._record_recovery(event, old_plan, phases)
        if self.engine.rank == 0:
            self._log_recovery(event, failure, phases)

    def _rebuild_on_survivors(self, phases: dict[str, float]) -> tuple[Assembled, list[int]]:
        """Tear down, agree on the survivors, re-form, assemble the snapshot, rebuild and restore; each
        phase's seconds into ``phases``. Returns the assembled state and the lost processes."""
        mark = time.monotonic()

        def phase(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[name] = now - mark
            mark = now

        if self.shrinks >= self.cfg.max_shrinks:
            raise LiveRecoveryFailed(
                f"{self.shrinks} live recoveries already (adabatch.live_elastic.max_shrinks)"
            )
        self._release_failed_world()
        phase("teardown_s")
        # Every process alive (a transient network failure, a peer slower than the timeout): the
        # same members form the next generation, and the job goes on from the snapshot as after a
        # loss (max_shrinks bounds a failure that keeps coming back).
        members, lost = self.world.agree_on_survivors()
        self.world.form(members)
        self._group = self._host_group()
        phase("reform_s")
        state = assemble(self.root, self.world.job_id, self.shapes, self._group)
        if self.zero3:
            unpartition_model(self.model, state)
        phase("assemble_s")
        self.rebuild()  # the same engine object, driving a DeepSpeed engine of the new world
        phase("rebuild_s")
        self._load(state)
        self._new_snapshots()
        phase("restore_s")
        return state, lost

    def _record_recovery(self, event: dict[str, Any], old_plan: BatchPlan, phases: dict[str, float]) -> None:
        """The recovery in the engine's plan history and in the next step's metrics record."""
        engine = self.engine
        lost, old_size = event["lost"], event["old_world_size"]
        engine.history.append(
            plan_change(
                old_plan,
                engine.plan,
                step=engine.global_steps,
                samples=engine.global_samples,
                lr_multiplier=engine.lr_coupling.multiplier,
                reason=(
                    f"shrink: lost {lost} of {old_size} processes"
                    if lost
                    else f"reform: a collective failed with all {old_size} processes alive"
                ),
            )
        )
        engine.extend_next_record(
            {
                "live_shrink_world_size": float(self.world.size),
                "live_steps_redone": float(event["steps_redone"]),
                **{f"live_{k}": float(v) for k, v in phases.items()},
                "live_recovery_s": float(event["recovery_s"]),
            }
        )

    def _log_recovery(self, event: dict[str, Any], failure: str, phases: dict[str, float]) -> None:
        plan = self.engine.plan
        logger.warning(
            "live %s: lost process(es) %s in step %d (%s); %d -> %d ranks, rolled back to step %d "
            "(%d step(s) to train again), global batch %d = %d ranks x micro %d x GAS %d; %s",
            event["kind"],
            event["lost"],
            event["failed_step"],
            failure,
            event["old_world_size"],
            self.world.size,
            event["rolled_back_to"],
            event["steps_redone"],
            plan.global_batch_size,
            plan.world_size,
            plan.micro_batch_per_gpu,
            plan.gradient_accumulation_steps,
            " ".join(f"{k}={v:.3f}" for k, v in {**phases, "recovery_s": event["recovery_s"]}.items()),
        )

    def _fail(self, why: str, failure: str) -> NoReturn:
        logger.error(
            "live recovery not possible, taking the restart path (exit, torchrun restarts the workers, "
            "resume from the last complete checkpoint): %s; the failure was %s",
            why,
            failure,
        )
        raise LiveRecoveryFailed(f"live recovery not possible ({why}); the failure was {failure}")

    def _release_failed_world(self) -> None:
        """Drop everything that references the failed world's groups, then tear them down.

        The engine, the optimizer handle, the LR wrapper and the loader the script holds stay valid: the
        engine lets go of the DeepSpeed engine (and the LR wrapper of its optimizer), so nothing the
        script holds reaches the failed world's groups; they close when collected, and the rebuild
        gives the engine the new world's.
        """
        engine = self.engine
        if self.snapshots is not None:
            self.snapshots.release()
        ds = engine.deepspeed
        for close in (
            lambda: _remove_module_hooks(ds),
            lambda: ds.destroy(),  # removes ZeRO's gradient hooks; no collective
        ):
            try:
                close()
            except Exception as err:  # noqa: BLE001 - a broken world's object may fail to close
                logger.debug("closing the failed engine: %s", err)
        engine.release_deepspeed()
        ds = None
        self._group = None
        teardown_process_groups(self.model)

    def _load(self, state: Assembled) -> None:
        engine = self.engine
        restore(engine.deepspeed, state)
        adabatch = state.meta["adabatch"]
        engine.load_adabatch_state_dict(adabatch)
        engine.lr_coupling.load_state_dict(adabatch["lr"])
        engine.deepspeed.global_steps = adabatch["global_steps"]
        engine.deepspeed.global_samples = adabatch["global_samples"]

    # ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """At the end of the job: stop the heartbeat, delete this rank's snapshot files."""
        if self.snapshots is not None:
            self.snapshots.finish_exchange(wait=True)
            self.snapshots.remove_files()
            self.snapshots = None
        self.world.close()
