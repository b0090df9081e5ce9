#!/usr/bin/env python3
"""Train the offline tokenizer scripts/guidellm.sh gives GuideLLM.

GuideLLM needs a Hugging Face tokenizer to size its prompts (`--tokenizer`), and the
machines this runs on reach package registries, not the Hugging Face hub. So this
trains a byte-level BPE (the GPT-2 scheme) with the `tokenizers` package, which
GuideLLM installs, on English text from `faker`, which GuideLLM also installs and
draws its own prompts from. English text then comes to about 4 bytes per token, the
ratio the engine emulator and the nodes count, so a replay's prompt sizes mean the
same to GuideLLM, the emulator and `gorgo bench`: the vocabulary size is searched
(bisection) until faker text comes to `--bytes-per-token` (4) within 3%.
Deterministic (fixed seed).

Usage: guidellm_tokenizer.py OUT_DIR [--bytes-per-token 4] [--seed 0]
Writes OUT_DIR/tokenizer.json and OUT_DIR/tokenizer_config.json.
"""
import argparse
import json
import os

from faker import Faker
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def train(corpus, vocab):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def bytes_per_token(tok, text):
    return len(text.encode()) / len(tok.encode(text).ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bytes-per-token", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sentences", type=int, default=30000)
    a = ap.parse_args()
    fake = Faker("en_US")
    Faker.seed(a.seed)
    corpus = [fake.sentence(nb_words=16) for _ in range(a.sentences)]
    text = " ".join(corpus[:2000])
    lo, hi = 300, 8192
    while True:
        vocab = (lo + hi) // 2
        tok = train(corpus, vocab)
        got = bytes_per_token(tok, text)
        if abs(got / a.bytes_per_token - 1) <= 0.03 or hi - lo <= 8:
            break
        lo, hi = (vocab, hi) if got < a.bytes_per_token else (lo, vocab)
    os.makedirs(a.out, exist_ok=True)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "model_max_length": 1 << 20,
        }, f, indent=2)
    print(f"wrote {a.out}: vocab {tok.get_vocab_size()}, {got:.2f} bytes per token on faker text")


if __name__ == "__main__":
    main()
