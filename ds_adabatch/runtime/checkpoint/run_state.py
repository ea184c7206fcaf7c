"""The adabatch section of a checkpoint (and of a live snapshot): the run's state, global values only.

It holds the plan, the exact sample and token counts, the plan history, the LR coupling, the loader's
cursor and what the step core decides from (:meth:`StepCore.state_dict`: scheduled batch, override,
schedule state, signals, learned micro-batch limit). All counts are global, so a resume on another world
size re-shards the same sample stream. The engine it is read from and written into is described by
:class:`CheckpointedEngine`; this layer imports no engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..core.metrics import PlanChange

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ...data.loader import ElasticDataLoader
    from ...data.token_loader import TokenBudgetLoader
    from ...plan import BatchPlan
    from ...schedules import BatchSizeController
    from ..core.lr import BatchCoupledLR
    from ..core.step_core import StepCore
    from ..memory.recovery import OomRecovery

__all__ = ["STATE_KEY", "STATE_VERSION", "CheckpointedEngine", "RunState", "processes"]

logger = logging.getLogger("ds_adabatch")

STATE_VERSION = 1
STATE_KEY = "ds_adabatch"


class CheckpointedEngine(Protocol):
    """What the checkpoint layer reads from and writes into an adaptive engine (its public state)."""

    deepspeed: DeepSpeedEngine
    """The DeepSpeed engine (its ``save_checkpoint`` / ``load_checkpoint``, ``global_samples``)."""
    rank: int
    world_size: int
    plan: BatchPlan
    core: StepCore
    controller: BatchSizeController
    lr_coupling: BatchCoupledLR
    memory_recovery: OomRecovery
    dataloader: ElasticDataLoader | TokenBudgetLoader | None
    history: list[PlanChange]
    global_steps: int
    global_samples: int
    global_tokens: int
    token_budget: bool

    def resolve_losses(self) -> None: ...

    def adabatch_state_dict(self) -> dict[str, Any]: ...

    def load_adabatch_state_dict(self, state: dict[str, Any]) -> None: ...


class RunState:
    """Writes and reads an engine's adabatch section (see the module docstring).

    Args:
        engine: the engine whose state it is.
        data_state: the loader's state to save (the forward / backward / step loop's, inside a step,
            is the state before that step).
    """

    def __init__(self, engine: CheckpointedEngine, data_state: Callable[[], Any]) -> None:
        self.engine = engine
        self.data_state = data_state

    def state_dict(self) -> dict[str, Any]:
        """The adabatch part of a checkpoint (global counts only, so a resume can re-shard)."""
        engine = self.engine
        core = engine.core.state_dict()
        return {
            "version": STATE_VERSION,
            "world_size": engine.world_size,
            # Processes of the whole job (data-parallel ranks x pipeline stages x tensor ranks): the
            # per-process RNG files are restored only where the layout is the same.
            "processes": processes(),
            "global_batch": engine.plan.global_batch_size,
            "scheduled_batch": core["scheduled_batch"],
            "plan": engine.plan.to_dict(),
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "global_tokens": engine.global_tokens,
            "history": [e.to_dict() for e in engine.history],
            "override": core["override"],
            "controller": core["controller"],
            "data": self.data_state(),
            "lr": engine.lr_coupling.state_dict(),
            "loss_ema": core["loss_ema"],
            "noise": core["noise"],
            "noise_cadence": core["noise_cadence"],
            "last_loss": core["last_loss"],
            "last_grad_norm": core["last_grad_norm"],
            "memory": core["memory"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Load the counts, the history, the loader's cursor and the step core's state; return the
        global batch to resume at (re-planned for this world size, said on rank 0 when it changed)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"checkpoint holds ds_adabatch state version {state.get('version')!r}; this version "
                f"reads {STATE_VERSION}"
            )
        engine = self.engine
        engine.global_steps = state["global_steps"]
        engine.global_samples = state["global_samples"]
        engine.global_tokens = state["global_tokens"]
        engine.history = [PlanChange(**e) for e in state["history"]]
        if engine.dataloader is not None and state.get("data") is not None:
            engine.dataloader.load_state_dict(state["data"])
        engine.core.load_state_dict(state)
        # Token-budget steps resume at the scheduled token target (the sample count varies per step).
        saved = state["scheduled_batch"] if engine.token_budget else state["global_batch"]
        batch = engine.controller.resume_batch(saved, state["world_size"])
        if batch != saved and engine.rank == 0:
            logger.warning(
                "resuming on %d ranks (checkpoint: %d): continuing with global batch %d instead of %d",
                engine.world_size,
                state["world_size"],
                batch,
                saved,
            )
        return batch


def processes() -> int:
    """Processes of the whole job (1 without a process group)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
