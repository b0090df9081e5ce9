#!/usr/bin/env python3
"""Export a GGUF model's SentencePiece ("llama") vocabulary as a Hugging Face tokenizer.

Writes OUT_DIR/tokenizer.json and OUT_DIR/tokenizer_config.json, so that `gorgo node`
(`engine.tokenizer`) and `gorgo engine --tokenizer` count the prompt tokens llama.cpp
counts for the same model.

    python scripts/gguf_tokenizer.py MODEL.gguf OUT_DIR [--chat-template FILE]

What llama.cpp's SPM tokenizer does (llama-vocab.cpp, `llm_tokenizer_spm`): a space is
put before the text (add_space_prefix) and spaces become U+2581 "▁"; the text is split
into UTF-8 characters; the adjacent pair whose concatenation is in the vocabulary with
the highest score is merged, again and again; a final piece not in the vocabulary is
emitted as its bytes (`<0xXX>` tokens, byte fallback); BOS is added when the model's
`add_bos_token` says so. Control tokens (`<s>`, ...) written in the text are parsed as
such.

The Hugging Face equivalent is a BPE model with `byte_fallback`, whose merges are every
split of a vocabulary piece into two vocabulary pieces, ranked by the piece's score
(highest first), behind a `Prepend("▁")` + `Replace(" ", "▁")` normalizer. One catch: HF
BPE falls back to bytes *before* merging, per character, while llama.cpp merges
characters that are not tokens themselves and falls back only for what is left. In
vocabularies where "▁" alone is not a token (tiny_gguf.py's), "▁" + "t" -> "▁t" would
never merge in HF. So a "▁" that can start a merge (it is followed by a character c with
"▁c" in the vocabulary) is rewritten by the normalizer to a private-use character
(U+E000) that *is* in the HF vocabulary (an extra id, never emitted: it always merges)
and that the pieces starting with "▁c" use instead; any other "▁" stays, is not in the
vocabulary, and falls back to its three bytes as in llama.cpp. The script checks the
assumption this needs (no multi-character piece without a leading "▁", so nothing can
take the c away from the "▁" first) and refuses vocabularies that break it.

The chat template in tokenizer_config.json is the GGUF's `tokenizer.chat_template`, or
FILE when given (e.g. the template a server really applies; see docs/node.md, "Tokens").
"""
import argparse
import json
import os
import re
import sys

import gguf

SPACE = "\u2581"
MERGE_SPACE = "\ue000"


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("out_dir")
    ap.add_argument("--chat-template", help="chat template file to write instead of the GGUF's")
    a = ap.parse_args()
    r = gguf.GGUFReader(a.model)
    kind = field(r, "tokenizer.ggml.model")
    if kind != "llama":
        sys.exit(f"gguf_tokenizer: tokenizer model `{kind}` is not SentencePiece (`llama`)")
    tokens = field(r, "tokenizer.ggml.tokens")
    scores = field(r, "tokenizer.ggml.scores")
    types = field(r, "tokenizer.ggml.token_type")
    bos = tokens[field(r, "tokenizer.ggml.bos_token_id", 1)]
    eos = tokens[field(r, "tokenizer.ggml.eos_token_id", 2)]
    unk = tokens[field(r, "tokenizer.ggml.unknown_token_id", 0)]
    add_bos = bool(field(r, "tokenizer.ggml.add_bos_token", True))
    add_eos = bool(field(r, "tokenizer.ggml.add_eos_token", False))
    if not bool(field(r, "tokenizer.ggml.add_space_prefix", True)):
        sys.exit("gguf_tokenizer: add_space_prefix = false is not supported")
    template = field(r, "tokenizer.chat_template")
    if a.chat_template:
        template = open(a.chat_template, encoding="utf-8").read()

    # Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
    normal = {t for t, ty in zip(tokens, types) if ty == 1}
    if SPACE in normal:
        sys.exit("gguf_tokenizer: this vocabulary has a lone `▁` token; the rewrite is not needed and not supported")
    for t in normal:
        if len(t) > 1 and not t.startswith(SPACE):
            sys.exit(f"gguf_tokenizer: piece {t!r} has no leading `▁`; merges could compete (unsupported)")
    followers = sorted({t[1] for t in normal if t.startswith(SPACE) and len(t) == 2})
    for t in normal:
        if t.startswith(SPACE) and len(t) > 1 and t[1] not in followers:
            sys.exit(f"gguf_tokenizer: piece {t!r} cannot be reached by merges")

    def hf_piece(t):
        return MERGE_SPACE + t[1:] if t.startswith(SPACE) and len(t) > 1 else t

    vocab = {}
    for i, t in enumerate(tokens):
        vocab[hf_piece(t)] = i
    vocab[MERGE_SPACE] = len(tokens)  # the merge-only "▁": never emitted

    # Merges: every split of a piece into two pieces of the vocabulary, best score first.
    merges = []
    for i, t in enumerate(tokens):
        if types[i] != 1:
            continue
        p = hf_piece(t)
        for k in range(1, len(p)):
            left, right = p[:k], p[k:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], i, k, left, right))
    merges.sort()
    merges = [[left, right] for *_, left, right in merges]

    special = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in enumerate(tokens) if types[i] in (2, 3)
    ]
    follower_class = "".join(re.escape(c) for c in followers)
    seq_a = [{"Sequence": {"id": "A", "type_id": 0}}]
    seq_b = [{"Sequence": {"id": "B", "type_id": 1}}]
    bos_t = [{"SpecialToken": {"id": bos, "type_id": 0}}] if add_bos else []
    eos_t = [{"SpecialToken": {"id": eos, "type_id": 0}}] if add_eos else []
    special_tokens = {}
    for t in ([bos] if add_bos else []) + ([eos] if add_eos else []):
        special_tokens[t] = {"id": t, "ids": [tokens.index(t)], "tokens": [t]}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPACE},
            {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
            {"type": "Replace", "pattern": {"Regex": f"{SPACE}(?=[{follower_class}])"}, "content": MERGE_SPACE},
        ]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": bos_t + seq_a + eos_t,
            "pair": bos_t + seq_a + eos_t + bos_t + seq_b + eos_t,
            "special_tokens": special_tokens,
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": MERGE_SPACE}, "content": " "},
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
            "ignore_merges": False, "vocab": vocab, "merges": merges,
        },
    }
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": int(field(r, "llama.context_length", 4096)),
    }
    if template is not None:
        config["chat_template"] = template
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(a.out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    print(f"wrote {a.out_dir}/tokenizer.json: vocab {len(tokens)} (+1 merge-only), "
          f"{len(merges)} merges, add_bos {add_bos}; tokenizer_config.json"
          f"{' with a chat template' if template is not None else ''}")


if __name__ == "__main__":
    main()
