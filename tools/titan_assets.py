#!/usr/bin/env python3
"""Offline assets for TorchTitan's llama3 debug model: a small BPE tokenizer (vocabulary under
the model's 2048) trained on the project's corpus, and that corpus as the `c4_test` dataset, laid
out where TorchTitan's defaults look for them (relative to the working directory):

    DIR/tests/assets/tokenizer/{tokenizer.json, tokenizer_config.json}
    DIR/tests/assets/c4_test/data.json            # {"text": ...} per line

    python tools/titan_assets.py DIR [--parity STEPS]

--parity STEPS writes a c4_test laid out so that one rank with batch 4 and two data-parallel
ranks with batch 2 each train on the same sequences at every step (TorchTitan gives each
data-parallel rank a contiguous half of the file): every document is exactly one 64-token
sample, and the file's first half is built so that step k of the one-rank run reads the
documents ranks 0 and 1 read at step k. The FSDP=2 and TP=2 losses must then equal the
one-rank losses, which is what tests/python/test_torchtitan.py checks.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make(root: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from torch_tpu.data import load_corpus

    text = load_corpus()
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]
    data_dir = os.path.join(root, "tests", "assets", "c4_test")
    tok_dir = os.path.join(root, "tests", "assets", "tokenizer")
    os.makedirs(data_dir, exist_ok=True)
    os.makedirs(tok_dir, exist_ok=True)
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for p in paragraphs:
            f.write(json.dumps({"text": p}) + "\n")

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(paragraphs, trainer)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
                   "add_eos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    print(f"titan_assets: {len(paragraphs)} paragraphs, vocabulary {tok.get_vocab_size()} in {root}")
    return tok


SEQ_LEN = 64  # tokens per sample; a document is BOS + 63 words + EOS = SEQ_LEN + 1


def parity_data(root: str, tok, steps: int) -> None:
    """Replaces c4_test with documents of one sample each, ordered as the module doc says."""
    import random

    words = sorted(t[1:] for t in tok.get_vocab() if t.startswith("\u0120") and t[1:].isalpha() and len(t) > 3)
    words = [w for w in words if len(tok.encode(" " + w).ids) == 1]
    rng = random.Random(0)

    def doc():
        text = "".join(" " + rng.choice(words) for _ in range(SEQ_LEN - 1))
        assert len(tok.encode(text).ids) == SEQ_LEN - 1, text
        return text

    theirs = [doc() for _ in range(4 * steps)]  # rank 1's half: it reads the first 2 * steps
    mine = [doc(), doc()]  # rank 0's half; one rank reads its first 4 * steps
    for k in range(steps):
        mine[4 * k:4 * k + 4] = [mine[2 * k], mine[2 * k + 1], theirs[2 * k], theirs[2 * k + 1]]
    with open(os.path.join(root, "tests", "assets", "c4_test", "data.json"), "w") as f:
        for text in mine + theirs:
            f.write(json.dumps({"text": text}) + "\n")


if __name__ == "__main__":
    tokenizer = make(sys.argv[1])
    if "--parity" in sys.argv:
        parity_data(sys.argv[1], tokenizer, int(sys.argv[sys.argv.index("--parity") + 1]))
