"""DeepSpeed's getting-started tutorial (DeepSpeedExamples training/cifar/cifar10_deepspeed.py), as a
user of ds_adabatch runs it: the module name swapped, an "adabatch" section in the config, and the
closing calls. Data: CIFAR-shaped random images (nothing can be downloaded here).

    deepspeed --num_gpus 2 tests/ds_examples/cifar10_deepspeed.py --stage 2 --dtype fp32 --epochs 2

ADABATCH_TEST_OUT=<dir> makes rank 0 write what the tests check (final parameters, the samples of every
optimizer step, the plan history) into <dir>/cifar_<stage>.json.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

import ds_adabatch


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local rank passed from distributed launcher"
    )
    parser.add_argument(
        "--log-interval", type=int, default=8, help="output logging information at a given interval"
    )
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--samples", default=160, type=int, help="size of the synthetic training set")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SyntheticCIFAR(torch.utils.data.Dataset):
    """CIFAR-10 shaped: 3x32x32 float images and labels 0..9, the same on every rank."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def get_ds_config(args):
    """The tutorial's config, plus the "adabatch" section: a global batch ramping 16 -> 48."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "loss_scale": 0, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "adabatch": {
            "schedule": {"type": "linear", "start": 16, "end": 48, "ramp_samples": 160},
            "max_micro_batch_per_gpu": 8,
            "granularity": 8,
        },
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def main(args):
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset = SyntheticCIFAR(args.samples)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = ds_adabatch.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=ds_config,
    )

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    ledger = []  # test instrumentation: the samples of every optimizer step

    for epoch in range(args.epochs):  # loop over the dataset multiple times
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)

            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)

            model_engine.backward(loss)
            steps = model_engine.global_steps
            model_engine.step()
            if model_engine.global_steps > steps:
                ledger.append(model_engine.last_step_batch.global_batch.all_indices())

            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1:d}, {i + 1:5d}] loss: {running_loss / args.log_interval:.3f}")
                running_loss = 0.0
    print("Finished Training")

    out = os.environ.get("ADABATCH_TEST_OUT")
    if out:
        from deepspeed.utils import safe_get_full_fp32_param

        # Gathering a ZeRO partition is a collective: every rank takes part, rank 0 writes.
        params = [
            (safe_get_full_fp32_param(p) if args.stage else p.detach()).float().flatten().tolist()
            for p in model_engine.module.parameters()
        ]
    if out and model_engine.global_rank == 0:
        record = {
            "params": params,
            "ledger": ledger,
            "history": [e.to_dict() for e in model_engine.history],
            "global_samples": model_engine.global_samples,
            "global_steps": model_engine.global_steps,
            "epochs": args.epochs,
            "local_rank_arg": args.local_rank,
        }
        with open(os.path.join(out, f"cifar_{args.stage}.json"), "w") as f:
            json.dump(record, f)
    model_engine.close()
    ds_adabatch.finish()


if __name__ == "__main__":
    args = add_argument()
    main(args)
