"""The main job's language model over pipeline stages: a byte-level GPT-2-style model as a ``PipelineModule``.

A sibling of ``runners/train_lm.py`` (same corpus, windows and model dimensions, same metrics, checkpoint
and ledger options) for DeepSpeed's pipeline parallelism::

    torchrun --nproc-per-node 2 runners/train_pipe.py --pipeline-stages 2 --config ds_configs/pipe_ramp.json
    torchrun --nproc-per-node 4 runners/train_pipe.py --pipeline-stages 2    # 2 stages x 2 replicas

The world is ``stages x data-parallel replicas``; the global batch is planned on the replicas and every
step runs DeepSpeed's ``PipelineEngine.train_batch`` with the plan's micro-batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from runners.train_lm import add_run_arguments  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(p, config="ds_configs/pipe_ramp.json", samples=4096, out="runs/train_pipe")
    p.add_argument(
        "--pipeline-stages", type=int, default=2, help="pipeline stages (the world must divide by it)"
    )
    p.add_argument("--resume", default=None, help="resume from the newest complete checkpoint here (if any)")
    p.add_argument("--ledger", default=None, help="append one JSON line per step: sample indices, loss")
    return p.parse_args(argv)


class Embed(torch.nn.Module):
    """Byte and position embeddings (the first stage's input is the byte ids)."""

    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(256, width)
        self.positions = torch.nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class Block(torch.nn.Module):
    """A pre-norm causal transformer block (what a GPT-2 block computes)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(
            h.shape[1], device=h.device, dtype=h.dtype
        )
        return self.layer(h, src_mask=mask, is_causal=True)


class Head(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.out = torch.nn.Linear(width, 256)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-byte cross entropy over the rows it is given (the pipeline's loss_fn contract)."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def shifted_windows(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows -> (inputs, labels) as the pipeline reads them: bytes 0..n-2 predict bytes 1..n-1."""
    ids = torch.stack([s["input_ids"] for s in samples])
    return ids[:, :-1], ids[:, 1:]


def build_pipeline(spec, stages: int, seed: int):
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(seed)
    layers = [Embed(spec.width, spec.context), *(Block(spec.width, spec.heads) for _ in range(spec.layers))]
    layers.append(Head(spec.width))
    return PipelineModule(
        layers=layers, num_stages=stages, loss_fn=next_byte_loss, partition_method="uniform"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    import ds_adabatch
    from runners.lm import ByteCorpus, ByteWindows, ModelSpec
    from runners.train_lm import ledger_line, load_config, plot_metrics

    os.makedirs(args.out, exist_ok=True)
    config = load_config(args.config, args.out)
    jsonl = config["adabatch"]["log"]["jsonl"]
    try:  # a bad config is one clear message, before any process group exists
        ds_adabatch.load_ds_config(config)
    except ds_adabatch.ConfigError as err:
        print(f"error: {args.config}: {err}", file=sys.stderr)
        return 2

    ds_adabatch.init_distributed()  # a PipelineModule needs the process group to build its grid
    world = torch.distributed.get_world_size()
    if args.pipeline_stages < 1 or world % args.pipeline_stages:
        print(
            f"error: --pipeline-stages {args.pipeline_stages} does not divide the {world} processes",
            file=sys.stderr,
        )
        return 2
    spec = ModelSpec(layers=args.layers, width=args.width, heads=args.heads, context=args.context)
    train = ByteWindows(ByteCorpus(args.data, max_bytes=args.max_bytes).train, spec.context)
    model = build_pipeline(spec, args.pipeline_stages, args.seed)
    engine, _, _, _ = ds_adabatch.initialize(model, config, train, collate_fn=shifted_windows)
    rank0 = engine.global_rank == 0
    if rank0 and not args.resume and os.path.exists(jsonl):
        open(jsonl, "w").close()  # a fresh run starts a fresh metrics file
    if args.resume:
        path, _ = engine.load_checkpoint(args.resume)
        if rank0:
            print(
                f"resumed from {path} at step {engine.global_steps}" if path else "starting fresh", flush=True
            )
    bar = None
    if rank0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.samples, initial=engine.global_samples, unit="sample", dynamic_ncols=True)
    started, first = time.perf_counter(), engine.global_samples
    while engine.global_samples < args.samples:
        if args.max_steps is not None and engine.global_steps >= args.max_steps:
            break
        before = engine.global_samples
        loss = float(engine.train_batch())  # DeepSpeed's aggregated loss: the same on every stage
        if args.ledger and rank0:
            with open(args.ledger, "a", encoding="utf-8") as f:
                f.write(json.dumps(ledger_line(engine, loss)) + "\n")
        if bar is not None:
            rate = (engine.global_samples - first) / max(time.perf_counter() - started, 1e-9)
            bar.update(engine.global_samples - before)
            bar.set_postfix(batch=engine.plan.global_batch_size, gas=engine.plan.gradient_accumulation_steps,
                            loss=f"{loss:.3f}", sps=f"{rate:.0f}")  # fmt: skip
        if args.save_dir and args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
    if bar is not None:
        bar.close()
    if args.save_dir and engine.global_steps:
        engine.save_checkpoint(args.save_dir)
    engine.close()
    if rank0:
        plot_metrics(jsonl, os.path.join(args.out, "metrics.png"))
        ppl = math.exp(engine.last_loss) if engine.last_loss is not None else float("nan")
        print(
            f"done: {engine.global_steps} steps, {engine.global_samples} samples on {engine.num_stages} stages x "
            f"{engine.world_size} replicas, final loss {engine.last_loss:.4f} (perplexity {ppl:.1f}), "
            f"{len(engine.history)} batch changes; metrics in {args.out}"
        )
    return 0


if __name__ == "__main__":
    from ds_adabatch import finish  # ends the process: see its docstring

    finish(main())
