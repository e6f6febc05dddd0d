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
import re
import struct
import sys

# End-of-document tokens of common models, tried in order when no tokenizer_config.json beside
# the file names one.
EOS_NAMES = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>", "<eos>",
             "<|im_end|>"]
LINE_CUT = re.compile(r"(?<=\n)(?=\S)")
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
            # Long texts are encoded in pieces cut after a line end that a non-space follows
            # (a pre-token boundary of the GPT-2, Llama-3 and Qwen patterns): the library's time
            # and memory on one input of megabytes are far above its cost on lines, which
            # encode_batch also spreads over threads.
            pieces, owner = [], []
            for i, t in enumerate(texts):
                cut = LINE_CUT.split(t) if len(t) > 4096 else [t]
                pieces.extend(cut)
                owner.extend([i] * len(cut))
            ids = [[] for _ in texts]
            # Groups of ~256 kB: an Encoding holds ~100 bytes per token besides its id.
            start = 0
            while start < len(pieces):
                end, size = start, 0
                while end < len(pieces) and (end == start or size < 1 << 18):
                    size += len(pieces[end])
                    end += 1
                encs = tok.encode_batch(pieces[start:end], add_special_tokens=False)
                for i, enc in zip(owner[start:end], encs):
                    ids[i].extend(enc.ids)
                start = end
            parts = []
            for v in ids:
                parts.append(struct.pack("<Q", len(v)))
                parts.append(struct.pack(f"<{len(v)}I", *v))
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
