"""The main job's model and data: a byte-level GPT-2-style language model on local text files.

Shared by ``runners/train_lm.py`` and the benchmarks so every measurement trains the same thing.
Nothing is downloaded: the model is built from a config and the default corpus is the running
Python's standard-library sources, which every machine has.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ByteCorpus", "ByteWindows", "ModelSpec", "build_model", "stdlib_sources", "validation_loss"]

CHUNK = 64 * 1024  # bytes; every VALIDATION_EVERY-th chunk is held out
VALIDATION_EVERY = 50


def stdlib_sources() -> list[str]:
    """The standard library's ``.py`` files (site-packages excluded), sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found)


class ByteCorpus:
    """Files concatenated as bytes, split into training and held-out validation bytes.

    The corpus is cut into 64 KiB chunks; every 50th chunk goes to validation, the rest to training.
    """

    def __init__(self, paths: Iterable[str] | None = None, *, max_bytes: int | None = None) -> None:
        paths = list(paths) if paths is not None else stdlib_sources()
        if not paths:
            raise ValueError("no text files to train on")
        parts, total = [], 0
        for path in paths:
            with open(path, "rb") as f:
                data = f.read()
            parts.append(data)
            total += len(data)
            if max_bytes is not None and total >= max_bytes:
                break
        raw = np.frombuffer(b"".join(parts)[:max_bytes], dtype=np.uint8)
        n_chunks = -(-len(raw) // CHUNK)
        held = np.zeros(len(raw), dtype=bool)
        for c in range(VALIDATION_EVERY - 1, n_chunks, VALIDATION_EVERY):
            held[c * CHUNK : (c + 1) * CHUNK] = True
        self.train = raw[~held]
        self.validation = raw[held]
        self.num_files = len(parts)


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``context`` bytes: ``{"input_ids": w, "labels": w}``.

    Labels equal inputs; the model shifts them by one (next-byte prediction).
    """

    def __init__(self, data: np.ndarray, context: int, *, limit: int | None = None) -> None:
        self.data = data
        self.context = context
        n = (len(data) - 1) // context
        self.n = n if limit is None else min(n, limit)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.context
        w = torch.from_numpy(self.data[start : start + self.context].astype(np.int64))
        return {"input_ids": w, "labels": w}


@dataclass(frozen=True)
class ModelSpec:
    """GPT-2-style model dimensions (defaults: about 0.44 M parameters)."""

    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64
    dropout: float = 0.0


def build_model(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised byte-level GPT-2 (vocabulary 256), identical for the same seed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256,
        n_positions=spec.context,
        n_embd=spec.width,
        n_layer=spec.layers,
        n_head=spec.heads,
        resid_pdrop=spec.dropout,
        embd_pdrop=spec.dropout,
        attn_pdrop=spec.dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module, windows: ByteWindows, *, count: int = 128, batch: int = 64
) -> float:
    """Mean next-byte loss over ``count`` fixed validation windows, spread evenly over the held-out set.

    Evenly spaced windows sample every held-out chunk (many files), not one stretch of one file.
    """
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    count = min(count, len(windows))
    stride = len(windows) // count
    idx = [i * stride for i in range(count)]
    for s in range(0, len(idx), batch):
        items = [windows[i] for i in idx[s : s + batch]]
        ids = torch.stack([it["input_ids"] for it in items])
        out = model(input_ids=ids, labels=ids)
        total += float(out.loss) * len(items)
        n += len(items)
    model.train(was_training)
    return total / max(n, 1)
