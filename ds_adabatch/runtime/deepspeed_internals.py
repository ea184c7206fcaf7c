"""The door to DeepSpeed's internals: every name DeepSpeed does not document that ds_adabatch reads or
writes, written against DeepSpeed 0.19.8.

Each access is a function here with a comment naming the DeepSpeed function it mirrors, and every name
is listed in :data:`PRIVATE_NAMES` with the object that holds it. ``tests/test_deepspeed_internals.py``
checks each one on real engines of every ZeRO stage (so a DeepSpeed release that renames one fails
there, by name, instead of turning a reset into a silent no-op) and checks that no module outside this
one mentions a listed name.

What the runtime needs from DeepSpeed's inside, by job:

- **discarding a step** (out-of-memory recovery re-runs a step's samples): the ZeRO 1/2 and ZeRO 3
  accumulation state a partial step left (buckets, reduced flags, partition gradients, offload ids,
  ``micro_step_id``, the backward depth), reset as the start of a step finds it;
- **the agreement's gates**: the methods through which every gradient collective of a pass goes
  (name-mangled under ZeRO 3), wrapped per engine;
- **process groups**: DeepSpeed's data-parallel world group, seeded with our timeout; the per-parameter
  group and fragment map a failed world leaves behind;
- **ZeRO 1/2 partitions**: each parameter's fragment map (``_hp_mapping``) and the optimizer's flag that
  the fragments are linked to the flat state (snapshots and their restore);
- **ZeRO 3 partitions**: where each parameter's partition sits in the optimizer's flat fp32 groups
  (snapshots and their restore), and the model returned to plain full tensors after a lost peer (what
  ZeRO 3 hung on the modules and parameters removed, without a collective, before the engine is rebuilt);
- **the config**: the raw dict an engine was built with, and the universal-checkpoint switch.

Not yet behind this door (read through attributes DeepSpeed keeps without a leading underscore, each
commented where it is read): the flat-buffer layouts of the ZeRO optimizers that
``runtime/noise/adam_geometry.py`` and ``runtime/live/snapshot.py`` walk, DeepSpeed's ``/dev/shm`` buffer name
(``runtime/distributed/process_group.py``) and the JIT build lock (``runtime/distributed/op_builds.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.distributed import ProcessGroup

__all__ = [
    "PRIVATE_NAMES",
    "ContractError",
    "contract_problems",
    "discard_zero12_accumulation",
    "discard_zero3_accumulation",
    "drop_failed_world_refs",
    "gradient_collective_gates",
    "hp_mapping",
    "loading_universal_checkpoint",
    "mark_hp_states_linked",
    "param_partition_group",
    "raw_config",
    "reset_backward_depth",
    "seed_world_group",
    "unpartition_zero3_model",
    "zero3_partitions",
]

PRIVATE_NAMES: dict[str, str] = {
    # name: what holds it (DeepSpeed 0.19.8)
    "_config": "DeepSpeedEngine (its DeepSpeedConfig)",
    "_param_dict": "DeepSpeedConfig (the dict the engine was built with)",
    "_backward_active_depth": "ZeRO optimizers (base_optimizer.py ZeROOptimizer)",
    "_epilogue_ran_this_backward": "ZeRO optimizers (base_optimizer.py ZeROOptimizer)",
    "_release_ipg_buffers": "DeepSpeedZeroOptimizer (stage_1_and_2.py)",
    "_wait_for_offload_copies": "DeepSpeedZeroOptimizer (stage_1_and_2.py)",
    "_offload_accumulated_param_ids": "DeepSpeedZeroOptimizer with offload_optimizer",
    "_offload_boundary_param_ids": "DeepSpeedZeroOptimizer_Stage3 (stage3.py)",
    "_invalidate_trace": "PartitionedParameterCoordinator (partitioned_param_coordinator.py)",
    "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads": "DeepSpeedZeroOptimizer_Stage3",
    "_PartitionedParameterCoordinator__all_gather_params": "PartitionedParameterCoordinator",
    "_get_param_partition_group": "DeepSpeedZeroOptimizer_Stage3",
    "_hp_mapping": "parameters under ZeRO 1/2 (utils/tensor_fragment.py link_hp_params)",
    "_hp_optimizer_states_linked": "DeepSpeedZeroOptimizer (stage_1_and_2.py)",
    "_dp_group": "parameters under ZeRO 1/2 (link_hp_params)",
    "_WORLD_GROUP": "deepspeed.utils.groups (module global)",
    "_z3_optimizer": "parameters under ZeRO 3 (stage3.py DeepSpeedZeroOptimizer_Stage3.__init__)",
    "_original_parameters": "modules under ZeRO 3 (parameter_offload.py _inject_parameters)",
    "_external_params": "modules under ZeRO 3 (partition_parameters.py _init_external_params)",
}
"""Every private DeepSpeed name ds_adabatch touches, with what holds it."""

_ZERO3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
_ZERO3_GATHER = "_PartitionedParameterCoordinator__all_gather_params"


class ContractError(RuntimeError):
    """DeepSpeed no longer has a name this runtime relies on (a release renamed or removed it)."""


def _require(owner: Any, name: str) -> Any:
    """``getattr(owner, name)``, or :class:`ContractError` naming the attribute and the owner's type."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise ContractError(
            f"DeepSpeed's {type(owner).__name__} has no attribute {name!r} (written against DeepSpeed "
            "0.19.8): this DeepSpeed release is not supported by this ds_adabatch"
        ) from None


