#!/usr/bin/env python3
"""Hugging Face tokenizer.json for xmoe (data/hf_tokenizer.cpp runs this helper).

Usage: xmoe_tokenizer.py TOKENIZER_JSON
Prints one JSON line (vocab_size, eos_id, bos_id), then answers requests on stdin/stdout until
stdin closes, all integers little-endian:
  b"E" u32 count, then count times (u64 length, UTF-8 bytes) -> count times (u64 n, n u32 ids)
  b"D" u64 n, n u32 ids -> u64 length, UTF-8 bytes
Exit status 3: python3 has no `tokenizers` package; 2: the file is not a tokenizer.json.
"""
import json
import os
import struct
import sys

# End-of-document tokens of common models, tried in order when no tokenizer_config.json beside
# the file names one.
EOS_NAMES = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>", "<eos>",
             "<|im_end|>"]
BOS_NAMES = ["<|begin_of_text|>", "<s>", "<｜begin▁of▁sentence｜>", "<bos>"]


def special(tok, path, key, names):
    config = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            value = json.load(f).get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and tok.token_to_id(value) is not None:
            return tok.token_to_id(value)
    for name in names:
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    return -1


def read_exact(stream, n):
    data = stream.read(n)
    if len(data) != n:
        sys.exit(0)  # xmoe closed the stream
    return data


def main():
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("python3 has no `tokenizers` package (pip install tokenizers; bash "
              "scripts/install-deps.sh installs it)", file=sys.stderr)
        sys.exit(3)
    path = sys.argv[1]
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the library's own message says what is wrong
        print(f"not a Hugging Face tokenizer.json ({e})", file=sys.stderr)
        sys.exit(2)
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    info = {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "eos_id": special(tok, path, "eos_token", EOS_NAMES),
            "bos_id": special(tok, path, "bos_token", BOS_NAMES)}
    out.write((json.dumps(info) + "\n").encode())
    out.flush()
    while True:
        op = inp.read(1)
        if not op:
            return
        if op == b"E":
            (count,) = struct.unpack("<I", read_exact(inp, 4))
            texts = []
            for _ in range(count):
                (n,) = struct.unpack("<Q", read_exact(inp, 8))
                texts.append(read_exact(inp, n).decode("utf-8", errors="replace"))
            parts = []
            for enc in tok.encode_batch(texts, add_special_tokens=False):
                parts.append(struct.pack("<Q", len(enc.ids)))
                parts.append(struct.pack(f"<{len(enc.ids)}I", *enc.ids))
            out.write(b"".join(parts))
        elif op == b"D":
            (n,) = struct.unpack("<Q", read_exact(inp, 8))
            ids = list(struct.unpack(f"<{n}I", read_exact(inp, 4 * n)))
            text = tok.decode(ids, skip_special_tokens=False).encode("utf-8")
            out.write(struct.pack("<Q", len(text)) + text)
        else:
            print(f"unknown request {op!r}", file=sys.stderr)
            sys.exit(2)
        out.flush()


if __name__ == "__main__":
    main()
