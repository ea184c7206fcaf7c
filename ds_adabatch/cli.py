"""``ds-adabatch``: check ds_configs, show batch plans, find elastic batch sizes, simulate schedules.

Subcommands::

    ds-adabatch validate CONFIG [CONFIG ...] [--world-size N] [--pipeline-stages S] [--tensor-parallel-size T]
    ds-adabatch plan --global-batch B --world-size W --max-micro M [--uneven] [--pipeline-stages S] [--tensor-parallel-size T]
    ds-adabatch schema
    ds-adabatch config-docs [--output PATH | --check PATH]
    ds-adabatch elastic --max-batch B --world-sizes 1-16 --max-micro M [--min-micro] [--max-gas] [--top K]
    ds-adabatch simulate CONFIG --world-size W --samples N --out plan.png [--csv plan.csv] [--replay m.jsonl]
        [--step-time fixed=0.03,per_sample=0.0004] [--noise-scale 40] [--lengths lengths.txt]
    ds-adabatch verify CKPT_DIR

Exit status: 0 on success; 1 from ``config-docs --check`` when the page is stale, and from ``verify`` when a
checkpoint fails its manifest or the folder holds no complete checkpoint; 2 on bad input or an invalid
config, with a message on stderr and no traceback. Only ``validate`` imports DeepSpeed (to check its sections).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .config.errors import ConfigError
from .plan import PlanError, compatible_batch_sizes, plan_batch
from .plan.text import format_int_ranges, format_plan, keys_text, parse_int_ranges, table

if TYPE_CHECKING:  # pragma: no cover - imported lazily below to keep pydantic off the fast paths
    from .config import LoadedConfig

__all__ = ["build_parser", "format_int_ranges", "format_plan", "main", "parse_int_ranges"]

PROG = "ds-adabatch"


class UsageError(Exception):
    """Bad input to a subcommand; the message is printed as is."""


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _int_ranges(text: str) -> list[int]:
    try:
        return parse_int_ranges(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err} (expected e.g. 1-8,12,16)") from None


def _cmd_plan(args: argparse.Namespace) -> int:
    stages, tensor = _layout_of(args, None)
    replicas = _data_parallel(args.world_size, stages, tensor)
    try:
        plan = plan_batch(args.global_batch, replicas, args.max_micro, allow_uneven=args.uneven)
    except PlanError as err:
        raise UsageError(f"{err} (on the command line: add --uneven)") from None
    mode = "uneven splits allowed" if args.uneven else "even splits only"
    where = f"{replicas} rank{'s' if replicas != 1 else ''}"
    if stages * tensor > 1:
        where = (
            f"{replicas} data-parallel replica{'s' if replicas != 1 else ''} ({args.world_size} processes: "
            f"{stages} pipeline stage(s) x {tensor} tensor rank(s) each; rows below are replicas)"
        )
    print(f"global batch {args.global_batch} on {where}, max micro-batch {args.max_micro} per GPU, {mode}\n")
    print(format_plan(plan))
    return 0


def _summary_lines(loaded: LoadedConfig, planned_by_world: dict[int, LoadedConfig]) -> list[str]:
    cfg = loaded.adabatch
    lo = cfg.min_global_batch or 1
    hi = cfg.max_global_batch if cfg.max_global_batch is not None else "unbounded"
    mode = "uneven splits allowed" if cfg.allow_uneven else "even splits only"
    lines = [
        f"  schedule: {json.dumps(cfg.schedule.model_dump(mode='json'))}",
        f"  global batch {lo}..{hi}, multiple of {cfg.granularity}; max micro-batch "
        f"{_micro_text(cfg)} per GPU; {mode}",
    ]
    lines += _auto_lines(loaded)
    if cfg.token_budget:
        # Token-budget steps are formed at run time from the samples' lengths: no fixed plan to show.
        unit = cfg.schedule.batch_unit
        lines[1] = (
            f"  global batch in {unit} per step, {lo}..{hi}; micro-batches of at most "
            f"{cfg.micro_batch_tokens} tokens ({cfg.padding}), formed from the lengths at run time"
        )
        return lines
    if not planned_by_world:
        lines.append("  (give --world-size N to see the plans)")
    for world, planned in planned_by_world.items():
        replicas = planned.plan.world_size
        where = f"world size {world}" + (
            f" ({replicas} data-parallel replica{'s' if replicas != 1 else ''})" if replicas != world else ""
        )
        lines.append(f"  {where}: start {planned.plan.describe()}; DeepSpeed keys: {keys_text(planned.plan)}")
        for name, value in cfg.schedule.endpoint_batches(replicas):
            if value == planned.plan.global_batch_size:
                continue
            plan = plan_batch(value, replicas, cfg.initial_micro_batch_limit, allow_uneven=cfg.allow_uneven)
            lines.append(f"    {name}: {plan.describe()}")
    return lines


def _auto_lines(loaded: LoadedConfig) -> list[str]:
    """What a noise-reading schedule's ``"auto"`` settings resolve to, from the rest of the ds_config."""
    from .config.loader import optimizer_geometry
    from .schedules.controller import batch_rule
    from .signals.efficiency import efficiency_form

    schedule, said = loaded.adabatch.schedule, []
    if getattr(schedule, "efficiency", None) == "auto":
        scaling = loaded.adabatch.lr_scaling
        why = f'lr_scaling.rule "{scaling.rule}"' + (
            f", gain_power {scaling.gain_power}" if scaling.rule == "adascale" else ""
        )
        said.append(f'efficiency "{efficiency_form("auto", batch_rule(scaling))}" ({why})')
    if getattr(schedule, "geometry", None) == "auto":
        named = optimizer_geometry(loaded.original)
        said.append(
            f'geometry "{named[1]}" (the ds_config\'s optimizer {named[0]}'
            + (", where its second moments can be read)" if named[1] == "adam" else ")")
            if named
            else 'geometry from the optimizer at run time ("adam" where it keeps Adam\'s second moment, else "sgd")'
        )
    return [f'  "auto" resolves to: {"; ".join(said)}'] if said else []


