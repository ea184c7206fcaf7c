"""What a failed step's error says about the world: a collective's failure (a peer lost, hung, cut off by
the watchdog, or a transient network fault) that live recovery handles, or the user's own error, raised
to them untouched. Told by what failed, never by the words of the message."""

from __future__ import annotations

import linecache
import re
from types import TracebackType

import torch

from ..distributed.comm import CollectiveError

__all__ = ["LiveRecoveryFailed", "is_peer_failure"]

# Where a frame of a failed step's traceback says that a collective raised (DeepSpeed 0.19.8, torch 2.11+):
# torch.distributed's functions, DeepSpeed's communication layer over them, and ZeRO-3's all-gather
# handles, which DeepSpeed waits on in its own ``wait`` methods, or directly as ``handle.wait()`` on the
# work torch.distributed returned (partition_parameters.py ``_allgather_params_coalesced``, a persistent
# parameter's gather after the step).
_COLLECTIVE_MODULES = ("torch.distributed", "deepspeed.comm")
_DEEPSPEED_HANDLE_MODULES = ("deepspeed.runtime.zero",)
_WAIT_ON_A_HANDLE = re.compile(r"^\s*[A-Za-z_][A-Za-z_0-9]*\.wait\(\)\s*(#.*)?$")


def _raised_in_a_collective(err: BaseException) -> bool:
    tb = err.__traceback__
    innermost = None
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_COLLECTIVE_MODULES):
            return True
        if module.startswith(_DEEPSPEED_HANDLE_MODULES) and frame.f_code.co_name == "wait":
            return True
        innermost = tb
        tb = tb.tb_next
    return innermost is not None and _waits_on_a_handle(innermost)


def _waits_on_a_handle(tb: TracebackType) -> bool:
    """Whether the innermost frame, in DeepSpeed's ZeRO code, raised from the statement ``x.wait()``: the
    wait on a collective's work object, a C++ call with no Python frame of its own (the statement that
    failed, read from DeepSpeed's source, not the error's words)."""
    frame = tb.tb_frame
    if not frame.f_globals.get("__name__", "").startswith(_DEEPSPEED_HANDLE_MODULES):
        return False
    line = linecache.getline(frame.f_code.co_filename, tb.tb_lineno)
    return bool(_WAIT_ON_A_HANDLE.match(line))


class LiveRecoveryFailed(RuntimeError):
    """A lost peer could not be recovered from in memory: exit (``exit_code``) and let torchrun restart
    the workers, which resume from the last complete checkpoint (the message says why)."""

    exit_code: int = 1


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective's failure (a peer lost, hung, or cut off by the watchdog), told by
    what failed, never by the words of the message.

    A collective failed when the error is torch's distributed error type (``DistError``: NCCL, the
    store, the network), ds_adabatch's own :class:`~ds_adabatch.runtime.distributed.comm.CollectiveError` (a wait
    on an operation it issued), or a ``RuntimeError`` raised inside ``torch.distributed`` or DeepSpeed's
    communication layer (gloo raises plain ``RuntimeError``), or by a ``handle.wait()`` on a collective's
    work in DeepSpeed's ZeRO code. An out-of-memory error is never one. Anything else — a user's ``loss_fn``, the
    dataset, a shape error — is the user's own error and is raised to them untouched. Whether the peer
    is gone or every process is still alive is decided afterwards by the survivors' agreement.
    """
    if isinstance(err, (LiveRecoveryFailed, torch.OutOfMemoryError)) or not isinstance(err, RuntimeError):
        return False
    dist_error = getattr(torch.distributed, "DistError", None)
    if isinstance(err, CollectiveError) or (dist_error is not None and isinstance(err, dist_error)):
        return True
    return _raised_in_a_collective(err)