# -- the config ---------------------------------------------------------------------------------------
def raw_config(ds_engine: DeepSpeedEngine) -> dict[str, Any] | None:
    """The config dict the engine was built with, unknown sections (``"adabatch"``) included.

    DeepSpeed 0.19.8 keeps it in ``engine._config._param_dict``; None where it is not a dict."""
    raw = getattr(getattr(ds_engine, "_config", None), "_param_dict", None)
    return raw if isinstance(raw, dict) else None


@contextlib.contextmanager
def loading_universal_checkpoint(ds_engine: DeepSpeedEngine) -> Iterator[None]:
    """Make ``load_checkpoint`` read a universal checkpoint inside the block.

    DeepSpeed 0.19.8 reads ``_config.load_universal_checkpoint`` inside ``load_checkpoint`` (and the ZeRO
    optimizer's loader); a converted checkpoint is loaded with it switched on, then off again."""
    config = _require(ds_engine, "_config")
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = False


# -- discarding a step's partial accumulation ----------------------------------------------------------
def reset_backward_depth(opt: DeepSpeedOptimizer | torch.optim.Optimizer) -> None:
    """An interrupted ``engine.backward`` leaves ZeRO's backward depth raised (0.19.8 base_optimizer.py
    ``ZeROOptimizer``: ``_backward_active_depth``, ``_epilogue_ran_this_backward``); the next backward
    would take itself for a nested one. Optimizers without it (no ZeRO) are left alone."""
    if not hasattr(opt, "clear_backward_seen_flag"):
        return
    opt._backward_active_depth = 0
    opt._epilogue_ran_this_backward = False
    opt.clear_backward_seen_flag()


def discard_zero12_accumulation(opt: ZeROOptimizer) -> None:
    """What ``DeepSpeedZeroOptimizer`` (stage_1_and_2.py, 0.19.8) accumulated in an unfinished step, gone.

    It accumulates into its partition buffers with "copy" semantics when ``micro_step_id`` is 0 and "add"
    after; ``step()`` resets it to -1 and ``setup_buckets()`` increments it when the next backward
    starts. Resetting it, clearing the buckets and the per-parameter flags makes the next pass overwrite
    whatever was accumulated.
    """
    offload = bool(getattr(opt, "cpu_offload", False))
    _require(opt, "_wait_for_offload_copies")()  # returns at once without offload copies in flight
    for bucket in opt.ipg_buckets.values():
        bucket.clear()
    opt.extra_large_param_to_reduce.clear()
    for i in range(len(opt.params_already_reduced)):
        opt.params_already_reduced[i] = False
    for reduced in opt.previous_reduced_grads.values():
        reduced.clear()
    _require(opt, "_release_ipg_buffers")()
    for key in list(opt.averaged_gradients):
        opt.averaged_gradients[key] = None
    for key in list(opt.all_grad_tensors):
        opt.all_grad_tensors[key] = None
    opt.reset_partition_gradient_structures()
    opt.zero_grad(set_to_none=True)
    if offload:
        _require(opt, "_offload_accumulated_param_ids")
        opt._offload_accumulated_param_ids = set()
        opt.reset_cpu_buffers()
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    opt.micro_step_id = INITIAL_MICRO_STEP_ID


