# Sourced by the training test scripts: write_micro_corpus DIR writes DIR/text.txt, 400 short
# lines of English that a micro model learns from in a few steps.
write_micro_corpus() {
  mkdir -p "$1"
  for i in $(seq 1 400); do echo "the quick brown fox jumps over the lazy dog number $i."; done \
    >"$1/text.txt"
}
