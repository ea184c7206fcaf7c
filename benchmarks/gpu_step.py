"""On one CUDA GPU: ``train_batch`` against a hand-written DeepSpeed loop, host synchronisations, fp16.

    python benchmarks/gpu_step.py                 # all three parts, one process, world 1

1. **Overhead**: a ~100 M-parameter GPT-2 (12 layers x 768, vocabulary 16,384, context 512) in bf16,
   ZeRO-2, global 32 = micro 8 x GAS 4, interleaved rounds of the two loops; medians and their ratio.
2. **Host synchronisations**: ``torch.cuda.set_sync_debug_mode("warn")`` during steady steps of each loop;
   every synchronisation is attributed to the innermost frame of ds_adabatch, DeepSpeed or torch that
   caused it, so a sync of ours shows with its line. Then the steady ``train_batch`` runs under
   ``"error"`` when the hand-written loop itself has none.
3. **fp16**: the regression sequence of the exactness suite (growing, GAS 1 -> 4 -> 3, uneven) under
   fp16 with DeepSpeed's dynamic loss scaler, ZeRO 0 and 2, against a float64 big-batch reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ds_adabatch  # noqa: E402
from ds_adabatch.runtime.noise.probe import loss_scale  # noqa: E402

MICRO, GAS, SEQ, VOCAB = 8, 4, 512, 16384


def gpt2(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=768, n_layer=12, n_head=12)
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 4096, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(extra: dict | None = None) -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        **(extra or {}),
    }


def loops(data, plain_first: bool = False):
    import deepspeed

    def build_ours():
        ada, *_ = ds_adabatch.initialize(
            gpt2(),
            {
                **ds_config(),
                "adabatch": {
                    "schedule": {"type": "constant", "value": MICRO * GAS},
                    "max_micro_batch_per_gpu": MICRO,
                },
            },
            data,
        )
        return ada

    def build_plain():
        model = gpt2()
        cfg = ds_config(
            {
                "train_batch_size": MICRO * GAS,
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": GAS,
            }
        )
        plain, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return plain

    if plain_first:  # which engine is built first decides where its memory lies
        plain = build_plain()
        ada = build_ours()
    else:
        ada = build_ours()
        plain = build_plain()
    device = plain.device

    def epochs():
        while True:
            yield from torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=True, drop_last=True)

    loader = epochs()

    def plain_step():
        for _ in range(GAS):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(loader).items()}
            plain.backward(plain(**batch).loss)
            plain.step()

    return ada, plain, plain_step


def timed(step, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def syncs(step, n: int) -> Counter:
    """Host synchronisations of ``n`` calls, by the innermost frame of ours, DeepSpeed's or torch's."""
    where: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        # The innermost frame of a library (or of this script) is where the synchronisation happened.
        for f in reversed(traceback.extract_stack()[:-1]):
            for key in ("ds_adabatch", "deepspeed", "transformers", "benchmarks"):
                if f"/{key}/" in f.filename:
                    where[f"{key}: {os.path.basename(f.filename)}:{f.lineno} {f.name}"] += 1
                    return
        where["other"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old = warnings.showwarning
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(n):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    return where


def part_overhead_and_syncs(args) -> None:
    data = Tokens()
    ada, plain, plain_step = loops(data, plain_first=args.plain_first)
    print(f"built first: {'hand-written' if args.plain_first else 'train_batch'} engine")
    params = sum(p.numel() for p in plain.module.parameters())
    for s in (ada.train_batch, plain_step):
        timed(s, 3)
    print(
        f"\n## overhead: GPT-2 {params / 1e6:.1f} M parameters, bf16, ZeRO-2, micro {MICRO} x GAS {GAS}, seq {SEQ}"
    )
    print(f"{args.repeats} repetitions of {args.rounds} rounds x {args.steps} steps per loop, alternating")
    for rep in range(args.repeats):
        t_ada, t_plain = [], []
        for r in range(args.rounds):
            pair = [(ada.train_batch, t_ada), (plain_step, t_plain)]
            for step, sink in pair if r % 2 == 0 else reversed(pair):
                sink.append(timed(step, args.steps))
        m_ada, m_plain = statistics.median(t_ada), statistics.median(t_plain)
        print(
            f"repetition {rep + 1}: hand-written {m_plain * 1e3:.2f} ms, train_batch {m_ada * 1e3:.2f} ms, "
            f"ratio {m_ada / m_plain:.4f} (of the fastest rounds: {min(t_ada) / min(t_plain):.4f})"
        )

    every = ada.config.log.every_steps
    # Steady steps only: stop short of the step that resolves the pending losses.
    while (ada.global_steps + 1) % every == 0:
        ada.train_batch()
    n = every - 1 - ada.global_steps % every
    print(f"\n## host synchronisations in {n} steady steps of each loop")
    print("hand-written:", dict(syncs(plain_step, n)) or "none")
    print("train_batch: ", dict(syncs(ada.train_batch, n)) or "none")
    while ada.global_steps % every:
        ada.train_batch()
    n = every - 1
    # DeepSpeed's own ZeRO-2 step synchronises (overflow and norm checks, in the hand-written loop too):
    # "error" everywhere except inside DeepSpeed's step().
    ds_step = ada.deepspeed.step

    def step_without_debug(*a, **k):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return ds_step(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    ada.deepspeed.step = step_without_debug
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(n):
            ada.train_batch()
        print(
            f'train_batch under set_sync_debug_mode("error") outside DeepSpeed\'s step(): {n} steady steps, '
            "no synchronisation"
        )
    except RuntimeError as err:
        print(f'train_batch under set_sync_debug_mode("error") raised: {err}')
        traceback.print_exc()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        ada.deepspeed.step = ds_step
    ada.close()


def part_profile(args) -> None:
    """Where each loop's host time goes (cProfile over the same number of steady steps)."""
    import cProfile
    import pstats

    ada, plain, plain_step = loops(Tokens())
    for s in (ada.train_batch, plain_step):
        timed(s, 3)
    for name, step in (("hand-written", plain_step), ("train_batch", ada.train_batch)):
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        prof.disable()
        print(f"\n## cProfile, 20 steps, {name}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        pstats.Stats(prof).sort_stats("cumulative").print_stats("ds_adabatch|dataloader|collate|gpu_step", 30)
    ada.close()


def part_fp16() -> None:
    class Regression(torch.utils.data.Dataset):
        def __init__(self, n: int = 96):
            g = torch.Generator().manual_seed(7)
            self.x, self.y = torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def mse(engine, batch):
        x, y = batch
        return ((engine(x.half()).float() - y) ** 2).mean()

    data = Regression()

    def reference(batches):
        ref = make().double()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for idx in batches:
            opt.zero_grad()
            ((ref(data.x[idx].double()) - data.y[idx].double()) ** 2).mean().backward()
            opt.step()
        return torch.cat([p.flatten() for p in ref.parameters()]).float()

    def error(module, batches) -> float:
        got = torch.cat([p.detach().float().flatten() for p in module.parameters()])
        want = reference(batches).to(got.device)
        return ((got - want).abs().max() / want.abs().max()).item()

    def config(stage: int) -> dict:
        return {
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            # Dynamic scaling from 2^8: high enough to matter, low enough that no step of this small
            # model overflows (a skipped step would rightly differ from the reference).
            "fp16": {"enabled": True, "initial_scale_power": 8},
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }

    print("\n## fp16 exactness (dynamic loss scale), world 1, against a float64 big-batch reference")
    import deepspeed

    for stage in (0, 2):
        # DeepSpeed alone, fixed GAS 2 over consecutive samples: what its own fp16 path gives.
        cfg = {**config(stage), "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}
        model = make()
        plain, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        batches = []
        for k in range(4):
            for j in range(2):
                idx = list(range(8 * k + 4 * j, 8 * k + 4 * j + 4))
                plain.backward(mse(plain, (data.x[idx].to(plain.device), data.y[idx].to(plain.device))))
                plain.step()
            batches.append(list(range(8 * k, 8 * k + 8)))
        print(f"ZeRO-{stage} fp16, DeepSpeed alone (GAS 2): max rel err {error(plain.module, batches):.2e}")
        for name, sequence in (("constant 8", [8, 8, 8, 8]), ("changing", [8, 32, 24, 13, 6])):
            section = {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4}
            engine, *_ = ds_adabatch.initialize(
                make(), {**config(stage), "adabatch": {**section, "allow_uneven": True}}, data, loss_fn=mse
            )
            batches = []
            for b in sequence:
                engine.set_global_batch_size(b)
                float(engine.train_batch())
                batches.append(engine.last_step_batch.global_batch.all_indices())
            print(
                f"ZeRO-{stage} fp16, train_batch {name} {sequence}: max rel err "
                f"{error(engine.module, batches):.2e}, loss scale {loss_scale(engine.deepspeed):g}, "
                f"skipped steps {engine.deepspeed.skipped_steps}"
            )
            engine.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plain-first", action="store_true", help="build the hand-written loop's engine first")
    p.add_argument("--parts", default="overhead,fp16")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    if "overhead" in args.parts:
        part_overhead_and_syncs(args)
    if "profile" in args.parts:
        part_profile(args)
    if "fp16" in args.parts:
        part_fp16()


if __name__ == "__main__":
    main()
    ds_adabatch.finish()