def _micro_text(cfg: Any) -> str:
    """``8``, or for ``"auto"`` what the runtime starts from and its ceiling."""
    if not cfg.auto_micro_batch:
        return str(cfg.max_micro_batch_per_gpu)
    ceiling = cfg.memory.micro_batch_ceiling
    start = cfg.memory.initial_micro_batch_per_gpu
    first = f"from {start}" if start else "from one pass per step"
    return f"auto (learned {first}, at most {ceiling if ceiling else 'one pass per step'})"


def _layout_of(args: argparse.Namespace, loaded: LoadedConfig | None) -> tuple[int, int]:
    """``(pipeline stages, tensor ranks)`` from the flags, else from the config (DeepSpeed's
    ``pipeline.stages`` and ``tensor_parallel.autotp_size``), else 1 each."""
    ds = loaded.deepspeed if loaded is not None else {}
    stages = getattr(args, "pipeline_stages", None)  # simulate has no layout flags: the config's
    if stages is None:
        configured = (ds.get("pipeline") or {}).get("stages")
        stages = configured if isinstance(configured, int) and configured > 0 else 1
    tensor = getattr(args, "tensor_parallel_size", None)
    if tensor is None:
        configured = (ds.get("tensor_parallel") or {}).get("autotp_size")
        tensor = configured if isinstance(configured, int) and configured > 0 else 1
    return stages, tensor


def _data_parallel(world: int, stages: int, tensor: int) -> int:
    """Replicas left by ``world`` processes of ``stages`` x ``tensor`` each (a UsageError otherwise)."""
    per_replica = stages * tensor
    if world % per_replica:
        raise UsageError(
            f"--world-size {world} is not a multiple of the processes of one replica ({stages} pipeline "
            f"stage(s) x {tensor} tensor rank(s) = {per_replica}): give a world size that is"
        )
    return world // per_replica


def _layout_problems(loaded: LoadedConfig, stages: int, tensor: int, replicas: int) -> list[str]:
    """What ``initialize`` would refuse for this layout (DeepSpeed's import only when it matters)."""
    if stages * tensor == 1:
        return []
    from .config.parallel import ParallelLayout, model_parallel_problems, pipeline_config_problems

    layout = ParallelLayout(replicas, 0, stages, tensor, 0)
    if stages > 1:
        problems = pipeline_config_problems(loaded, layout)
    else:
        problems = model_parallel_problems(loaded, layout)
    return [str(ConfigError([p])).split("\n", 1)[-1].strip() for p in problems]


