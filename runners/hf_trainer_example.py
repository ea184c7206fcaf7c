"""Hugging Face Trainer demo: the per-device batch grows by one sample every 5 optimizer steps.

A byte-level GPT-2 (built from a config, nothing downloaded) trains on windows of a few standard-library
source files with ``AdaptiveBatchSizeTrainer``. Every rank prints, per optimizer step, its local batch
size and the sample indices it trained; rank 0's logs carry ``train_coverage``, the fractional
``epoch``, the global batch, the micro-batch and the accumulation steps. Any ``TrainingArguments`` flag
works (``--num_train_epochs``, ``--max_steps``, ``--dataloader_drop_last``, ``--save_steps``, ...).

    torchrun --nproc-per-node 2 runners/hf_trainer_example.py
    torchrun --nproc-per-node 2 runners/hf_trainer_example.py --deepspeed ds_configs/hf_zero2.json

The function is the schedule; the ``"adabatch"`` section of a ``--deepspeed`` config (or of
``--adabatch_config PATH``, with or without DeepSpeed) still sets the largest micro-batch, the bounds,
``allow_uneven``, the logs, ... (its own ``schedule`` is set aside here, since a trainer takes one
schedule). With ``--use_config_schedule`` the section's schedule drives the global batch instead of the
function, e.g. the ``gradient_noise`` schedule of ``ds_configs/hf_zero2_noise.json`` (its estimate is
logged as ``noise_scale``).

With ``--micro_batch_tokens N`` (and a ``--deepspeed`` config) the samples are the source files' lines
(1 to ``context`` bytes each), padded to the longest of each pass, and every pass holds at most N padded
tokens (the config's ``"adabatch"`` section gets ``micro_batch_tokens``; the lengths are each sample's
``len(input_ids)``); the logs add ``global_batch_tokens`` and ``train_tokens``:

    torchrun --nproc-per-node 2 runners/hf_trainer_example.py --deepspeed ds_configs/hf_zero2.json \
        --micro_batch_tokens 256
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # DeepSpeed's CPU accelerator (gloo); must be chosen before DeepSpeed is imported.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
from transformers import HfArgumentParser, TrainerCallback, TrainingArguments  # noqa: E402

import ds_adabatch  # noqa: E402
from ds_adabatch.integrations import AdaptiveBatchSizeTrainer  # noqa: E402
from runners.lm import ByteCorpus, ByteWindows, ModelSpec, build_model, stdlib_sources  # noqa: E402


def custom_batch_size_scheduler(step: int, batch_size: int, interval: int = 5, increment: int = 1) -> int:
    """step: optimizer steps completed; batch_size: the current per-device batch (samples per step)."""
    if step % interval == 0 and step > 0:
        return batch_size + increment
    return batch_size


@dataclass
class DemoArguments:
    interval: int = field(default=5, metadata={"help": "grow the per-device batch every this many steps"})
    increment: int = field(default=1, metadata={"help": "samples added to the per-device batch each time"})
    samples: int = field(default=20, metadata={"help": "training windows (samples) in the dataset"})
    source_files: int = field(default=3, metadata={"help": "standard-library .py files to read"})
    use_config_schedule: bool = field(
        default=False, metadata={"help": "let the adabatch section's schedule drive the batch"}
    )
    adabatch_config: str = field(
        default=None, metadata={"help": "JSON file of an adabatch section (instead of one in --deepspeed)"}
    )
    micro_batch_tokens: int = field(
        default=0,
        metadata={
            "help": "with --deepspeed: train on source lines, at most this many padded tokens per pass"
        },
    )


class SourceLines(torch.utils.data.Dataset):
    """The non-empty lines of a byte corpus, each cut to ``context`` bytes: ``{"input_ids": [...]}``."""

    def __init__(self, data, context: int, *, limit: int) -> None:
        lines = [line[:context] for line in bytes(data).split(b"\n") if line.strip()]
        self.lines = lines[:limit]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": list(self.lines[i])}


def pad_to_longest(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Pads a pass to its longest sample (what ``"padding": "pad_to_longest"`` counts); labels -100 there."""
    rows = [torch.tensor(s["input_ids"]) for s in samples]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    labels = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-100)
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


