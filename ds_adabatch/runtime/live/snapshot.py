"""Host-memory snapshots of a live-elastic job: what each rank owns, a buddy's copy, re-partitioning.

What a rank owns (DeepSpeed 0.19.8):

- ZeRO 1 and 2 (``DeepSpeedZeroOptimizer``): its partition of the fp32 master weights,
  ``single_partition_of_fp32_groups[i]``, and that tensor's optimizer state (``exp_avg``,
  ``exp_avg_sq``, ...). Which slice of which model parameter each partition holds is in every
  parameter's fragment map (``utils/tensor_fragment.py``: ``lp_fragment_address`` in the flattened
  parameter, ``hp_fragment_address`` in the partition). One partition per data-parallel rank.
- ZeRO 0 (fp32): every parameter and its optimizer state, the same on every rank: one partition that
  every rank holds.
- ZeRO 3 (``DeepSpeedZeroOptimizer_Stage3``): its slice of every parameter in the flat fp32 sub-groups
  and their optimizer state (:mod:`.live_zero3`, which also returns a failed world's partitioned model
  to whole parameters before the rebuild). One partition per data-parallel rank.

A snapshot is one flat fp32 tensor per partition: for the master weights and then each optimizer-state
tensor, the owned pieces in a fixed order (the *layout*: parameter name, start, length). Each rank keeps
its own partition and, where a partition is not held everywhere, a copy of the partition of the rank
``LOCAL_WORLD_SIZE`` ahead (the same local rank on the next node, so a node's loss never takes both
copies); the copy travels by one ``isend``/``irecv`` pair that overlaps the next step and is waited on
at the next snapshot. Two snapshot slots alternate, so a failure while one is written leaves the other.

The tensors live in files in a node-local folder in host memory (``/dev/shm``), mapped with
``torch.from_file(shared=True)``: they survive this process, so workers that torchrun restarts (a node
joining) restore from them too. Each slot's metadata (step, layout, optimizer step, the adabatch state)
is written after its data, atomically, and removed before the slot is overwritten: a slot with metadata
is complete.

:func:`assemble` runs on the new world: every rank lists what it holds, they agree on the newest step of
which every partition of one world is held by someone, each partition is broadcast from one holder, and
every rank rebuilds each parameter's full fp32 weights and optimizer state — the per-parameter form of
DeepSpeed's universal checkpoint, without files. :func:`restore` loads that into a freshly built engine
of any data-parallel size, as DeepSpeed's universal-checkpoint loader does.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pickle
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import deepspeed_internals as internals
from ..distributed import comm
from .units import Assembled, Piece, Unit
from .zero3 import restore_zero3, zero3_problem, zero3_units

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.distributed import ProcessGroup

__all__ = [
    "Assembled",
    "NoCompleteSnapshot",
    "Snapshots",
    "assemble",
    "coverage_problem",
    "prune_families",
    "restore",
    "snapshot_root",
]

logger = logging.getLogger("ds_adabatch")

_WEIGHTS = "fp32"


class NoCompleteSnapshot(RuntimeError):
    """No step of which every partition is held by a survivor (a node and its buddy both lost)."""


def snapshot_root(configured: str | None) -> str:
    """The node-local snapshot folder: ``DS_ADABATCH_SNAPSHOT_DIR``, the config's, or a default."""
    env = os.environ.get("DS_ADABATCH_SNAPSHOT_DIR")
    if env:
        return env
    if configured:
        return configured
    if os.path.isdir("/dev/shm"):
        return "/dev/shm/ds_adabatch"
    return os.path.join(tempfile.gettempdir(), "ds_adabatch_snapshots")


