#!/usr/bin/env bash
# The SentencePiece tokenizer through a run and `xmoe export --format hf` (issue 37): a model
# trained on SentencePiece-prepared data keeps its tokenizer in the checkpoint, so `xmoe
# generate` and `xmoe export` work after the data folder and the tokenizer file are deleted; the
# exported tokenizer.model + tokenizer_config.json load in transformers' AutoTokenizer, which
# encodes a fixed text to the ids xmoe writes and decodes them back.
# Usage: hf_sentencepiece.sh <xmoe binary> <tests/scripts folder>
# Exit 77 (ctest: skipped) where libsentencepiece is not built in, or where python3 lacks
# transformers, sentencepiece or protobuf (after the checks that need none of them).
set -u
xmoe=$1
source "$2/micro_corpus.sh"
fail() { echo "FAIL: $*"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

write_micro_corpus "$work/corpus"
if ! "$xmoe" tokenizer train --vocab 300 --corpus "$work/corpus" --out "$work/sp.model" \
    >"$work/log" 2>&1; then
  grep -q "built without SentencePiece" "$work/log" || fail "tokenizer train: $(cat "$work/log")"
  echo "skipped: built without libsentencepiece"
  exit 77
fi
"$xmoe" prepare --corpus "$work/corpus" --tokenizer "$work/sp.model" --out "$work/data" \
  --val-fraction 0.1 --quiet >/dev/null || fail "prepare"
"$xmoe" train --quiet --set model.vocab_size=320 --set model.d_model=32 --set model.num_layers=2 \
  --set model.num_heads=2 --set model.num_kv_heads=2 --set model.dense_hidden=32 \
  --set model.max_seq_len=16 --set model.moe.num_experts=4 --set model.moe.expert_hidden=16 \
  --set train.seq_len=16 --set train.batch_size=2 --set train.eval_every=0 \
  --set train.warmup_steps=1 --set train.steps=2 --set "data.dir=$work/data" \
  --set "train.out_dir=$work/run" >"$work/log" 2>&1 || fail "train: $(cat "$work/log")"
[[ -f $work/run/step-2/tokenizer.model ]] || fail "the checkpoint holds no tokenizer.model"

# The data folder and the tokenizer file are gone: the checkpoint's copy serves.
rm -rf "$work/data" "$work/sp.model"
out=$("$xmoe" generate --checkpoint "$work/run" --prompt "the quick" --tokens 5 2>&1) ||
  fail "generate without the data folder: $out"
[[ $out == "the quick"* ]] || fail "generate: $out"
"$xmoe" export --checkpoint "$work/run" --format hf --out "$work/hf" >"$work/log" 2>&1 ||
  fail "export without the data folder: $(cat "$work/log")"
for f in tokenizer.model tokenizer_config.json config.json model.safetensors; do
  [[ -f $work/hf/$f ]] || fail "export wrote no $f"
done
echo "ok: generate and export use the checkpoint's tokenizer after the data folder is gone"

if ! python3 -c "import transformers, sentencepiece, google.protobuf" 2>/dev/null; then
  echo "skipped: python3 lacks transformers, sentencepiece or protobuf (pip install transformers sentencepiece protobuf)"
  exit 77
fi
# xmoe's ids for the text: prepare it with the exported model (one document: ids, then eos).
text='the lazy dog jumps over the quick brown fox number 42, café ☃.'
printf '%s' "$text" >"$work/one.txt"
"$xmoe" prepare --corpus "$work/one.txt" --tokenizer "$work/hf/tokenizer.model" --out "$work/one" \
  --val-fraction 0 --quiet >/dev/null || fail "prepare one.txt"
python3 - "$work/hf" "$work/one" "$text" <<'PY' || exit 1
import json, struct, sys
from transformers import AutoTokenizer
hf, one, text = sys.argv[1:]
meta = json.load(open(f"{one}/meta.json"))
raw = open(f"{one}/train.bin", "rb").read()
ids = [v for (v,) in struct.iter_unpack("<H", raw)]
eos = meta["tokenizer"]["eos_id"]
assert ids[-1] == eos, f"the document does not end with eos {eos}: {ids}"
want = ids[:-1]
tok = AutoTokenizer.from_pretrained(hf)
got = tok(text)["input_ids"]
if got != want:
    print(f"FAIL: transformers' ids {got} differ from xmoe's {want} ({type(tok).__name__})")
    sys.exit(1)
back = tok.decode(got)
if back != text:
    print(f"FAIL: transformers decodes {back!r}, not {text!r}")
    sys.exit(1)
if tok.eos_token_id != eos:
    print(f"FAIL: eos_token_id {tok.eos_token_id} is not xmoe's {eos}")
    sys.exit(1)
print(f"ok: {type(tok).__name__} encodes the text to xmoe's {len(want)} ids and decodes it back")
PY
