# ruff: noqa: B007, SIM102, SIM118  (the example's own code, kept as accelerate writes it)
"""accelerate's ``examples/by_feature/deepspeed_with_config_support.py`` (accelerate 1.15), as a user of
ds_adabatch runs it: ``accelerator.prepare(...)`` replaced by ``prepare(accelerator, ...)``, an
``"adabatch"`` section in the DeepSpeed config file, and the engine closed at the end. The rest is the
example's flow: a causal LM from ``--config_name`` / ``--tokenizer_name`` (local folders), a text file
loaded with ``datasets``, tokenised and grouped into blocks, ``DummyOptim`` / ``DummyScheduler`` when the
DeepSpeed config has an optimizer / scheduler, the ``accumulate()`` loop, checkpoints with
``save_state`` and ``--resume_from_checkpoint``, an evaluation per epoch.

    accelerate launch --use_deepspeed --deepspeed_config_file ds.json --num_processes 1 \\
        tests/accelerate_examples/deepspeed_with_config_support.py --train_file text.txt \\
        --config_name tiny_gpt2 --tokenizer_name tiny_gpt2 --block_size 16 --seed 0

Test instrumentation only: ``--without_adabatch`` calls ``accelerator.prepare`` (the same loop without
ds_adabatch), ``--no_shuffle`` builds the training loader with ``shuffle=False``, ``--no_eval`` skips the evaluation
(accelerate's ``gather_for_metrics`` cannot run on two CPU ranks, see tests/test_accelerate.py), and
ADABATCH_TEST_OUT=<dir> makes the main process write the loss of every micro-batch, the samples of every
optimizer step and the parameters into <dir>/<--run_name>.json / .pt.
"""

import argparse
import json
import logging
import math
import os
from itertools import chain

import datasets
import torch
import transformers
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DummyOptim, DummyScheduler, set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler

import ds_adabatch
from ds_adabatch.integrations.accelerate import prepare

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="Causal LM training with accelerate and a DeepSpeed config")
    parser.add_argument("--train_file", type=str, required=True, help="a .txt file")
    parser.add_argument("--validation_split_percentage", type=int, default=5)
    parser.add_argument("--config_name", type=str, required=True)
    parser.add_argument("--tokenizer_name", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=str, default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--block_size", type=int, default=None)
    parser.add_argument("--checkpointing_steps", type=str, default=None)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    # test instrumentation
    parser.add_argument("--without_adabatch", action="store_true")
    parser.add_argument("--no_shuffle", action="store_true")
    parser.add_argument("--run_name", type=str, default="run")
    parser.add_argument("--no_eval", action="store_true")
    return parser.parse_args()


def evaluate(args, model, eval_dataloader, accelerator, eval_dataset):
    model.eval()
    losses = []
    for step, batch in enumerate(eval_dataloader):
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
    losses = torch.cat(losses)
    try:
        eval_loss = torch.mean(losses)
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    return perplexity, eval_loss


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    data_files = {"train": args.train_file}
    raw_datasets = load_dataset("text", data_files=data_files, keep_linebreaks=True)
    raw_datasets["validation"] = load_dataset(
        "text",
        data_files=data_files,
        split=f"train[:{args.validation_split_percentage}%]",
        keep_linebreaks=True,
    )
    raw_datasets["train"] = load_dataset(
        "text",
        data_files=data_files,
        split=f"train[{args.validation_split_percentage}%:]",
        keep_linebreaks=True,
    )

    config = AutoConfig.from_pretrained(args.config_name)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(config)
    model.resize_token_embeddings(len(tokenizer))

    column_names = raw_datasets["train"].column_names
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with accelerator.main_process_first():
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=column_names)
    block_size = min(args.block_size, tokenizer.model_max_length)

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        lm_datasets = tokenized_datasets.map(group_texts, batched=True)
    train_dataset = lm_datasets["train"]
    eval_dataset = lm_datasets["validation"]

    train_dataloader = DataLoader(
        train_dataset,
        shuffle=not args.no_shuffle,
        collate_fn=default_data_collator,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )

    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer_cls = (
        torch.optim.AdamW
        if accelerator.state.deepspeed_plugin is None
        or "optimizer" not in accelerator.state.deepspeed_plugin.deepspeed_config
        else DummyOptim
    )
    optimizer = optimizer_cls(optimizer_grouped_parameters, lr=args.learning_rate)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / accelerator.gradient_accumulation_steps)
    overrode_max_train_steps = False
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    if (
        accelerator.state.deepspeed_plugin is None
        or "scheduler" not in accelerator.state.deepspeed_plugin.deepspeed_config
    ):
        lr_scheduler = get_scheduler(
            name=args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=args.num_warmup_steps,
            num_training_steps=args.max_train_steps,
        )
    else:
        lr_scheduler = DummyScheduler(
            optimizer, total_num_steps=args.max_train_steps, warmup_num_steps=args.num_warmup_steps
        )

    out = os.environ.get("ADABATCH_TEST_OUT")  # test instrumentation (one writer, also under torchrun)
    writer = accelerator.is_main_process and os.environ.get("RANK", "0") == "0"
    if out and writer and not args.resume_from_checkpoint:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out}/initial.pt")
    if args.without_adabatch:  # test instrumentation: the same loop without ds_adabatch
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
    else:
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = prepare(
            accelerator, model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / accelerator.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    completed_steps = 0
    starting_epoch = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        path = os.path.basename(args.resume_from_checkpoint)
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
            completed_steps = starting_epoch * num_update_steps_per_epoch
        else:
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // num_update_steps_per_epoch
            resume_step -= starting_epoch * num_update_steps_per_epoch
            completed_steps = resume_step

    record = {"losses": [], "ledger": [], "sync": [], "eval": []}  # test instrumentation
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

                if accelerator.sync_gradients:
                    completed_steps += 1

            record["losses"].append(loss.item())  # test instrumentation
            record["sync"].append(accelerator.sync_gradients)
            if accelerator.sync_gradients and not args.without_adabatch:
                record["ledger"].append(model.last_step_batch.global_batch.all_indices())

            if isinstance(checkpointing_steps, int):
                if completed_steps % checkpointing_steps == 0:
                    output_dir = f"step_{completed_steps}"
                    if args.output_dir is not None:
                        output_dir = os.path.join(args.output_dir, output_dir)
                    accelerator.save_state(output_dir)
            if completed_steps >= args.max_train_steps:
                break

        if args.no_eval:  # test instrumentation: see tests/test_accelerate.py on two CPU ranks
            continue
        perplexity, eval_loss = evaluate(args, model, eval_dataloader, accelerator, eval_dataset)
        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        record["eval"].append(float(eval_loss))

    if out and writer:  # test instrumentation
        record["completed_steps"] = completed_steps
        record["train_ids"] = [list(ids) for ids in train_dataset["input_ids"]]
        if not args.without_adabatch:
            record["history"] = [
                [c.step, c.new_global_batch, c.new_gradient_accumulation_steps] for c in model.history
            ]
            record["global_samples"] = model.global_samples
        with open(f"{out}/{args.run_name}.json", "w") as f:
            json.dump(record, f)
    if out:
        state = accelerator.get_state_dict(model)
        if writer:
            torch.save(state, f"{out}/{args.run_name}.pt")
    accelerator.end_training()
    if not args.without_adabatch:
        model.close()
        ds_adabatch.finish()


if __name__ == "__main__":
    main()
