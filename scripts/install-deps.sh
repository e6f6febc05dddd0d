#!/usr/bin/env bash
# Installs what xmoe needs to build, test and train on a Debian/Ubuntu machine. Idempotent:
# packages already present are not reinstalled, so the test command can call it every time.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config clang-format
  libopenblas-openmp-dev libyaml-cpp-dev libfmt-dev libspdlog-dev nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev zlib1g-dev
  libopenmpi-dev openmpi-bin
  libsentencepiece-dev sentencepiece  # SentencePiece tokenizers; spm_encode for the tests
  clang libclang-rt-dev libomp-dev  # tests/fuzz: libFuzzer, its sanitizers, OpenMP for clang
  fortunes  # the built-in default corpus: ~2.4 MB of English text in /usr/share/games/fortunes
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "[install-deps] installing: ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
else
  echo "[install-deps] all packages present"
fi

# fetch_headers PACKAGE VERSION DEST WITHOUT SRC:DST...: downloads the wheel PACKAGE==VERSION (not
# installed: only headers are used) and copies each SRC inside it to DEST/DST, once per version
# (DEST/VERSION). WITHOUT says what the build does if the download fails (no PyPI).
fetch_headers() {
  local package=$1 version=$2 dest=$3 without=$4
  shift 4
  if [[ "$(cat "$dest/VERSION" 2>/dev/null)" == "$version" ]]; then
    echo "[install-deps] $package $version headers present"
    return 0
  fi
  local tmp pair
  tmp="$(mktemp -d)"
  if python3 -m pip download --no-deps -q "$package==$version" -d "$tmp" &&
     python3 -m zipfile -e "$tmp"/*.whl "$tmp/wheel"; then
    rm -rf "$dest"
    for pair in "$@"; do
      mkdir -p "$(dirname "$dest/${pair#*:}")"
      cp -r "$tmp/wheel/${pair%%:*}" "$dest/${pair#*:}"
    done
    echo "$version" >"$dest/VERSION"
    echo "[install-deps] $package $version headers in $dest"
  else
    echo "[install-deps] warning: could not fetch $package $version; $without"
  fi
  rm -rf "$tmp"
}
deps_dir="$(cd "$(dirname "$0")/.." && pwd)/.deps"

# matplotlib for `xmoe plot` (tools/xmoe/xmoe_plot.py runs under the python3 on PATH): pip where
# that python takes packages (pyenv, a venv), else Debian's package for the system python.
if python3 -c "import matplotlib" 2>/dev/null; then
  echo "[install-deps] matplotlib present"
elif python3 -m pip install -q matplotlib 2>/dev/null; then
  echo "[install-deps] matplotlib installed with pip"
else
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    python3-matplotlib >/dev/null
  python3 -c "import matplotlib" 2>/dev/null && echo "[install-deps] matplotlib installed (apt)" ||
    echo "[install-deps] warning: matplotlib is not importable by $(command -v python3); xmoe plot will say so"
fi

# tokenizers (a few MB wheel) for Hugging Face tokenizer.json files (tools/xmoe/xmoe_tokenizer.py
# runs under the python3 on PATH); without it `xmoe prepare --tokenizer x.json` says so.
if python3 -c "import tokenizers" 2>/dev/null; then
  echo "[install-deps] tokenizers present"
elif python3 -m pip install -q tokenizers 2>/dev/null ||
     python3 -m pip install -q --break-system-packages tokenizers 2>/dev/null; then
  echo "[install-deps] tokenizers installed with pip"
else
  echo "[install-deps] warning: python3 cannot import tokenizers; Hugging Face tokenizer.json files will be refused"
fi

# transformers, sentencepiece and protobuf (no torch) for the test that reads an exported
# SentencePiece tokenizer back with transformers' AutoTokenizer (tests/scripts/hf_sentencepiece.sh).
if python3 -c "import transformers, sentencepiece, google.protobuf" 2>/dev/null; then
  echo "[install-deps] transformers, sentencepiece, protobuf present"
elif python3 -m pip install -q transformers sentencepiece protobuf 2>/dev/null ||
     python3 -m pip install -q --break-system-packages transformers sentencepiece protobuf \
       2>/dev/null; then
  echo "[install-deps] transformers, sentencepiece, protobuf installed with pip"
else
  echo "[install-deps] warning: python3 cannot import transformers, sentencepiece and protobuf; the Hugging Face tokenizer test will be skipped"
fi

# CUTLASS headers (header-only; the sm90 grouped GEMM of the CUDA backend) into .deps/cutlass,
# where CMake looks first.
fetch_headers nvidia-cutlass 4.2.0.0 "$deps_dir/cutlass" "the CUDA build uses cuBLAS only" \
  cutlass_library/source/include:include \
  cutlass_library/source/tools/util/include:tools/util/include

# cuDNN frontend headers (header-only C++ API over cuDNN's graph backend: the fused attention of
# the CUDA backend) into .deps/cudnn-frontend. cuDNN itself comes with the CUDA toolkit.
fetch_headers nvidia-cudnn-frontend 1.32.0 "$deps_dir/cudnn-frontend" \
  "the CUDA build uses its own attention only" include:include
