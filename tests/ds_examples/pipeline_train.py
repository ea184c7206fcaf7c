#!/usr/bin/env python3
"""DeepSpeed's pipeline example (DeepSpeedExamples training/pipeline_parallelism/train.py) as a user of
ds_adabatch runs it: the module name swapped, an "adabatch" section in the --deepspeed_config file, and
the closing calls. The model is a small AlexNet-shaped net on CIFAR-shaped random images (nothing can be
downloaded here; AlexNet's 224x224 inputs are too slow on a CPU).

    deepspeed --num_gpus 2 tests/ds_examples/pipeline_train.py --deepspeed_config ds_config.json -p 2 --steps 6

``-p 0`` runs the example's data-parallel branch: DeepSpeed's RepeatingLoader over the returned loader,
and engine(x) / backward / step. ADABATCH_TEST_OUT=<dir> makes every rank write what the tests check
(its parameters by layer, the samples of every optimizer step, the plan history) into
<dir>/pipe_rank<r>.json.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader

import ds_adabatch


class SyntheticCIFAR(torch.utils.data.Dataset):
    def __init__(self, n=192, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


class SmallAlexNet(torch.nn.Module):
    """AlexNet's layout (features, avgpool, classifier) at CIFAR scale."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1),
            torch.nn.ReLU(inplace=True),
            torch.nn.MaxPool2d(kernel_size=2),
            torch.nn.Conv2d(8, 16, kernel_size=3, padding=1),
            torch.nn.ReLU(inplace=True),
        )
        self.avgpool = torch.nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = torch.nn.Sequential(
            torch.nn.Linear(16 * 2 * 2, 32),
            torch.nn.ReLU(inplace=True),
            torch.nn.Linear(32, num_classes),
        )

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def cifar_trainset(local_rank):
    dist.barrier()
    return SyntheticCIFAR()


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local rank passed from distributed launcher"
    )
    parser.add_argument("-s", "--steps", type=int, default=100, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument(
        "--loss-at-initialize",
        action="store_true",
        help="(tests) build the PipelineModule without loss_fn and give the loss to initialize(loss_fn=...)",
    )
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train_base(args):
    torch.manual_seed(args.seed)
    net = SmallAlexNet(num_classes=10)
    trainset = cifar_trainset(args.local_rank)

    engine, _, dataloader, __ = ds_adabatch.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset,
    )

    dataloader = RepeatingLoader(dataloader)
    data_iter = iter(dataloader)

    rank = dist.get_rank()
    criterion = torch.nn.CrossEntropyLoss()

    ledger = []
    while engine.global_steps < args.steps:  # GAS changes with the plan: count optimizer steps
        batch = next(data_iter)
        inputs = batch[0].to(engine.device)
        labels = batch[1].to(engine.device)

        outputs = engine(inputs)
        loss = criterion(outputs, labels)
        engine.backward(loss)
        steps = engine.global_steps
        engine.step()

        if engine.global_steps > steps:
            ledger.append(engine.last_step_batch.global_batch.all_indices())
            if rank == 0 and (engine.global_steps % 10 == 0):
                print(f"step: {engine.global_steps:3d} / {args.steps:3d} loss: {loss}")
    return engine, ledger


def join_layers(vision_model):
    layers = [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]
    return layers


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)

    net = SmallAlexNet(num_classes=10)
    net = PipelineModule(
        layers=join_layers(net),
        loss_fn=None if args.loss_at_initialize else torch.nn.CrossEntropyLoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method=part,
        activation_checkpoint_interval=0,
    )

    trainset = cifar_trainset(args.local_rank)

    engine, _, _, _ = ds_adabatch.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset,
        **({"loss_fn": torch.nn.CrossEntropyLoss()} if args.loss_at_initialize else {}),
    )

    ledger = []
    for step in range(args.steps):  # noqa: B007 (as in the example)
        loss = engine.train_batch()  # noqa: F841 (as in the example)
        ledger.append(engine.last_step_batch.global_batch.all_indices())
    return engine, ledger


if __name__ == "__main__":
    args = get_args()

    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])

    if args.pipeline_parallel_size == 0:
        engine, ledger = train_base(args)
    else:
        engine, ledger = train_pipe(args)

    out = os.environ.get("ADABATCH_TEST_OUT")
    if out:
        from deepspeed.utils import safe_get_full_fp32_param

        zero = engine.zero_optimization_stage()
        params = {
            name: (safe_get_full_fp32_param(p) if zero > 1 else p.detach()).float().flatten().tolist()
            for name, p in engine.module.named_parameters()
        }
        record = {
            "params": params,
            "ledger": ledger,
            "history": [e.to_dict() for e in engine.history],
            "global_samples": engine.global_samples,
            "world_size": engine.world_size,
        }
        with open(os.path.join(out, f"pipe_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(record, f)
    engine.close()
    ds_adabatch.finish()