def discard_zero3_accumulation(ds_engine: DeepSpeedEngine, opt: ZeROOptimizer) -> None:
    """What ``DeepSpeedZeroOptimizer_Stage3`` (stage3.py, 0.19.8) accumulated in an unfinished step, gone.

    ``zero_grad`` resets ``micro_step_id`` to 0 (copy semantics on the next reduce) and drops
    ``param.grad``; the buckets and reduced flags are cleared here, and parameters an interrupted
    forward left gathered are released.
    """
    for bucket in opt.ipg_buckets.values():
        # clear_params, not clear(): clear() also drops the flat buffer allocated at construction.
        bucket.clear_params()
    for param_id in opt.params_already_reduced:
        opt.params_already_reduced[param_id] = False
    # The interrupted pass left full-size param.grad tensors; zero_grad would record_stream them
    # (which a CPU tensor refuses), so they are dropped first.
    for group in opt.fp16_groups:
        for p in group:
            p.grad = None
    opt.zero_grad(set_to_none=True)
    _require(opt, "_offload_boundary_param_ids")
    opt._offload_boundary_param_ids = set()
    opt.reset_cpu_buffers()
    coordinator = opt.parameter_offload.get_param_coordinator()
    if coordinator.is_record_trace():
        # The first steps record the module order (checked across ranks at the next forward): an
        # interrupted pass recorded part of it on this rank only, so every rank records afresh.
        _require(coordinator, "_invalidate_trace")()
    if any(not getattr(p, "ds_persist", False) for p in ds_engine.module.parameters()):
        # Partitioned parameters an interrupted pass left gathered are released. When every parameter
        # is persistent (below stage3_param_persistence_threshold) nothing is released: releasing them
        # would make the retry's forward gather again, and an OOM after that gather is unrecoverable.
        coordinator.release_and_reset_all(ds_engine.module)


# -- the out-of-memory agreement's gates ---------------------------------------------------------------
def gradient_collective_gates(
    ds_engine: DeepSpeedEngine, *, plain_data_parallel: bool
) -> list[tuple[Any, str, Any]]:
    """``(owner, method name, when)`` of the methods through which every gradient collective of a pass
    goes, for the out-of-memory agreement to wrap (``when``: a callable that says whether a call
    communicates, or None: always).

    DeepSpeed 0.19.8: plain data parallelism (``plain_data_parallel``: ZeRO 0, and bf16 ZeRO 1 on the
    BF16_Optimizer) reduces in ``DeepSpeedEngine.allreduce_gradients`` at the accumulation boundary;
    ZeRO 1/2 in ``DeepSpeedZeroOptimizer.reduce_ipg_grads`` (bucket full, end-of-backward epilogue);
    ZeRO 3 in the name-mangled ``DeepSpeedZeroOptimizer_Stage3.__reduce_and_partition_ipg_grads`` and
    every parameter gather in ``PartitionedParameterCoordinator.__all_gather_params``.
    """
    stage = int(ds_engine.zero_optimization_stage())
    opt = ds_engine.optimizer
    if stage == 0 or plain_data_parallel:
        return [(ds_engine, "allreduce_gradients", ds_engine.is_gradient_accumulation_boundary)]
    if stage in (1, 2):
        _require(opt, "reduce_ipg_grads")
        return [(opt, "reduce_ipg_grads", None)]
    if stage == 3:
        coordinator = opt.parameter_offload.get_param_coordinator()
        _require(opt, _ZERO3_REDUCE)
        _require(coordinator, _ZERO3_GATHER)
        return [(opt, _ZERO3_REDUCE, None), (coordinator, _ZERO3_GATHER, None)]
    raise ValueError(f"unsupported ZeRO stage {stage}")  # pragma: no cover - DeepSpeed has no other


# -- process groups -------------------------------------------------------------------------------------
def seed_world_group(group: ProcessGroup) -> None:
    """Put ``group`` where DeepSpeed looks for its data-parallel world group.

    DeepSpeed 0.19.8 ``utils/groups.py``: ``_clone_world_group`` returns ``_WORLD_GROUP`` when it is set,
    and otherwise makes one with torch's default timeout (30 minutes on gloo)."""
    from deepspeed.utils import groups

    _require(groups, "_WORLD_GROUP")
    groups._WORLD_GROUP = group


