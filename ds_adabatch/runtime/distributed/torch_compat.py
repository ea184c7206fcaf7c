"""What differs between the torch releases ds_adabatch runs on (setup.py's range), in one place.

Other modules ask here instead of comparing torch versions themselves. Each entry names the releases it
was read from (docs/versions.md lists what runs on which release).

* The JIT build lock of ``torch.utils.cpp_extension.load``, which DeepSpeed's op builders call. Up to
  torch 2.13 (read in 2.11.0, 2.12.0, 2.12.1 and 2.13.0) a load marks its work by creating
  ``<build directory>/lock`` (``FileBaton``) and removing it when done, and every other process waits,
  without a time limit, until the file is gone: a process killed in between leaves a file that blocks
  every later load (the guard in :mod:`ds_adabatch.runtime.distributed.op_builds` clears it). From torch 2.14.0 (read
  in 2.14.0, 2.14.1 and 2.15.0) the same file is held with an OS advisory lock (``FileLock``), which the
  kernel releases when its holder dies, and the file stays after every load: nothing is left to clear,
  and removing the file while another process holds it would let two builds of one op run at once.

The private torch names ds_adabatch uses (``torch.distributed.distributed_c10d._get_default_store``,
``_abort_process_group`` and ``_set_pg_timeout``, ``torch.utils.cpp_extension._get_build_directory``,
torchrun's agent and parser hooks) and ``torch.from_file(shared=True)`` are the same in all of them: tests/test_torch_compat.py checks
them on each release.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["jit_build_lock_is_advisory", "torch_release"]


@functools.cache
def torch_release() -> tuple[int, int]:
    """(major, minor) of the torch this process imported (a local suffix such as ``+cu130`` ignored)."""
    major, minor = torch.__version__.split("+", 1)[0].split(".")[:2]
    return int(major), int(minor)


def jit_build_lock_is_advisory() -> bool:
    """Whether torch's JIT builds hold ``<build directory>/lock`` with an OS advisory lock (torch 2.14 and
    newer) rather than waiting for the file to disappear (torch 2.13 and older); see the module's text."""
    return torch_release() >= (2, 14)
