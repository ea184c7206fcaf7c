"""DeepSpeed's just-in-time op builds, made safe against a process killed while it held the build lock.

Why (torch 2.11 to 2.13, DeepSpeed 0.19.8). DeepSpeed compiles its C++ ops on first use with
``torch.utils.cpp_extension.load`` (the CPU accelerator's shared-memory collectives when the process group
forms, FusedAdam or CPUAdam when the optimizer is built). Every load, even of an op compiled long ago,
creates ``<build directory>/lock`` while it checks or builds the op, and every other process that wants
the op waits, without a time limit, until that file is gone. A process killed inside that window (the
launcher's SIGTERM when another rank failed, an elastic restart, a node lost, a job's time limit) leaves
the file behind, and every later start of any job of that user waits forever inside
``deepspeed.init_distributed()`` or ``deepspeed.initialize()``, printing nothing.

The guard installed here (:func:`guard_jit_builds`, called by :func:`ds_adabatch.init_distributed`,
:func:`ds_adabatch.initialize` and the Trainer integration) runs each JIT load under an ``fcntl`` lock
on ``<build directory>.ds_adabatch.lock``, which the kernel releases when its holder dies, so the
processes of this machine that go through it load one at a time. Inside it a leftover torch ``lock`` is
either a dead process's or a build outside the guard; it is removed, with a warning naming it, once no
build tool (ninja, a compiler, a linker) runs in the build directory and the file is older than
:data:`STALE_AFTER_S` seconds; a build outside the guard that is still running is waited for.

From torch 2.14 on, torch holds that ``lock`` with an OS advisory lock that dies with its holder, and the
file stays after every load (:mod:`ds_adabatch.runtime.distributed.torch_compat`): there the guard is not installed,
so a file another process holds is never removed.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

__all__ = [
    "STALE_AFTER_S",
    "build_directory",
    "clear_stale_build_lock",
    "cuda_arch_list_problems",
    "guard_jit_builds",
]

logger = logging.getLogger("ds_adabatch")

STALE_AFTER_S = 10.0
"""A build lock this old, with no process working in its directory, was left by a dead process (torch
holds it without a build process only to compare versions and write the ninja file: well under a second)."""

_GUARDED = "_ds_adabatch_guarded"


def build_directory(name: str) -> str:
    """Where torch builds the extension ``name`` (``TORCH_EXTENSIONS_DIR`` or torch's default root)."""
    from torch.utils import cpp_extension

    return cpp_extension._get_build_directory(name, False)


_BUILD_TOOLS = frozenset(
    {"ninja", "cc", "c++", "gcc", "g++", "cc1", "cc1plus", "collect2", "ld", "as", "clang", "clang++"}
    | {"nvcc", "cicc", "ptxas", "fatbinary", "nvlink", "hipcc", "icx", "icpx"}
)


def _build_runs_in(directory: str) -> bool:
    """Whether a build tool (ninja, a compiler, a linker) of this machine runs in ``directory``: torch
    starts ninja there, and ninja the compiler. Processes whose directory cannot be read are not seen."""
    target = os.path.realpath(directory)
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            if os.readlink(f"/proc/{pid}/cwd") != target:
                continue
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm in _BUILD_TOOLS or comm.rsplit("-", 1)[-1] in _BUILD_TOOLS:
            return True
    return False


def clear_stale_build_lock(
    directory: str, *, stale_after_s: float = STALE_AFTER_S, poll_s: float = 0.5
) -> bool:
    """Wait until ``directory``'s torch build lock is gone, removing it if it was left by a dead process
    (see the module's docstring). Call it holding the guard's lock. Returns whether one was removed."""
    lock = os.path.join(directory, "lock")
    while True:
        try:
            age = time.time() - os.stat(lock).st_mtime
        except FileNotFoundError:
            return False
        if age >= stale_after_s and not _build_runs_in(directory):
            try:
                os.remove(lock)
            except FileNotFoundError:
                return False
            logger.warning(
                "[ds_adabatch] removed %s, a build lock %.0f s old that no running build holds (a process "
                "killed while loading a DeepSpeed op leaves it, and every later load would wait for it "
                "forever)",
                lock,
                age,
            )
            return True
        time.sleep(poll_s)


@contextmanager
def _exclusive(path: str):
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _guarded(jit_load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(jit_load)
    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            directory = build_directory(self.name)
        except Exception:  # noqa: BLE001 - torch's layout changed: load as DeepSpeed would
            return jit_load(self, *args, **kwargs)
        with _exclusive(directory.rstrip(os.sep) + ".ds_adabatch.lock"):
            clear_stale_build_lock(directory)
            return jit_load(self, *args, **kwargs)

    setattr(load, _GUARDED, True)
    return load


def guard_jit_builds() -> None:
    """Run DeepSpeed's JIT op loads of this process under the guard (idempotent; Linux; a no-op where
    ``fcntl`` or DeepSpeed's op builder is missing, and on torch 2.14 and newer, whose own lock cannot be
    left behind)."""
    from .torch_compat import jit_build_lock_is_advisory

    if jit_build_lock_is_advisory():
        return
    try:
        import fcntl  # noqa: F401

        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:
        return
    if not getattr(OpBuilder.jit_load, _GUARDED, False):
        OpBuilder.jit_load = _guarded(OpBuilder.jit_load)


# The optimizers DeepSpeed 0.19.8 builds as CUDA ops on first use (engine._configure_basic_optimizer),
# unless offloaded to the CPU or, for Adam, torch_adam is set: config type -> the op's installed name.
_CUDA_OPTIMIZER_OPS = {
    "adam": "fused_adam",
    "adamw": "fused_adam",
    "lamb": "fused_lamb",
    "lion": "fused_lion",
}


def cuda_arch_list_problems(
    ds_config: dict[str, Any], accelerator: str, *, client_optimizer: bool
) -> list[Any]:
    """Problems (``ConfigProblem``) with ``TORCH_CUDA_ARCH_LIST`` that DeepSpeed would meet only inside
    ``deepspeed.initialize``, with a raw ``ValueError``, while it JIT-builds the optimizer's CUDA op.

    DeepSpeed 0.19.8 (``OpBuilder.compute_capability_args``) reads every entry of that variable as
    dot-separated integers with an optional ``+PTX``; an entry with an architecture suffix, such as the
    ``9.0a`` that images built for Hopper set, stops the build (``invalid literal for int() with base 10:
    '0a'``). Checked only where such a build will happen: on CUDA, the config's own optimizer (no instance
    passed) is Adam/AdamW without ``torch_adam``, Lamb or Lion, not offloaded to the CPU, and DeepSpeed
    was installed without that op prebuilt.
    """
    from ...config import ConfigProblem

    entries = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";").split(";")
    bad = [cc.strip() for cc in entries if cc.strip() and not _arch_parses(cc.strip())]
    optimizer = ds_config.get("optimizer") or {}
    kind = str(optimizer.get("type", "")).lower()
    params = optimizer.get("params") or {}
    offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
    if (
        not bad
        or accelerator != "cuda"
        or client_optimizer
        or kind not in _CUDA_OPTIMIZER_OPS
        or (kind in ("adam", "adamw") and params.get("torch_adam"))
        or offload in ("cpu", "nvme")
        or _prebuilt(_CUDA_OPTIMIZER_OPS[kind])
    ):
        return []
    fixed = ";".join(_arch_without_suffix(cc) for cc in entries if cc.strip())
    return [
        ConfigProblem(
            "optimizer.type",
            f"DeepSpeed 0.19.8 JIT-builds {optimizer.get('type')}'s CUDA op and cannot read the "
            f"TORCH_CUDA_ARCH_LIST entries {bad} (an architecture suffix such as 'a'): set "
            f"TORCH_CUDA_ARCH_LIST={fixed!r}, or unset it (DeepSpeed then reads the GPU's capability)"
            + (
                ", or set optimizer.params.torch_adam: true (torch's AdamW, no build)"
                if kind in ("adam", "adamw")
                else ""
            ),
            optimizer.get("type"),
        )
    ]


def _arch_parses(cc: str) -> bool:
    try:
        tuple(int(part.split("+")[0]) for part in cc.split("."))
    except ValueError:
        return False
    return True


def _arch_without_suffix(cc: str) -> str:
    """``9.0a`` -> ``9.0``, ``10.0f+PTX`` -> ``10.0+PTX``."""
    cc = cc.strip()
    ptx = "+PTX" if cc.endswith("+PTX") else ""
    digits = cc.removesuffix("+PTX").split(".")
    return ".".join("".join(ch for ch in part if ch.isdigit()) for part in digits) + ptx


def _prebuilt(op: str) -> bool:
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get(op))