def drop_failed_world_refs(param: torch.nn.Parameter) -> None:
    """Remove what a failed world left on a parameter: its data-parallel group and fragment map
    (``_dp_group``, ``_hp_mapping``, set by 0.19.8 ``tensor_fragment.link_hp_params``)."""
    for attr in ("_dp_group", "_hp_mapping"):
        if hasattr(param, attr):
            delattr(param, attr)


def param_partition_group(opt: ZeROOptimizer, param: torch.nn.Parameter) -> ProcessGroup:
    """The process group a ZeRO 3 parameter is partitioned over (0.19.8 stage3.py
    ``DeepSpeedZeroOptimizer_Stage3._get_param_partition_group``)."""
    return _require(opt, "_get_param_partition_group")(param)


# -- ZeRO 1/2 partitions -------------------------------------------------------------------------------
def hp_mapping(param: torch.nn.Parameter) -> Any:
    """The fragment map of a ZeRO 1/2 parameter: which slice of it this rank's fp32 partition holds
    (0.19.8 ``utils/tensor_fragment.py``: ``lp_fragment_address``, ``hp_fragment_address``,
    ``hp_fragment``, ``optim_fragment``); None where this rank holds none of it."""
    return getattr(param, "_hp_mapping", None)


def mark_hp_states_linked(opt: ZeROOptimizer) -> None:
    """Tell ``DeepSpeedZeroOptimizer`` that its fragments are linked to the flat optimizer state already
    (0.19.8 stage_1_and_2.py links them lazily at the first step otherwise, undoing a restore)."""
    _require(opt, "_hp_optimizer_states_linked")
    opt._hp_optimizer_states_linked = True


# -- ZeRO 3 partitions ----------------------------------------------------------------------------------
Zero3Group = tuple[torch.Tensor, list[tuple[torch.nn.Parameter, int, int]]]
"""A flat fp32 sub-group of this rank and, per parameter in it, (parameter, offset, partition size)."""

# What ZeRO 3 sets on a parameter besides the ``ds_*`` attributes (0.19.8: partition_parameters.py
# ``Init._convert_to_deepspeed_param`` binds the methods, stage3.py ``__init__`` sets ``_z3_optimizer``,
# ``group_id`` and ``use_muon``).
_ZERO3_PARAM_NAMES = (
    "all_gather",
    "all_gather_coalesced",
    "partition",
    "partition_gradients",
    "reduce_gradients_at_owner",
    "partition_numel",
    "padding_size",
    "aligned_size",
    "convert_to_zero_parameters",
    "item",
    "is_external_param",
    "nvme_swapper",
    "group_id",
    "use_muon",
    "_z3_optimizer",
)
# ... and on a module besides ``ds_*`` (0.19.8 parameter_offload.py ``_inject_parameters`` and the
# backward hooks of ``_register_hooks_recursively``; partition_parameters.py ``_init_external_params``).
_ZERO3_MODULE_NAMES = (
    "_original_parameters",
    "_external_params",
    "all_parameters",
    "pre_bwd_fn",
    "post_bwd_fn",
    "applied_pre_backward_ref_cnt",
)


def zero3_partitions(opt: ZeROOptimizer) -> list[Zero3Group]:
    """Where this rank's partition of each parameter sits in ``DeepSpeedZeroOptimizer_Stage3``'s flat fp32
    sub-groups (0.19.8 stage3.py, as ``_get_fp32_opt_state_partition`` reads it): sub-group ``i`` is
    ``fp32_partitioned_groups_flat[i]``, its parameters ``fp16_groups[i]``, and ``grad_position[id]``
    is ``[i, offset, partition size]`` (padding included). The optimizer state is keyed by the flat
    tensor; each parameter's low-precision partition is its ``ds_tensor``."""
    groups: list[Zero3Group] = []
    for i, params in enumerate(_require(opt, "fp16_groups")):
        flat = _require(opt, "fp32_partitioned_groups_flat")[i]
        placed = []
        for p in params:
            group, offset, numel = _require(opt, "grad_position")[opt.get_param_id(p)]
            if int(group) != i:
                raise ContractError(f"ZeRO 3 parameter {p.ds_id} placed in sub-group {group}, listed in {i}")
            placed.append((p, int(offset), int(numel)))
        groups.append((flat, placed))
    return groups