def coverage_problem(ds_engine: DeepSpeedEngine) -> str | None:
    """Why snapshots cannot capture this engine's state (None: they can)."""
    stage = int(ds_engine.zero_optimization_stage())
    if ds_engine.fp16_enabled():
        return "fp16 (its loss scaler is not snapshotted; use bf16 or fp32)"
    if stage == 3:
        return zero3_problem(ds_engine)
    opt = ds_engine.optimizer
    if stage == 0 and not isinstance(opt, torch.optim.Optimizer):
        return f"ZeRO stage 0 with {type(opt).__name__} (bf16 at stage 0; use stage 1 or 2 with bf16)"
    if stage in (1, 2):
        if not hasattr(opt, "single_partition_of_fp32_groups"):
            return f"the optimizer wrapper {type(opt).__name__}"
        if getattr(opt, "cpu_offload", False):
            return "offload_optimizer (the partitions live in the offload engine)"
    return None


def _base_optimizer(ds_engine: DeepSpeedEngine) -> torch.optim.Optimizer:
    opt = ds_engine.optimizer
    return opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer


def _owned_units(ds_engine: DeepSpeedEngine, names: dict[torch.Tensor, str]) -> tuple[list[Unit], int, int]:
    """(units, partition id, partitions) of this rank for the engine's ZeRO stage."""
    stage = int(ds_engine.zero_optimization_stage())
    if stage == 0:
        base = _base_optimizer(ds_engine)
        units = [Unit(p, base, [Piece(names[p], 0, p.numel(), 0)]) for p in ds_engine.module.parameters()]
        return units, 0, 1
    if stage == 3:
        return zero3_units(ds_engine, names)
    opt = ds_engine.optimizer
    units = []
    for i in range(len(opt.optimizer.param_groups)):
        unit = Unit(opt.single_partition_of_fp32_groups[i], opt.optimizer)
        for lp in opt.bit16_groups[i]:
            m = internals.hp_mapping(lp)
            if m is not None:
                unit.pieces.append(
                    Piece(
                        names[lp],
                        m.lp_fragment_address.start,
                        m.lp_fragment_address.numel,
                        m.hp_fragment_address.start,
                    )
                )
        units.append(unit)
    return units, torch.distributed.get_rank(), torch.distributed.get_world_size()


def _state_keys(units: list[Unit]) -> list[str]:
    """The optimizer-state tensors shaped like the weights (moments), the same on every rank."""
    for unit in units:
        state = unit.optimizer.state.get(unit.hp, {})
        keys = sorted(
            k
            for k, v in state.items()
            if torch.is_tensor(v) and v.numel() == unit.hp.numel() and v.numel() > 1
        )
        if keys or state:
            return keys
    return []


def _optimizer_step(units: list[Unit]) -> tuple[int, bool]:
    """The optimizer's step count and whether it is stored as a tensor.

    DeepSpeed's FusedAdam counts steps only in the state of the *last* parameter of each group (it
    increments the loop variable's state after the loop): the largest count is the real one.
    """
    steps, as_tensor = [0], False
    for unit in units:
        value = unit.optimizer.state.get(unit.hp, {}).get("step")
        if value is not None:
            as_tensor = torch.is_tensor(value)
            steps.append(int(value.item() if as_tensor else value))
    return max(steps), as_tensor


@dataclass
class _Slot:
    data: torch.Tensor
    path: str

    @property
    def meta_path(self) -> str:
        return self.path[: -len(".bin")] + ".meta"


def _open_slot(path: str, numel: int) -> _Slot:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path):
        os.remove(path)  # a stale file of another size must not be mapped
    return _Slot(torch.from_file(path, shared=True, size=max(numel, 1), dtype=torch.float32), path)


def _meta_tmp(slot: _Slot) -> str:
    return f"{slot.meta_path}.{os.getpid()}.tmp"


def _write_meta(slot: _Slot, meta: dict[str, Any]) -> None:
    tmp = _meta_tmp(slot)
    with open(tmp, "wb") as f:
        pickle.dump(meta, f)
    os.replace(tmp, slot.meta_path)


def _drop_meta(slot: _Slot) -> None:
    if os.path.exists(slot.meta_path):
        os.remove(slot.meta_path)


