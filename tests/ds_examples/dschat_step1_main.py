# ruff: noqa: B007  (the loops as DeepSpeed-Chat writes them)
"""DeepSpeed-Chat's step-1 supervised fine-tuning ``training/step1_supervised_finetuning/main.py``, as a user
of ds_adabatch runs it: ``ds_adabatch.init_distributed()``, an ``"adabatch"`` section added to the config
``get_train_ds_config`` builds (its two batch keys removed: the plan fills them), ``ds_adabatch.initialize``
with ``training_data=`` / ``collate_fn=`` and the loader it returns in the loop, and the closing calls.

The script's own parts that need a hub model or downloaded data are replaced by local ones: a tiny GPT-2
built from a config (``create_hf_model``), blocks of a standard-library source as the prompt dataset
(``create_prompt_dataset``); ``--dtype fp32`` and torch's AdamW where no GPU has FusedAdam.

    deepspeed --num_gpus 2 tests/ds_examples/dschat_step1_main.py --zero_stage 2 --dtype fp32

ADABATCH_TEST_OUT=<dir> makes rank 0 write the samples of every optimizer step, the plan history and the
parameters into <dir>/dschat.json / .pt.
"""

import argparse
import json
import math
import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

import ds_adabatch

SECTION = {
    "schedule": {"type": "linear", "start": 4, "end": 12, "ramp_samples": 48},
    "max_micro_batch_per_gpu": 3,
    "allow_uneven": True,
}


def parse_args():
    parser = argparse.ArgumentParser(description="Finetune a causal LM (DeepSpeed-Chat step 1)")
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--max_seq_len", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=str, default="constant")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", type=str, default="fp32", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--zero_stage", type=int, default=2)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_train_ds_config(offload, dtype, stage=2):
    device = "cpu" if offload else "none"
    config = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "offload_param": {"device": device},
            "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False,
        },
        "gradient_clipping": 0.0,  # the test compares against an unclipped reference (DS-Chat: 1.0)
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }
    if dtype != "fp32":
        config["fp16" if dtype == "fp16" else "bfloat16"] = {"enabled": True}
    return config


def to_device(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def create_prompt_dataset(block, count):
    with open(os.__file__, "rb") as f:
        data = f.read()
    ids = [list(data[i * block : (i + 1) * block]) for i in range(count)]
    return [{"input_ids": torch.tensor(x), "labels": torch.tensor(x)} for x in ids]


def main():
    args = parse_args()

    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        ds_adabatch.init_distributed()

    args.global_rank = torch.distributed.get_rank()

    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (
        args.per_device_train_batch_size
        * torch.distributed.get_world_size()
        * args.gradient_accumulation_steps
    )
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        del ds_config[key]  # the plan fills them
    ds_config["adabatch"] = SECTION

    torch.manual_seed(args.seed)
    torch.distributed.barrier()

    config = GPT2Config(vocab_size=256, n_positions=args.max_seq_len, n_embd=32, n_layer=2, n_head=4)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}

    train_dataset = create_prompt_dataset(args.max_seq_len, 96)
    eval_dataset = create_prompt_dataset(args.max_seq_len, 16)
    if args.local_rank == -1:
        eval_sampler = SequentialSampler(eval_dataset)
    else:
        eval_sampler = DistributedSampler(eval_dataset)
    eval_dataloader = DataLoader(
        eval_dataset,
        collate_fn=default_data_collator,
        sampler=eval_sampler,
        batch_size=args.per_device_eval_batch_size,
    )

    def evaluation(model, eval_dataloader):
        model.eval()
        losses = 0
        for step, batch in enumerate(eval_dataloader):
            batch = to_device(batch, device)
            with torch.no_grad():
                outputs = model(**batch)
            losses += outputs.loss.float()
        losses = losses / (step + 1)
        return torch.exp(losses).item(), losses.item()

    optimizer_grouped_parameters = [{"params": list(model.parameters()), "weight_decay": args.weight_decay}]
    AdamOptimizer = torch.optim.AdamW  # DS-Chat: DeepSpeedCPUAdam if args.offload else FusedAdam (GPU)
    optimizer = AdamOptimizer(optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95))

    num_update_steps_per_epoch = math.ceil(len(train_dataset) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.num_train_epochs * num_update_steps_per_epoch,
    )

    model, optimizer, train_dataloader, lr_scheduler = ds_adabatch.initialize(
        model=model,
        optimizer=optimizer,
        args=args,
        config=ds_config,
        lr_scheduler=lr_scheduler,
        dist_init_required=True,
        training_data=train_dataset,
        collate_fn=default_data_collator,
    )

    ledger = []  # test instrumentation: the samples of every optimizer step
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            model.backward(loss)
            model.step()
            if model.last_step_batch is not None and model.loop.in_progress is None:  # test instrumentation
                ledger.append(model.last_step_batch.global_batch.all_indices())
        perplexity, eval_loss = evaluation(model, eval_dataloader)
        print(f"epoch {epoch}: ppl: {perplexity}, loss: {eval_loss}, steps {model.global_steps}", flush=True)
        model.tput_timer.update_epoch_count()

    out = os.environ.get("ADABATCH_TEST_OUT")
    if out and args.global_rank == 0:
        params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save({"initial": initial, "final": params}, os.path.join(out, "dschat.pt"))
        record = {
            "ledger": ledger,
            "train_ids": [s["input_ids"].tolist() for s in train_dataset],
            "history": [
                [c.step, c.new_global_batch, c.new_gradient_accumulation_steps] for c in model.history
            ],
            "betas": [0.9, 0.95],
        }
        with open(os.path.join(out, "dschat.json"), "w") as f:
            json.dump(record, f)
    model.close()
    ds_adabatch.finish()


if __name__ == "__main__":
    main()