def _cmd_validate(args: argparse.Namespace) -> int:
    from .config import load_ds_config

    world_sizes = args.world_size or []
    failed = 0
    for path in args.configs:
        try:
            loaded = load_ds_config(path)
            stages, tensor = _layout_of(args, loaded)
            problems = []
            planned_by_world = {}
            for world in world_sizes:
                try:
                    planned_by_world[world] = loaded.with_world_size(_data_parallel(world, stages, tensor))
                except ConfigError as err:
                    problems.append(f"with --world-size {world}: {err}")
            replicas = min((p.plan.world_size for p in planned_by_world.values()), default=1)
            problems += _layout_problems(loaded, stages, tensor, replicas)
            problems += _early_problems(loaded)
            if problems:
                raise UsageError("\n".join(problems))
            lines = _summary_lines(loaded, planned_by_world)
            if stages * tensor > 1:
                lines.insert(
                    0,
                    f"  layout: {stages} pipeline stage(s) x {tensor} tensor rank(s) per replica; plans "
                    "count data-parallel replicas (world size / processes per replica)",
                )
        except (ConfigError, UsageError) as err:
            failed += 1
            print(f"invalid: {path}\n{err}", file=sys.stderr, flush=True)
            continue
        print("\n".join([f"ok: {path}", *lines]), flush=True)
    if failed and len(args.configs) > 1:
        print(f"{failed} of {len(args.configs)} configs have problems", file=sys.stderr)
    return 2 if failed else 0


def _early_problems(loaded: Any) -> list[str]:
    from .runtime.initialize.sections import early_problems

    return early_problems(loaded)


def _cmd_schema(args: argparse.Namespace) -> int:
    from .config import AdaBatchConfig

    schema = AdaBatchConfig.model_json_schema()
    schema["title"] = 'The "adabatch" section of a ds_config'
    print(json.dumps(schema, indent=2))
    return 0


def _cmd_config_docs(args: argparse.Namespace) -> int:
    from .config import reference

    return reference.run(args)


