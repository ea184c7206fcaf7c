"""Local inputs for accelerate's example: a tiny GPT-2 config, a character tokenizer, a text file.

Nothing is downloaded: the config and the tokenizer are written to a folder that ``--config_name`` and
``--tokenizer_name`` read with ``from_pretrained``, and the text is a standard-library source.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_inputs(folder: Path, lines: int = 120) -> dict[str, str]:
    """Write ``tiny_gpt2/`` (config + tokenizer) and ``text.txt`` under ``folder``; their paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    with open(os.__file__, encoding="utf-8") as f:
        text = [line for line in f.read().splitlines() if line.strip()][:lines]
    chars = sorted({c for line in text for c in line + "\n"})
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    model_dir = folder / "tiny_gpt2"
    # GPT-2's own tokenizer returns no token_type_ids; transformers 4.x's fast tokenizer would by default,
    # and GPT-2 adds the embedding of those zeros to every position (5.x's tokenizer returns none).
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        model_max_length=64,
        model_input_names=["input_ids", "attention_mask"],
    ).save_pretrained(model_dir)
    GPT2Config(
        vocab_size=len(vocab),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,  # no dropout: exact comparisons
    ).save_pretrained(model_dir)
    (folder / "text.txt").write_text("\n".join(text) + "\n", encoding="utf-8")
    return {"model": str(model_dir), "text": str(folder / "text.txt")}


def ds_config(folder: Path, name: str, section: dict | None, stage: int = 2) -> str:
    """A DeepSpeed config file as accelerate's examples use it ("auto" batch keys), with ``section``."""
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 0.0,
        # ZeRO 3: accelerator.get_state_dict gathers the full parameters only with this key.
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3},
        "steps_per_print": 10**6,
    }
    if section is not None:
        config["adabatch"] = section
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)