class Snapshots:
    """This rank's snapshots of one world (generation); build a new one after every world change.

    Args:
        ds_engine: the DeepSpeed engine (ZeRO 0-3, see :func:`coverage_problem`).
        root: the node-local folder (:func:`snapshot_root`).
        job_id: the launch's id (``LiveWorld.job_id``); ``family``: this world's id within the job.
        group: a gloo group of this world for the buddy exchange (None: no exchange).
    """

    def __init__(
        self, ds_engine: DeepSpeedEngine, *, root: str, job_id: str, family: str, group: ProcessGroup
    ) -> None:
        dist = torch.distributed
        self.ds_engine = ds_engine
        self.names = {p: n for n, p in ds_engine.module.named_parameters()}
        self.units, self.partition, self.partitions = _owned_units(ds_engine, self.names)
        self.layout = [(pc.name, pc.lp_start, pc.numel) for u in self.units for pc in u.pieces]
        self.numel = sum(n for _, _, n in self.layout)
        self.folder = os.path.join(root, job_id)
        self.family = family
        self.job_id = job_id
        self.group = group
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        # The buddy is the same local rank on the next node; none where every rank holds everything
        # or the whole world is one node.
        self.exchange = group is not None and self.partitions > 1 and local < self.world
        self.to_rank = (self.rank - local) % self.world  # holds my copy
        self.from_rank = (self.rank + local) % self.world  # I hold its copy
        layouts = [None] * self.world
        if self.exchange:
            dist.all_gather_object(layouts, self.layout, group=group)
        self.buddy_layout = layouts[self.from_rank]
        self._own: dict[int, _Slot] = {}
        self._buddy: dict[int, _Slot] = {}
        self._keys: list[str] | None = None
        self._pending: tuple[list[Any], _Slot, dict[str, Any]] | None = None

    # ---------------------------------------------------------------------------------------------
    def _slot(self, table: dict[int, _Slot], index: int, partition: int, numel: int) -> _Slot:
        slot = table.get(index)
        if slot is None or slot.data.numel() != max(numel, 1):
            # A buddy copy is named after its holder too: where the "nodes" share one host's /dev/shm
            # (agents on one machine), the partition's owner writes a slot of the same partition.
            holder = f".c{self.rank}" if table is self._buddy else ""
            path = os.path.join(self.folder, f"{self.family}.p{partition}.s{index}{holder}.bin")
            slot = table[index] = _open_slot(path, numel)
        return slot

    def take(self, step: int, adabatch_state: dict[str, Any]) -> None:
        """Snapshot the state after optimizer step ``step`` (call on every rank, between steps)."""
        self.finish_exchange(wait=True)
        keys = _state_keys(self.units)
        width = 1 + len(keys)
        index = step % 2
        own = self._slot(self._own, index, self.partition, width * self.numel)
        _drop_meta(own)
        offset = 0
        for key in (_WEIGHTS, *keys):
            for unit in self.units:
                src = unit.hp if key == _WEIGHTS else unit.optimizer.state[unit.hp][key]
                src = src.detach().view(-1)
                for pc in unit.pieces:
                    # Straight into host memory (from a GPU: one device-to-host copy per piece, no
                    # staging buffer on the device).
                    own.data[offset : offset + pc.numel].copy_(src.narrow(0, pc.hp_start, pc.numel))
                    offset += pc.numel
        opt_step, step_is_tensor = _optimizer_step(self.units)
        common = {
            "job": self.job_id,
            "family": self.family,
            "partitions": self.partitions,
            "step": step,
            "keys": keys,
            "opt_step": opt_step,
            "step_is_tensor": step_is_tensor,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"}
                for g in _base_optimizer(self.ds_engine).param_groups
            ],
            "adabatch": adabatch_state,
        }
        _write_meta(own, {**common, "partition": self.partition, "layout": self.layout})
        if not self.exchange:
            return
        dist = torch.distributed
        buddy_numel = width * sum(n for _, _, n in self.buddy_layout)
        buddy = self._slot(self._buddy, index, self.from_rank, buddy_numel)
        _drop_meta(buddy)
        works = [
            dist.isend(own.data[: width * self.numel], self.to_rank, group=self.group),
            dist.irecv(buddy.data[:buddy_numel], self.from_rank, group=self.group),
        ]
        buddy_meta = {**common, "partition": self.from_rank, "layout": self.buddy_layout}
        self._pending = (works, buddy, buddy_meta)

    def finish_exchange(self, *, wait: bool) -> None:
        """Complete the last buddy exchange: wait for it, or (after a failure) keep it only if done."""
        if self._pending is None:
            return
        works, buddy, meta = self._pending
        self._pending = None
        if wait:
            for w in works:
                comm.wait_for(w, "the snapshot's buddy copy")
        else:
            # After a failure: the copy counts only if it arrived whole. A dead sender's socket is
            # closed, so this returns (or raises) at once; a live one's completes.
            try:
                works[1].wait()
            except Exception:  # noqa: BLE001 - the copy never arrived whole: the slot stays without metadata
                return
        _write_meta(buddy, meta)

    def release(self) -> None:
        """Drop references to the engine and the group (their world failed); the files stay."""
        self.finish_exchange(wait=False)
        self.ds_engine = None
        self.units = []
        self.group = None

    def remove_files(self) -> None:
        """Delete this rank's snapshot files (its own slots and its buddy copies), and the job's folder
        once the node's last rank has done so. Only its own: the node's other ranks may still be
        writing theirs (a rank that ends first must not delete a slower one's last snapshot)."""
        for slot in (*self._own.values(), *self._buddy.values()):
            for path in (slot.path, slot.meta_path, _meta_tmp(slot)):
                with contextlib.suppress(OSError):
                    os.remove(path)
        self._own, self._buddy = {}, {}
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)