def with_token_budget(args: TrainingArguments, tokens: int) -> TrainingArguments:
    """``args`` whose DeepSpeed config cuts every pass to ``tokens`` padded tokens."""
    if not args.deepspeed:
        raise SystemExit("--micro_batch_tokens needs --deepspeed (the budget lives in its adabatch section)")
    config = args.deepspeed
    if not isinstance(config, dict):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    section = dict(config.get("adabatch", {}))
    section.pop("max_micro_batch_per_gpu", None)  # the token budget bounds a pass instead
    section.setdefault("schedule", {"type": "constant", "value": 8})
    section.update(micro_batch_tokens=tokens, padding="pad_to_longest")
    return dataclasses.replace(args, deepspeed={**config, "adabatch": section})


def without_schedule(args: TrainingArguments, section: str | None) -> tuple[TrainingArguments, dict | None]:
    """The arguments and adabatch section to run the function with: the section (from ``--adabatch_config``
    or the ``--deepspeed`` config) without its schedule, and the DeepSpeed config without the section."""
    found = None
    if section is not None:
        with open(section, encoding="utf-8") as f:
            found = json.load(f)
        found = found.get("adabatch", found)
    config = args.deepspeed
    if config and not isinstance(config, dict):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if config and "adabatch" in config:
        found = config["adabatch"] if found is None else found
        args = dataclasses.replace(args, deepspeed={k: v for k, v in config.items() if k != "adabatch"})
    if found is None:
        return args, None
    return args, {k: v for k, v in found.items() if k != "schedule"}


class LocalBatchPrinter(TrainerCallback):
    """Prints what this rank trained in each optimizer step, as the seed's demo does."""

    def __init__(self, trainer: AdaptiveBatchSizeTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs) -> None:
        step = self.trainer.batch_state.last_step
        indices = [i for m in step.micro_batches for i in m.indices]
        micro = [m.num_samples for m in step.micro_batches]
        # One write per line, so the ranks' lines do not interleave mid-line.
        sys.stdout.write(
            f"step {state.global_step} rank {args.process_index}: local batch size {step.num_samples} "
            f"(micro-batches {micro}), indices {indices}\n"
        )
        sys.stdout.flush()


def main() -> None:
    parser = HfArgumentParser((TrainingArguments, DemoArguments))
    parser.set_defaults(
        output_dir="runs/hf_trainer_example",
        num_train_epochs=3,
        per_device_train_batch_size=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        learning_rate=1e-3,
        ddp_find_unused_parameters=False,
        # Without GPUs the ranks train as one gloo group only with use_cpu (the trainer would otherwise
        # switch it on with a warning).
        use_cpu=not torch.cuda.is_available(),
    )
    training_args, demo = parser.parse_args_into_dataclasses()

    spec = ModelSpec(layers=2, width=64, heads=4, context=64)
    corpus = ByteCorpus(stdlib_sources()[: demo.source_files])
    dataset = ByteWindows(corpus.train, spec.context, limit=demo.samples)
    collator = None
    if demo.micro_batch_tokens:
        training_args = with_token_budget(training_args, demo.micro_batch_tokens)
        dataset = SourceLines(corpus.train, spec.context, limit=demo.samples)
        collator = pad_to_longest
    scheduler = None
    section = demo.adabatch_config
    if not demo.use_config_schedule:
        scheduler = partial(custom_batch_size_scheduler, interval=demo.interval, increment=demo.increment)
        training_args, section = without_schedule(training_args, section)

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=scheduler,
        adabatch_config=section,
        model=build_model(spec, seed=training_args.seed),
        args=training_args,
        train_dataset=dataset,
        data_collator=collator,
    )
    trainer.add_callback(LocalBatchPrinter(trainer))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()
