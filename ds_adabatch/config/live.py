"""The ``live_elastic`` sub-section of ``"adabatch"``: a lost node costs seconds, not a restart.

With ``enabled`` the survivors of a lost node keep their processes: they abandon the step in flight,
form a new process group among themselves on the launcher's store, rebuild the DeepSpeed engine for the
smaller world, restore the weights and optimizer state from host-memory snapshots (each rank keeps its
own ZeRO partition and a copy of one other rank's) and re-plan the same global batch
(:mod:`ds_adabatch.runtime.live.recovery`). What it needs and covers is in ``docs/clusters.md``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import ConfigProblem

__all__ = ["LiveElasticConfig", "live_elastic_problems"]


class LiveElasticConfig(BaseModel):
    """Survive a lost node in the same processes, from snapshots in host memory."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = Field(
        False,
        description=(
            "Keep the surviving processes when a node is lost: re-form the group among them, restore "
            "the newest snapshot every survivor can assemble and continue with the same global batch. "
            "Needs torchrun with one agent per node and the c10d rendezvous (--nnodes MIN:MAX "
            "--nproc-per-node 1 --rdzv-backend c10d), ZeRO stage 0-3 (stage 3 without offload), and "
            "training_data given to ds_adabatch.initialize; elsewhere a lost node takes the restart path (one warning says why)."
        ),
    )
    snapshot_every: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description=(
            "Take a host-memory snapshot every this many optimizer steps; a recovery rolls back to the "
            "newest complete one and trains the steps after it again (fewer than snapshot_every). "
            "'auto': the first steps of each world snapshot every third step and time what a snapshot "
            "adds (its own time and the slower step while its copy travels), then the smallest interval "
            "at which snapshots cost at most 2% of the step time is used (agreed by all ranks: the "
            "largest any rank needs)."
        ),
    )
    collective_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "Timeout of every collective of the training process groups, in seconds: a peer that hangs "
            "(rather than dies) is declared lost after this long. DeepSpeed's own data-parallel group "
            "gets it too (it would otherwise keep torch's 30-minute default). It applies once the first "
            "training step is done: the engine's build, what runs before the first step (a checkpoint "
            "load, an op compiled on one rank) and that step keep DeepSpeed's process-group timeout (DEEPSPEED_TIMEOUT "
            "minutes, 10 by default), as ranks may reach them minutes apart."
        ),
    )
    heartbeat_period_s: float = Field(
        0.2,
        gt=0,
        description="How often each process stamps its heartbeat in the launcher's store, in seconds.",
    )
    dead_after_s: float = Field(
        1.0,
        gt=0,
        description=(
            "A process whose heartbeat has not moved for this long, in seconds, counts as lost when "
            "the survivors agree on the new world, and the watchdog breaks a step that has run past "
            "max(dead_after_s, 2 x the typical step) while a member is that silent (a hung node). At "
            "least 3 x heartbeat_period_s."
        ),
    )
    agree_timeout_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Longest wait for the survivors to agree on the new world, in seconds; past it the job "
            "takes the restart path. Must exceed collective_timeout_s (a survivor blocked on another "
            "survivor learns of the loss only at its timeout). null: 2 x collective_timeout_s + 5."
        ),
    )
    max_shrinks: int = Field(
        8,
        ge=0,
        description=(
            "Live recoveries allowed in one process; the next loss takes the restart path (0: never "
            "recover live, snapshots are still taken for a grow)."
        ),
    )
    snapshot_dir: str | None = Field(
        None,
        min_length=1,
        description=(
            "Node-local folder in host memory for the snapshots (they outlive a worker that torchrun "
            "restarts when a node joins). null: /dev/shm/ds_adabatch where /dev/shm exists, else the "
            "temporary folder. The environment variable DS_ADABATCH_SNAPSHOT_DIR overrides it."
        ),
    )

    @property
    def agree_timeout(self) -> float:
        """``agree_timeout_s``, or its default from the collective timeout."""
        if self.agree_timeout_s is not None:
            return self.agree_timeout_s
        return 2 * self.collective_timeout_s + 5


def live_elastic_problems(live: LiveElasticConfig) -> list[ConfigProblem]:
    """Problems between the fields of ``live_elastic`` (paths relative to the ``adabatch`` section)."""
    problems: list[ConfigProblem] = []
    if live.dead_after_s < 3 * live.heartbeat_period_s:
        problems.append(
            ConfigProblem(
                "live_elastic.dead_after_s",
                f"must be at least 3 x heartbeat_period_s ({3 * live.heartbeat_period_s:g} s) so one late "
                "heartbeat does not declare a live process lost: raise dead_after_s or lower "
                "heartbeat_period_s",
                live.dead_after_s,
            )
        )
    if live.agree_timeout_s is not None and live.agree_timeout_s <= live.collective_timeout_s:
        problems.append(
            ConfigProblem(
                "live_elastic.agree_timeout_s",
                f"must exceed collective_timeout_s ({live.collective_timeout_s:g} s): a survivor blocked on "
                "another survivor learns of the loss only at its collective timeout",
                live.agree_timeout_s,
            )
        )
    return problems