def prune_families(root: str, job_id: str, keep: str) -> None:
    """Delete this node's snapshot files of the job's other worlds (after a restore from ``keep``'s
    successor, they are superseded)."""
    for path in glob.glob(os.path.join(root, job_id, "*")):
        if not os.path.basename(path).startswith(keep + "."):
            with contextlib.suppress(OSError):
                os.remove(path)


def _inventory(root: str, job_id: str) -> list[tuple[str, int, int, int, str]]:
    """(family, partition, step, partitions, path) of every complete slot of this job on this node."""
    held = []
    for meta_path in glob.glob(os.path.join(root, job_id, "*.meta")):
        try:
            with open(meta_path, "rb") as f:
                meta = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
        if meta.get("job") != job_id:
            continue
        held.append((meta["family"], meta["partition"], meta["step"], meta["partitions"], meta_path))
    return held


def assemble(root: str, job_id: str, shapes: dict[str, torch.Size], group: ProcessGroup) -> Assembled:
    """On the new world (call on every rank): agree on the newest complete snapshot and rebuild it, in
    host memory, over ``group`` (a gloo group of the whole world: NCCL moves no host tensors).

    Raises :class:`NoCompleteSnapshot` when no step of one world has every partition held by a rank.
    """
    dist = torch.distributed
    mine = _inventory(root, job_id)
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, [(f, p, s, n) for f, p, s, n, _ in mine], group=group)
    holders: dict[tuple[str, int, int], int] = {}
    totals: dict[tuple[str, int], int] = {}
    for rank, view in enumerate(views):
        for family, partition, step, partitions in view:
            holders.setdefault((family, step, partition), rank)
            totals[(family, step)] = partitions
    complete = [
        (step, family)
        for (family, step), n in totals.items()
        if all((family, step, p) in holders for p in range(n))
    ]
    if not complete:
        raise NoCompleteSnapshot(
            "no snapshot step whose every partition a survivor holds (a node and the node holding its "
            "copy were both lost, or no snapshot was taken yet)"
        )
    step, family = max(complete)
    partitions = totals[(family, step)]
    paths = {(f, p, s): path for f, p, s, _, path in mine}
    full: dict[str, dict[str, torch.Tensor]] = {}
    meta: dict[str, Any] | None = None
    for p in range(partitions):
        src = holders[(family, step, p)]
        box: list[Any] = [None]
        local = None
        if dist.get_rank() == src:
            meta_path = paths[(family, p, step)]
            with open(meta_path, "rb") as f:
                box[0] = pickle.load(f)
            numel = (1 + len(box[0]["keys"])) * sum(n for _, _, n in box[0]["layout"])
            local = torch.from_file(
                meta_path[: -len(".meta")] + ".bin", shared=False, size=max(numel, 1), dtype=torch.float32
            )
        dist.broadcast_object_list(box, src=src, group=group)
        pmeta = box[0]
        width = 1 + len(pmeta["keys"])
        n = sum(k for _, _, k in pmeta["layout"])
        buf = local[: width * n].clone() if local is not None else torch.empty(width * n)
        dist.broadcast(buf, src=src, group=group)
        if meta is None:
            meta = pmeta
        for ki, key in enumerate((_WEIGHTS, *pmeta["keys"])):
            off = ki * n
            for name, start, k in pmeta["layout"]:
                entry = full.setdefault(name, {})
                if key not in entry:
                    entry[key] = torch.zeros(shapes[name], dtype=torch.float32)
                entry[key].view(-1)[start : start + k] = buf[off : off + k]
                off += k
    assert meta is not None
    return Assembled(step, family, full, meta)


