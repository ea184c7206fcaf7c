"""``AdaptiveBatchSizeTrainer`` composed with TRL's trainers, against TRL's own trainer: one 2-rank launch.

Usage: torchrun --nproc-per-node 2 tests/trl_worker.py OUT_DIR

For each case (SFT on plain text, SFT with packing, SFT with completion-only loss, DPO) the same tiny
Llama (built from a config, one seed) trains two optimizer steps twice: with TRL's trainer
(``SFTTrainer`` / ``DPOTrainer``) at a constant global batch of the whole dataset (one micro-batch
per rank), and with ``class C(AdaptiveBatchSizeTrainer, SFTTrainer)`` at the same constant global batch
cut into uneven micro-batches of at most 3 samples. Every step trains exactly the dataset's samples in
both runs, so the parameters must agree whatever order each sampler chose: the update is the mean over
the step's target tokens (SFT) or pairs (DPO), exactly. Rank 0 writes ``OUT_DIR/results.json``.
Nothing is downloaded: the tokenizer is a character vocabulary built here (``tiny_tokenizer``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

WORDS = [
    "the",
    "a",
    "of",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "that",
    "this",
    "be",
    "are",
    "or",
    "an",
    "and",
    "not",
]
CHARS = "abcdefghijklmnopqrstuvwxyz .,?!:'"


def tiny_tokenizer(folder: Path | None = None):
    """A character-level fast tokenizer (every ``CHARS`` character one token) with pad/eos/bos tokens."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", *CHARS])}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    if folder is not None:
        tok.save_pretrained(folder)
    return tok


def tiny_llama(vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def datasets_for(case: str):
    from datasets import Dataset

    rng = random.Random(7)
    if case == "dpo":
        rows = [
            {"prompt": sentence(rng, 1, 4), "chosen": sentence(rng, 1, 5), "rejected": sentence(rng, 1, 5)}
            for _ in range(12)
        ]
    elif case == "completion_only":
        rows = [{"prompt": sentence(rng, 1, 5), "completion": sentence(rng, 1, 6)} for _ in range(16)]
    else:  # plain text (and packed: bfd packing into rows of max_length tokens)
        rows = [{"text": sentence(rng, 1, 9)} for _ in range(48 if case == "packing" else 16)]
    return Dataset.from_list(rows)


def config_for(case: str, out: Path, per_device: int, accumulation: int = 1):
    common = dict(
        output_dir=str(out), per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        max_steps=2, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True, average_tokens_across_devices=True, dataloader_drop_last=False,
    )  # fmt: skip
    if case == "dpo":
        from trl import DPOConfig

        return DPOConfig(**common, beta=0.1, max_length=64)
    from trl import SFTConfig

    extra = {"packing": True, "max_length": 32} if case == "packing" else {"max_length": 64}
    if case == "completion_only":
        extra["completion_only_loss"] = True
    return SFTConfig(**common, **extra)


def classes(case: str):
    from trl import DPOTrainer, SFTTrainer

    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    base = DPOTrainer if case == "dpo" else SFTTrainer
    if case != "dpo":

        class ShiftedCount(base):
            # transformers before Trainer._loss_shifts_labels (4.57.6 to 5.9; 5.10 added it) count
            # labels != -100 in Trainer._get_num_items_in_batch before the causal shift (one target per
            # unmasked sequence start too many), so TRL's loss is the token sum over a count that is not
            # its tokens': the reference counts the step's target tokens, as later releases do.
            def _get_num_items_in_batch(self, batch_samples, device):
                if hasattr(self, "_loss_shifts_labels"):  # the release counts after the shift itself
                    return super()._get_num_items_in_batch(batch_samples, device)
                shifted = [{**b, "labels": b["labels"][..., 1:]} for b in batch_samples]
                return super()._get_num_items_in_batch(shifted, device)

        base = ShiftedCount

    class Adaptive(AdaptiveBatchSizeTrainer, SFTTrainer if case != "dpo" else DPOTrainer):  # docs/trainer.md
        pass

    return base, Adaptive


def train(case: str, out: Path, tok, *, per_device: int, accumulation: int = 1, adaptive: int = 0):
    """Two steps of TRL's trainer (``adaptive=0``) or of the composition at a constant global batch of
    ``adaptive`` samples; the parameters after them, flattened, and the logged losses."""
    base, adaptive_cls = classes(case)
    kwargs = dict(
        model=tiny_llama(len(tok)), args=config_for(case, out, per_device, accumulation),
        train_dataset=datasets_for(case), processing_class=tok,
    )  # fmt: skip
    if case == "dpo":  # the reference model: the policy's initial weights (no hub name to load it from)
        kwargs["ref_model"] = tiny_llama(len(tok))
    if adaptive:
        section = {"schedule": {"type": "constant", "value": adaptive}, "max_micro_batch_per_gpu": 3}
        trainer = adaptive_cls(adabatch_config={**section, "allow_uneven": True}, **kwargs)
    else:
        trainer = base(**kwargs)
    trainer.train()
    flat = torch.cat([p.detach().reshape(-1).clone() for p in trainer.model.parameters()])
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return flat, losses


def prepared_size(case: str, out: Path, tok) -> int:
    """Samples in the dataset as TRL prepares it (packing changes the count)."""
    base, _ = classes(case)
    extra = {"ref_model": tiny_llama(len(tok))} if case == "dpo" else {}
    trainer = base(
        model=tiny_llama(len(tok)), args=config_for(case, out, 1), train_dataset=datasets_for(case),
        processing_class=tok, **extra,
    )  # fmt: skip
    return len(trainer.train_dataset)


def main() -> None:
    out = Path(sys.argv[1])
    cases = sys.argv[2:] or ["sft", "packing", "completion_only", "dpo"]
    tok = tiny_tokenizer()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    start = torch.cat([p.detach().reshape(-1) for p in tiny_llama(len(tok)).parameters()])
    results = {}
    for case in cases:
        n = prepared_size(case, out / f"{case}-size", tok)
        if n % (2 * world):
            raise SystemExit(
                f"{case}: {n} prepared samples do not split over 2 x {world} ranks; change the data"
            )
        # TRL's trainer at two splits of the same global batch (how far it is from itself), then ours.
        one, trl_losses = train(case, out / f"{case}-trl", tok, per_device=n // world)
        two, _ = train(case, out / f"{case}-trl-gas2", tok, per_device=n // (2 * world), accumulation=2)
        ours, our_losses = train(case, out / f"{case}-adaptive", tok, per_device=1, adaptive=n)
        update = (one - start).norm()
        results[case] = {
            "samples": n,
            "trl_split_rel_diff": float((two - one).norm() / update),
            "rel_diff": float((ours - one).norm() / update),
            "moved": float(update),
            "trl_losses": trl_losses,
            "our_losses": our_losses,
        }
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
    import ds_adabatch

    ds_adabatch.finish()
