# Sourced by the training test scripts: write_micro_corpus DIR writes DIR/text.txt, 400 short
# lines of English that a micro model learns from in a few steps; micro_model holds the flags of
# the micro model they train (d 32, 2 layers, 4 experts, sequences of 16).
write_micro_corpus() {
  mkdir -p "$1"
  for i in $(seq 1 400); do echo "the quick brown fox jumps over the lazy dog number $i."; done \
    >"$1/text.txt"
}
micro_model=(--set model.d_model=32 --set model.num_layers=2 --set model.num_heads=2
  --set model.num_kv_heads=2 --set model.dense_hidden=32 --set model.max_seq_len=16
  --set model.moe.num_experts=4 --set model.moe.expert_hidden=16 --set train.seq_len=16)
