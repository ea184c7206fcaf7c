"""A Trainer script of the shape of transformers' ``examples/pytorch/language-modeling/run_clm.py``.

Usage: torchrun --nproc-per-node 2 tests/hf_clm_script.py --output_dir OUT [--deepspeed CONFIG]
       [--adabatch_config SECTION.json] [--grow_every N] [--max_steps N | --num_train_epochs E] ...

As run_clm.py: ``HfArgumentParser`` over the script's arguments and ``TrainingArguments``, logging set
up from ``--log_level`` (``logging.basicConfig`` on stdout, transformers' verbosity and explicit
format), a GPT-2 built from a config, text cut into blocks of ``--block_size`` tokens held in a
``datasets.Dataset`` with ``labels`` = ``input_ids``, ``default_data_collator``, training, saving the
model, metrics and state, and an evaluation at the end. The changes run_clm.py needs are the README's:
``Trainer`` -> ``AdaptiveBatchSizeTrainer`` with ``adabatch_config=`` (and, here, with ``--grow_every``,
a ``batch_size_scheduler`` function). Run by tests/test_hf_clm_script.py.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from functools import partial

import datasets
import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    TrainingArguments,
    default_data_collator,
)

import ds_adabatch
from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

logger = logging.getLogger(__name__)


@dataclass
class ScriptArguments:
    block_size: int = field(default=16, metadata={"help": "tokens per training sample"})
    train_blocks: int = field(default=64, metadata={"help": "training samples (blocks)"})
    eval_blocks: int = field(default=8, metadata={"help": "evaluation samples (blocks)"})
    adabatch_config: str = field(default=None, metadata={"help": "JSON file of the adabatch section"})
    grow_every: int = field(default=0, metadata={"help": "batch_size_scheduler: +1 per device every N steps"})


def grow_per_device_batch(step: int, batch_size: int, every: int = 3) -> int:
    """Samples per device per optimizer step: one more every ``every`` steps."""
    return batch_size + 1 if step > 0 and step % every == 0 else batch_size


def text_blocks(block_size: int, count: int, offset: int) -> datasets.Dataset:
    """Byte tokens of a standard-library source, cut into blocks, as run_clm.py's group_texts does."""
    with open(os.__file__, "rb") as f:
        data = f.read()
    ids = [list(data[(offset + i) * block_size : (offset + i + 1) * block_size]) for i in range(count)]
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "attention_mask": [[1] * block_size] * count, "labels": ids}
    )


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()

    torch.manual_seed(training_args.seed)
    config = GPT2Config(vocab_size=256, n_positions=script_args.block_size, n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    train_dataset = text_blocks(script_args.block_size, script_args.train_blocks, 0)
    eval_dataset = text_blocks(script_args.block_size, script_args.eval_blocks, script_args.train_blocks)

    scheduler = None
    if script_args.grow_every:  # the function's unit: samples per device per optimizer step
        scheduler = partial(grow_per_device_batch, every=script_args.grow_every)

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=scheduler,
        adabatch_config=script_args.adabatch_config,
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=default_data_collator,
    )
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    logger.info("*** Evaluate ***")
    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(metrics["eval_loss"])
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
    ds_adabatch.finish()
