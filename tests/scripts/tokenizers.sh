#!/usr/bin/env bash
# Token ids of `xmoe prepare --tokenizer` against the reference libraries on a fixed text (issue
# 37): SentencePiece (a model `xmoe tokenizer train` makes) against spm_encode; Hugging Face
# tokenizer.json (tests/data/tokenizer_bpe.json, and a word-level one of 70000 ids for uint32
# token files) against Python's `tokenizers`. Each document ends with the tokenizer's eos id.
# Usage: tokenizers.sh <xmoe binary> <tests/data folder>
# Exit 77 (ctest: skipped) where spm_encode or python3's tokenizers is missing, after the checks
# that can run.
set -u
xmoe=$1
data=$2
fail() { echo "FAIL: $*"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
skipped=""

# The ids of a prepared folder (train.bin then val.bin), one a line.
ids() {
  python3 - "$1" <<'PY'
import json, struct, sys
d = sys.argv[1]
meta = json.load(open(f"{d}/meta.json"))
fmt = {"uint16": "H", "uint32": "I"}[meta["dtype"]]
for name in ("train.bin", "val.bin"):
    b = open(f"{d}/{name}", "rb").read()
    for (v,) in struct.iter_unpack("<" + fmt, b):
        print(v)
PY
}

# A fixed corpus: 400 lines of 12 words drawn by a linear congruential generator.
python3 - "$work/corpus.txt" <<'PY'
import sys
words = ("the model routes each token to experts and a gate learns which of them is best for "
         "sparse mixture layers train").split()
x, out = 12345, []
for _ in range(400):
    ws = []
    for _ in range(12):
        x = (x * 1103515245 + 12345) % 2**32
        ws.append(words[(x >> 16) % 21])
    out.append(" ".join(ws) + ".")
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
text='the gate routes each token to sparse experts. Ünïcödé ☃ and 42 digits'
printf '%s' "$text" >"$work/one.txt"

# SentencePiece.
if "$xmoe" tokenizer train --vocab 400 --corpus "$work/corpus.txt" --out "$work/sp.model" \
    >"$work/train.log" 2>&1; then
  "$xmoe" prepare --corpus "$work/one.txt" --tokenizer "$work/sp.model" --out "$work/sp" \
    --val-fraction 0 --quiet >/dev/null || fail "prepare with the SentencePiece model"
  if command -v spm_encode >/dev/null; then
    want=$(spm_encode --model "$work/sp.model" --output_format=id <"$work/one.txt" | tr ' ' '\n'; echo 2)
    got=$(ids "$work/sp")
    [[ "$got" == "$want" ]] || fail "SentencePiece ids differ from spm_encode's: $(echo $got) vs $(echo $want)"
    echo "ok: SentencePiece ids equal spm_encode's ($(echo "$got" | wc -l) ids)"
  else
    skipped+=" spm_encode (Debian: sentencepiece)"
  fi
else
  grep -q "built without SentencePiece" "$work/train.log" || fail "tokenizer train: $(cat "$work/train.log")"
  skipped+=" libsentencepiece"
fi

# Hugging Face.
out=$("$xmoe" prepare --corpus "$work/one.txt" --tokenizer "$work/none.json" --out "$work/x" 2>&1) &&
  fail "a missing tokenizer.json was accepted"
[[ $out == *"none.json: no such file"* ]] || fail "message: $out"
if python3 -c "import tokenizers" 2>/dev/null; then
  # Two documents (JSONL lines), each followed by <|endoftext|> (id 0).
  python3 -c "import json,sys; [print(json.dumps({'body': t})) for t in sys.argv[1:]]" \
    "$text" "second document" >"$work/docs.jsonl"
  "$xmoe" prepare --corpus "$work/docs.jsonl" --text-field body --tokenizer "$data/tokenizer_bpe.json" \
    --out "$work/hf" --val-fraction 0 --quiet >/dev/null || fail "prepare with tokenizer_bpe.json"
  want=$(python3 - "$data/tokenizer_bpe.json" "$text" "second document" <<'PY'
import sys
from tokenizers import Tokenizer
t = Tokenizer.from_file(sys.argv[1])
for doc in sys.argv[2:]:
    for i in t.encode(doc, add_special_tokens=False).ids + [t.token_to_id("<|endoftext|>")]:
        print(i)
PY
)
  got=$(ids "$work/hf")
  [[ "$got" == "$want" ]] || fail "HF ids differ from tokenizers': $(echo $got) vs $(echo $want)"
  echo "ok: tokenizer.json ids equal the tokenizers package's ($(echo "$got" | wc -l) ids)"

  # A vocabulary above 65536: uint32 token files with ids past 65535.
  python3 - "$work/big.json" <<'PY'
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
vocab = {f"w{i}": i for i in range(70000)}
vocab["<unk>"] = 70000
vocab["</s>"] = 70001
t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
t.save(sys.argv[1])
PY
  printf 'w1 w65535 w65536 w69999 nope w7' >"$work/words.txt"
  "$xmoe" prepare --corpus "$work/words.txt" --tokenizer "$work/big.json" --out "$work/big" \
    --val-fraction 0 --quiet >/dev/null || fail "prepare with a 70002-id tokenizer"
  python3 -c "import json,sys; m=json.load(open(sys.argv[1])); assert m['dtype']=='uint32', m" \
    "$work/big/meta.json" || fail "meta.json dtype is not uint32"
  got=$(ids "$work/big" | tr '\n' ' ')
  [[ "$got" == "1 65535 65536 69999 70000 7 70001 " ]] || fail "uint32 ids: $got"
  echo "ok: uint32 token file for a 70002-id vocabulary"
else
  skipped+=" python3 tokenizers (pip install tokenizers)"
fi

if [[ -n $skipped ]]; then
  echo "SKIP: missing$skipped"
  exit 77
fi