def unpartition_zero3_model(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Return a model that a ZeRO 3 engine partitioned to plain, whole parameters, without a collective.

    After a lost peer the failed engine's ``destroy()`` has removed its hooks, but every parameter is
    still a ZeRO 3 parameter of the failed world (an empty ``data``, its partition in ``ds_tensor``,
    methods bound to the failed group) and every module's ``_parameters`` a ``ZeROOrderedDict`` that
    all-gathers on access. A new engine would take those parameters for converted already (0.19.8
    parameter_offload.py ``_convert_to_zero_parameters`` skips any with a ``ds_id``). So: ``full`` (per
    parameter name, the whole fp32 value) becomes each parameter's data in its own dtype, the
    parameters keep their identity (an optimizer's param groups, ties), and whatever ZeRO 3 set on
    them and on the modules is removed.
    """
    done: set[int] = set()
    for prefix, module in model.named_modules():
        # dict.items, not the ZeROOrderedDict's: its __getitem__ gathers a partitioned parameter.
        params = list(dict.items(module._parameters))
        for key, p in params:
            if p is None or id(p) in done:
                continue
            done.add(id(p))
            name = f"{prefix}.{key}" if prefix else key
            p.data = full[name].to(device=p.device, dtype=p.dtype).clone()
            p.grad = None
            for attr in list(vars(p)):
                if attr.startswith("ds_") or attr in _ZERO3_PARAM_NAMES:
                    delattr(p, attr)
        module._parameters = dict(params)
        for attr in list(vars(module)):
            if attr.startswith("ds_") or attr in _ZERO3_MODULE_NAMES:
                delattr(module, attr)


# -- the contract ----------------------------------------------------------------------------------------
def contract_problems(ds_engine: DeepSpeedEngine) -> list[str]:
    """The names this engine's stage needs that it lacks (an empty list: the contract holds).

    Run by the tests on a real engine of each ZeRO stage; a DeepSpeed upgrade that breaks one fails there
    with the name."""
    stage = int(ds_engine.zero_optimization_stage())
    opt = ds_engine.optimizer
    needed: list[tuple[Any, str]] = [(ds_engine, "_config"), (ds_engine._config, "_param_dict")]
    from deepspeed.utils import groups

    needed.append((groups, "_WORLD_GROUP"))
    if stage in (1, 2) and hasattr(opt, "reduce_ipg_grads"):
        needed += [
            (opt, name)
            for name in (
                "_backward_active_depth",
                "_epilogue_ran_this_backward",
                "_release_ipg_buffers",
                "_wait_for_offload_copies",
                "_hp_optimizer_states_linked",
                "ipg_buckets",
                "extra_large_param_to_reduce",
                "params_already_reduced",
                "previous_reduced_grads",
                "averaged_gradients",
                "all_grad_tensors",
                "micro_step_id",
            )
        ]
        params = [p for group in opt.bit16_groups for p in group]
        needed += [(p, "_hp_mapping") for p in params[:1]] + [(p, "_dp_group") for p in params[:1]]
    if stage == 3:
        coordinator = opt.parameter_offload.get_param_coordinator()
        needed += [(opt, name) for name in (_ZERO3_REDUCE, "_get_param_partition_group")]
        needed += [
            (opt, "_offload_boundary_param_ids"),
            (opt, "ipg_buckets"),
            (opt, "params_already_reduced"),
        ]
        needed += [(coordinator, _ZERO3_GATHER), (coordinator, "_invalidate_trace")]
        needed += [
            (opt, name)
            for name in ("fp16_groups", "fp32_partitioned_groups_flat", "grad_position", "get_param_id")
        ]
        params = [p for group in opt.fp16_groups for p in group]
        needed += [(p, name) for p in params[:1] for name in ("_z3_optimizer", "ds_tensor", "ds_shape")]
        needed += [(ds_engine.module, "_original_parameters"), (ds_engine.module, "_external_params")]
    return [f"{type(owner).__name__}.{name}" for owner, name in needed if not hasattr(owner, name)]


def wrap_method(owner: Any, name: str, gate: Callable[[], None], when: Any = None) -> None:
    """Route ``owner.name`` through ``gate`` first (when ``when()`` says the call communicates).

    An instance attribute shadows the bound method, so DeepSpeed's own ``self.<name>(...)`` calls
    (name-mangled private ones included) go through the gate."""
    original = getattr(owner, name)

    def gated(*args: Any, **kwargs: Any) -> Any:
        if when is None or when():
            gate()
        return original(*args, **kwargs)

    setattr(owner, name, gated)