def restore(ds_engine: DeepSpeedEngine, state: Assembled) -> None:
    """Load an assembled snapshot into a freshly built engine (ZeRO 0-3, any data-parallel size)."""
    meta = state.meta
    keys = meta["keys"]
    names = {p: n for n, p in ds_engine.module.named_parameters()}
    step_value = torch.tensor(float(meta["opt_step"])) if meta["step_is_tensor"] else meta["opt_step"]
    stage = int(ds_engine.zero_optimization_stage())
    if stage == 3:
        restore_zero3(ds_engine, state, keys, step_value)
        _restore_hyperparameters(_base_optimizer(ds_engine), meta)
        return
    with torch.no_grad():
        for p, name in names.items():
            p.data.copy_(state.full[name][_WEIGHTS])  # ZeRO 0-2: the model's weights are whole everywhere
    base = _base_optimizer(ds_engine)
    if stage == 0:
        if keys:
            for p, name in names.items():
                entry = {k: state.full[name][k].to(p.device, copy=True) for k in keys}
                # Every parameter gets the real count (FusedAdam reads the last one's).
                entry["step"] = step_value.clone() if torch.is_tensor(step_value) else step_value
                base.state[p] = entry
    else:
        from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

        opt = ds_engine.optimizer
        for i in range(len(base.param_groups)):
            hp = opt.single_partition_of_fp32_groups[i]
            for lp in opt.bit16_groups[i]:
                m = internals.hp_mapping(lp)
                if m is None:
                    continue
                a = m.lp_fragment_address
                entry = state.full[names[lp]]
                m.hp_fragment.data.copy_(entry[_WEIGHTS].view(-1).narrow(0, a.start, a.numel))
                device = m.hp_fragment.device
                m.optim_fragment = {
                    k: entry[k].view(-1).narrow(0, a.start, a.numel).to(device, copy=True) for k in keys
                }
            if keys:
                base.state[hp]["step"] = step_value
                # As DeepSpeed's universal-checkpoint loader does (base_optimizer.py,
                # load_hp_checkpoint_state_from_checkpoint_dir): the fragments become the flat state.
                map_to_flat_opt_states(hp, opt.bit16_groups[i], base.state, keys)
        # The fragments are linked to the state already; a lazy link at the first step would redo it.
        internals.mark_hp_states_linked(opt)
    _restore_hyperparameters(base, meta)


def _restore_hyperparameters(base: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    for group, saved in zip(base.param_groups, meta["param_groups"]):
        for k, v in saved.items():
            if not isinstance(v, torch.Tensor):
                group[k] = v