def _cmd_elastic(args: argparse.Namespace) -> int:
    if args.min_micro > args.max_micro:
        raise UsageError(f"--min-micro ({args.min_micro}) must not exceed --max-micro ({args.max_micro})")
    found = compatible_batch_sizes(
        args.max_batch,
        args.world_sizes,
        args.max_micro,
        min_batch_size=args.min_batch,
        min_micro_batch_per_gpu=args.min_micro,
        max_gradient_accumulation_steps=args.max_gas,
        granularity=args.granularity,
    )
    sizes = format_int_ranges(args.world_sizes)
    if not found:
        raise UsageError(
            f"no global batch between {args.min_batch} and {args.max_batch} splits evenly on any of the world "
            f"sizes {sizes} under these limits: raise --max-batch or --max-gas, or lower --min-micro"
        )
    shown = found if args.top == 0 else found[: args.top]
    print(
        f"global batch sizes {args.min_batch}..{args.max_batch} that split evenly on world sizes {sizes} "
        f"(max micro-batch {args.max_micro} per GPU), most world sizes first\n"
    )
    rows = []
    for i, choice in enumerate(shown, 1):
        widest = choice.world_sizes[-1]
        plan = plan_batch(choice.global_batch_size, widest, args.max_micro)
        rows.append(
            [
                i,
                choice.global_batch_size,
                f"{choice.coverage} of {len(args.world_sizes)}",
                format_int_ranges(choice.world_sizes),
                f"micro {plan.micro_batch_per_gpu} x gas {plan.gradient_accumulation_steps} on {widest}",
            ]
        )
    print(table(["#", "global batch", "valid on", "world sizes", "largest world size"], rows))
    if len(shown) < len(found):
        print(f"\n{len(shown)} of {len(found)} shown; --top 0 shows all")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .config import load_ds_config

    loaded = load_ds_config(args.config, world_size=args.world_size).honouring_deepspeed_drop_last()
    # What initialize would refuse for the config's own pipeline / tensor layout (--world-size counts
    # data-parallel replicas here), as validate says it.
    stages, tensor = _layout_of(args, loaded)
    problems = _layout_problems(loaded, stages, tensor, args.world_size)
    if problems:
        raise UsageError("\n".join(problems))
    if args.replay is not None and not Path(args.replay).is_file():
        raise UsageError(f"--replay {args.replay}: file not found")
    extra = {"tokens_per_sample": args.tokens_per_sample} if args.tokens_per_sample else {}
    if args.step_time is not None:
        extra["step_time"] = args.step_time
    if args.noise_scale is not None:
        extra["noise_scale"] = args.noise_scale
        if args.replay is not None:
            print(
                f"the noise scale is --noise-scale's ({args.noise_scale:g}), not --replay's; its other signals are replayed"
            )
    if args.lengths is not None:
        if not Path(args.lengths).is_file():
            raise UsageError(f"--lengths {args.lengths}: file not found")
        from .data.simulated_steps import PackedSteps, read_lengths

        try:
            extra["steps"] = PackedSteps(loaded, read_lengths(args.lengths))
        except ValueError as err:
            raise UsageError(f"--lengths {args.lengths}: {err}") from None
    for out in (args.out, args.csv):  # their folders are made, as an output_dir is
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
    try:
        # Imported here: the simulator may draw with matplotlib, which the other subcommands never need.
        from ds_adabatch.schedules.simulate import simulate

        rows = simulate(
            loaded,
            world_size=args.world_size,
            samples=args.samples,
            out_png=args.out,
            out_csv=args.csv,
            replay=args.replay,
            **extra,
        )
    except ImportError as err:
        raise UsageError(
            f"the simulator needs a package that is not installed ({err}); install the plot extra: "
            "pip install 'ds_adabatch[plot]'"
        ) from None
    except (ValueError, OSError) as err:  # the simulator refusing a request, or an unwritable --out
        raise UsageError(str(err)) from None
    if isinstance(rows, list) and rows and isinstance(rows[0], dict) and "global_batch" in rows[0]:
        batches = [row["global_batch"] for row in rows]
        packed = (
            ""
            if rows[0].get("pass_budget") is None
            else (
                f"; {min(r['gradient_accumulation_steps'] for r in rows)}.."
                f"{max(r['gradient_accumulation_steps'] for r in rows)} passes of {rows[0]['pass_budget']} tokens "
                f"per rank"
            )
        )
        print(
            f"{len(rows)} optimizer steps over {args.samples} samples on {args.world_size} ranks: global batch "
            f"{batches[0]} -> {batches[-1]} (range {min(batches)}..{max(batches)}){packed}"
        )
    csv = args.csv or str(Path(args.out).with_suffix(".csv"))
    written = [path for path in (args.out, csv) if Path(path).is_file()]
    if written:
        print(f"wrote {', '.join(written)}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from .checkpoint_manifest import verify_folder

    lines, ok = verify_folder(args.folder)
    print("\n".join(lines))
    return 0 if ok else 1


def _layout_arguments(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--pipeline-stages",
        type=_positive_int,
        default=None,
        metavar="S",
        help=f"pipeline stages of one replica ({default})",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=None,
        metavar="T",
        help=f"tensor ranks of one stage ({default})",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``ds-adabatch`` argument parser (one subparser per subcommand)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tools for ds_adabatch: adaptive global batch size for DeepSpeed training.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of unexpected errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_validate(sub)
    _add_plan(sub)
    _add_schema(sub)
    _add_config_docs(sub)
    _add_elastic(sub)
    _add_simulate(sub)
    _add_verify(sub)
    return parser


def _add_validate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("validate", help="check ds_config files (DeepSpeed's sections too); print the plan")
    p.add_argument(
        "configs", nargs="+", metavar="CONFIG", help="ds_config JSON file(s) with an adabatch section"
    )
    p.add_argument(
        "--world-size",
        type=_int_ranges,
        metavar="N",
        help="processes to plan for (the launcher's world size); a list or range such as 1,2,8 or 1-8 "
        "checks each. Plans count data-parallel replicas: world size / (pipeline stages x tensor ranks)",
    )
    _layout_arguments(p, "default: the config's pipeline.stages / tensor_parallel.autotp_size, else 1")
    p.set_defaults(func=_cmd_validate)


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="split a global batch into micro-batches per rank and step")
    p.add_argument(
        "--global-batch", type=_positive_int, required=True, metavar="B", help="samples per optimizer step"
    )
    p.add_argument(
        "--world-size",
        type=_positive_int,
        required=True,
        metavar="W",
        help="processes (data-parallel ranks without pipeline or tensor parallelism)",
    )
    p.add_argument(
        "--max-micro", type=_positive_int, required=True, metavar="M", help="max samples per GPU per pass"
    )
    p.add_argument("--uneven", action="store_true", help="allow micro-batches that differ by one sample")
    _layout_arguments(p, "default 1")
    p.set_defaults(func=_cmd_plan)


def _add_schema(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of the adabatch section (for editors)")
    p.set_defaults(func=_cmd_schema)


def _add_config_docs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "config-docs", help="print, write (--output) or check (--check) the adabatch reference page"
    )
    docs = p.add_mutually_exclusive_group()
    docs.add_argument(
        "--output", metavar="PATH", default=None, help="write the page to PATH (default: print it)"
    )
    docs.add_argument(
        "--check", metavar="PATH", default=None, help="exit 1 if PATH differs from the generated page"
    )
    p.set_defaults(func=_cmd_config_docs)


def _add_elastic(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("elastic", help="global batch sizes that split evenly on many GPU counts")
    p.add_argument("--max-batch", type=_positive_int, required=True, metavar="B", help="largest global batch")
    p.add_argument(
        "--min-batch", type=_positive_int, default=1, metavar="B", help="smallest global batch (1)"
    )
    p.add_argument(
        "--world-sizes", type=_int_ranges, required=True, metavar="LIST", help="e.g. 1-16 or 1-8,12,16"
    )
    p.add_argument(
        "--max-micro", type=_positive_int, required=True, metavar="M", help="max samples per GPU per pass"
    )
    p.add_argument(
        "--min-micro", type=_positive_int, default=1, metavar="M", help="min micro-batch a GPU may get (1)"
    )
    p.add_argument("--max-gas", type=_positive_int, default=None, metavar="G", help="max accumulation steps")
    p.add_argument(
        "--granularity", type=_positive_int, default=1, metavar="G", help="batches are multiples of G"
    )
    p.add_argument("--top", type=_non_negative_int, default=10, metavar="K", help="rows to show (10; 0: all)")
    p.set_defaults(func=_cmd_elastic)


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="plot the planned batch, micro, GAS and LR against samples")
    p.add_argument("config", metavar="CONFIG", help="ds_config JSON file with an adabatch section")
    p.add_argument("--world-size", type=_positive_int, required=True, metavar="W", help="data-parallel ranks")
    p.add_argument(
        "--samples", type=_positive_int, required=True, metavar="N", help="training samples to simulate"
    )
    p.add_argument("--out", required=True, metavar="PNG", help="plot to write")
    p.add_argument(
        "--csv",
        default=None,
        metavar="CSV",
        help="where the plan per step is written as CSV (default: --out's path with .csv)",
    )
    p.add_argument(
        "--replay", default=None, metavar="JSONL", help="recorded metrics for signal-driven schedules"
    )
    p.add_argument(
        "--tokens-per-sample",
        type=_non_negative_int,
        default=0,
        metavar="T",
        help="tokens per sample (e.g. sequence length) for schedules keyed on tokens",
    )
    p.add_argument(
        "--step-time",
        default=None,
        metavar="CURVE",
        help="what a step costs, for goodput: fixed=S,per_pass=S,per_sample=S (seconds), optionally with "
        "jitter=S (each step measured within a lognormal factor whose log has that standard deviation, "
        "as a real device's times scatter) and drift=S[,drift_steps=N] (the device's speed changing by "
        "such a factor every N steps on average, default 50), or a table of step times by shape, MICRO:S (one pass) or "
        "MICROxGAS:S (several; without one, extra passes cost only their samples), e.g. 8:0.031,8x4:0.06",
    )
    p.add_argument(
        "--noise-scale",
        type=float,
        default=None,
        metavar="B",
        help="a fixed gradient-noise scale (samples) in place of --replay's, for gradient_noise and goodput",
    )
    p.add_argument(
        "--lengths",
        default=None,
        metavar="FILE",
        help="with micro_batch_tokens: every sample's length in tokens, in dataset order (text with one "
        "per line, a JSON list, or .npy); steps are packed from them as in a run",
    )
    p.set_defaults(func=_cmd_simulate)


def _add_verify(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify", help="check every checkpoint in a folder against its manifest (exit 1: damaged)"
    )
    p.add_argument("folder", metavar="CKPT_DIR", help="the folder given to save_checkpoint / --save-dir")
    p.set_defaults(func=_cmd_verify)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ds-adabatch`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has printed usage or --help / --version
        return int(exit_.code or 0)
    command: Callable[[argparse.Namespace], int] = args.func
    with contextlib.suppress(
        OSError
    ):  # a schedule's module in the working directory (python's `-m` finds it)
        sys.path.append(os.getcwd())
    try:
        return command(args)
    except (ConfigError, PlanError, UsageError) as err:
        print(f"{PROG} {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say, as for other tools
        # Python would report the pipe again when it flushes stdout at exit: point stdout at /dev/null.
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stdout without a descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:  # never a traceback for the user unless asked for
        if args.debug:
            raise
        print(
            f"{PROG} {args.command}: unexpected error: {type(err).__name__}: {err} "
            f"(run `{PROG} --debug {args.command} ...` to see the traceback)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
