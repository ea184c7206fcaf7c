"""The main job: a byte-level GPT-2-style language model trained with a changing global batch.

Run under the ``deepspeed`` launcher or torchrun, on CPU (``DS_ACCELERATOR=cpu``) or GPUs::

    deepspeed --num_gpus 2 runners/train_lm.py --config ds_configs/lm_ramp.json
    torchrun --nproc-per-node 2 runners/train_lm.py --config ds_configs/lm_ramp.json

Rank 0 shows a progress bar (global batch, LR, loss, samples/s). At the end the output folder holds
``metrics.jsonl`` (one line per optimizer step) and ``metrics.png`` (loss, global batch and LR against
samples). ``--save-dir`` / ``--resume`` checkpoint and resume through ``engine.save_checkpoint`` /
``engine.load_checkpoint``.

Exit status: 0 when done; 2 for a bad config; 75 when a rank ran out of memory where the step could not
be re-planned (``UnrecoverableOutOfMemory``): that rank recorded the lower micro-batch limit next to the
checkpoints, and a restart with the same command line (``torchrun --max-restarts``) resumes from the last
complete checkpoint below it. The other ranks then fail in their next collective and the launcher
stops them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def add_run_arguments(p: argparse.ArgumentParser, *, config: str, samples: int, out: str) -> None:
    """The arguments the main job shares with runners/train_pipe.py (data, model, run length, saves)."""
    p.add_argument("--config", default=config, help="ds_config JSON with an adabatch section")
    p.add_argument("--data", nargs="*", default=None, help="text files to train on (default: stdlib sources)")
    p.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes of text")
    p.add_argument("--samples", type=int, default=samples, help="stop after this many training samples")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--out", default=out, help="folder for metrics.jsonl and metrics.png")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64, help="bytes per training window")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    p.add_argument("--save-dir", default=None, help="save a checkpoint here at the end")
    p.add_argument("--save-every", type=int, default=0, help="also save every N optimizer steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # The deepspeed launcher passes --local_rank=N; torchrun sets LOCAL_RANK instead.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(p, config="ds_configs/lm_ramp.json", samples=8192, out="runs/train_lm")
    p.add_argument(
        "--keep-last",
        type=int,
        default=None,
        help="keep only the newest N complete checkpoints (default: all)",
    )
    p.add_argument(
        "--resume",
        default=None,
        help="resume from the newest complete checkpoint in this folder (if any), on any number of ranks",
    )
    p.add_argument(
        "--ledger",
        default=None,
        help="append one JSON line per step: the sample indices it trained, loss, time",
    )
    return p.parse_args(argv)


def load_config(path: str, out_dir: str) -> dict:
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    # The run's metrics go to the output folder unless the config names a file.
    log = config.setdefault("adabatch", {}).setdefault("log", {})
    if not log.get("jsonl"):
        log["jsonl"] = os.path.join(out_dir, "metrics.jsonl")
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    import ds_adabatch
    from runners.lm import ByteCorpus, ByteWindows, ModelSpec, build_model

    os.makedirs(args.out, exist_ok=True)
    config = load_config(args.config, args.out)
    jsonl = config["adabatch"]["log"]["jsonl"]
    # Validate before anything heavy or distributed starts: a bad config is one clear message.
    try:
        ds_adabatch.load_ds_config(config)
    except ds_adabatch.ConfigError as err:
        print(f"error: {args.config}: {err}", file=sys.stderr)
        return 2

    spec = ModelSpec(layers=args.layers, width=args.width, heads=args.heads, context=args.context)
    corpus = ByteCorpus(args.data, max_bytes=args.max_bytes)
    train = ByteWindows(corpus.train, spec.context)
    model = build_model(spec, seed=args.seed)

    engine, _, _, _ = ds_adabatch.initialize(model, config, train)
    rank0 = engine.global_rank == 0
    if rank0 and not args.resume and os.path.exists(jsonl):
        open(jsonl, "w").close()  # a fresh run starts a fresh metrics file
    if args.resume:
        # A missing checkpoint is a fresh start, so one command line serves first start and restarts
        # (an elastic agent relaunching the job on fewer or more ranks included).
        try:
            path, _ = engine.load_checkpoint(args.resume)
        except ds_adabatch.CheckpointCorrupt as err:  # raised on every rank alike, before any step
            if rank0:
                print(f"error: {err}", file=sys.stderr, flush=True)
            return 1
        if rank0:
            print(
                f"resumed from {path} at step {engine.global_steps}, {engine.global_samples} samples, "
                f"on {engine.world_size} ranks"
                if path
                else f"no checkpoint in {args.resume}: starting fresh",
                flush=True,
            )
    ledger = args.ledger if rank0 else None

    bar = None
    if rank0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.samples, initial=engine.global_samples, unit="sample", dynamic_ncols=True)
    saved_step = None
    started = time.perf_counter()
    first_samples = engine.global_samples
    try:
        while engine.global_samples < args.samples:
            if args.max_steps is not None and engine.global_steps >= args.max_steps:
                break
            before = engine.global_samples
            loss = float(engine.train_batch())
            if ledger:
                with open(ledger, "a", encoding="utf-8") as f:
                    f.write(json.dumps(ledger_line(engine, loss)) + "\n")
            if bar is not None:
                rate = (engine.global_samples - first_samples) / max(time.perf_counter() - started, 1e-9)
                bar.update(engine.global_samples - before)
                bar.set_postfix(
                    batch=engine.plan.global_batch_size,
                    lr=f"{engine.get_lr()[0]:.2e}",
                    loss=f"{loss:.3f}",
                    sps=f"{rate:.0f}",
                )
            if args.save_dir and args.save_every and engine.global_steps % args.save_every == 0:
                engine.save_checkpoint(args.save_dir, keep_last=args.keep_last)
                saved_step = engine.global_steps
    except (ds_adabatch.UnrecoverableOutOfMemory, ds_adabatch.LiveRecoveryFailed) as exc:
        # This rank cannot go on, and the others may be inside a collective it will never join: end
        # now with the status that says whether a restart resumes below the size that failed (or,
        # for a lost node that host memory cannot make up for, from the last complete checkpoint).
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    if bar is not None:
        bar.close()
    if args.save_dir and engine.global_steps and saved_step != engine.global_steps:
        engine.save_checkpoint(args.save_dir, keep_last=args.keep_last)
    engine.close()

    if rank0:
        plot_metrics(jsonl, os.path.join(args.out, "metrics.png"))
        print(
            f"done: {engine.global_steps} steps, {engine.global_samples} samples, final loss "
            f"{engine.last_loss:.4f}, {len(engine.history)} batch changes; metrics in {args.out}"
        )
    return 0


def ledger_line(engine, loss: float) -> dict:
    """One step of the per-sample ledger: which sample indices it trained, on how many ranks, when."""
    return {
        "step": engine.global_steps,
        "samples": engine.global_samples,
        "world_size": engine.world_size,
        "micro_batch_per_gpu": engine.plan.micro_batch_per_gpu,
        "gradient_accumulation_steps": engine.plan.gradient_accumulation_steps,
        "indices": engine.last_step_batch.global_batch.all_indices(),
        "loss": loss,
        "time": time.time(),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }


def plot_metrics(jsonl: str, png: str) -> None:
    """Loss, global batch and LR against samples, from a metrics JSONL file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(jsonl, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    samples = [r["samples"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for ax, key, label in zip(
        axes, ("loss", "global_batch", "lr"), ("loss", "global batch", "learning rate")
    ):
        ax.plot(
            samples, [r[key] for r in rows], drawstyle="steps-post" if key == "global_batch" else "default"
        )
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("training samples")
    fig.suptitle("ds_adabatch: byte-level LM")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    from ds_adabatch import finish  # ends the process: see its docstring

    finish(main())
