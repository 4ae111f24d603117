#!/usr/bin/env python3
"""Offline assets for TorchTitan's llama3 debug model: a small BPE tokenizer (vocabulary under
the model's 2048) trained on the project's corpus, and that corpus as the `c4_test` dataset, laid
out where TorchTitan's defaults look for them (relative to the working directory):

    DIR/tests/assets/tokenizer/{tokenizer.json, tokenizer_config.json}
    DIR/tests/assets/c4_test/data.json            # {"text": ...} per line

    python tools/titan_assets.py DIR
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


if __name__ == "__main__":
    make(sys.argv[1])
