"""``ds-adabatch-run``: torchrun, with the agents' exit barrier made settable.

    ds-adabatch-run [--exit-barrier-timeout S] TORCHRUN_ARGS... train.py SCRIPT_ARGS...
    python -m ds_adabatch.launch [--exit-barrier-timeout S] TORCHRUN_ARGS... train.py SCRIPT_ARGS...

Everything else is torchrun's (``torch.distributed.run``), unchanged. Why: when the workers of a node
finish, its torchrun agent waits in an exit barrier for every agent of the rendezvous round
(``SimpleElasticAgent._exit_barrier``, torch 2.13), for up to 300 seconds, and torchrun has no option
for that wait. After a live shrink (``adabatch.live_elastic``) the lost node's agent never arrives, so
the survivors' agents would wait the full 300 seconds after the job is done. This launcher passes
``--exit-barrier-timeout`` (default 30 s: the ranks of a data-parallel job finish within seconds of each
other) to torch's ``LocalElasticAgent``; the job's result and exit status are unaffected.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

__all__ = ["main"]

DEFAULT_EXIT_BARRIER_S = 30.0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(
        "--exit-barrier-timeout", "--exit_barrier_timeout", type=float, default=DEFAULT_EXIT_BARRIER_S
    )
    # Only options before the training script are the launcher's (the script's own may share names).
    script_at = _script_index(argv)
    ours, rest = pre.parse_known_args(argv[:script_at])
    if ours.exit_barrier_timeout < 0:
        raise SystemExit("ds-adabatch-run: --exit-barrier-timeout must be >= 0 seconds")
    # torch 2.13's agents share one store with their workers by default, and an agent that was rank 0
    # of an earlier rendezvous round never publishes that store's address in a later round: a node
    # that joins a running job waits for it until its join timeout. With this variable each incarnation
    # of the workers has a store of its own, hosted by its rank 0, and a node can join.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.run import main as torchrun_main

    # launch_agent builds its agent from this module attribute; exit_barrier_timeout is a keyword of
    # LocalElasticAgent's constructor that torchrun never sets.
    launcher_api.LocalElasticAgent = functools.partial(
        launcher_api.LocalElasticAgent, exit_barrier_timeout=ours.exit_barrier_timeout
    )
    torchrun_main(rest + argv[script_at:])


def _script_index(argv: list[str]) -> int:
    """Index of the training script: the first argument that is neither an option of the launcher nor
    an option's value."""
    from torch.distributed.run import get_args_parser

    options = get_args_parser()._option_string_actions
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return i
        name = arg.split("=", 1)[0]
        takes_value = name in ("--exit-barrier-timeout", "--exit_barrier_timeout") or (
            name in options and options[name].nargs != 0
        )
        i += 2 if takes_value and "=" not in arg else 1
    return len(argv)


if __name__ == "__main__":
    main()
