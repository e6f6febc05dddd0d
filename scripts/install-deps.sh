#!/usr/bin/env bash
# Installs what xmoe needs to build, test and train on a Debian/Ubuntu machine. Idempotent:
# packages already present are not reinstalled, so the test command can call it every time.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libopenblas-openmp-dev libyaml-cpp-dev libfmt-dev libspdlog-dev nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev zlib1g-dev
  libopenmpi-dev openmpi-bin
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

# CUTLASS headers (header-only; the sm90 grouped GEMM of the CUDA backend) from the nvidia-cutlass
# wheel into .deps/cutlass, where CMake looks first. Downloaded, not installed: only the headers
# are used. Without them (no PyPI) the CUDA build keeps cuBLAS for every GEMM.
cutlass_version=4.2.0.0
cutlass_dir="$(cd "$(dirname "$0")/.." && pwd)/.deps/cutlass"
if [[ "$(cat "$cutlass_dir/VERSION" 2>/dev/null)" != "$cutlass_version" ]]; then
  tmp="$(mktemp -d)"
  if python3 -m pip download --no-deps -q "nvidia-cutlass==$cutlass_version" -d "$tmp" &&
     python3 -m zipfile -e "$tmp"/nvidia_cutlass-*.whl "$tmp/wheel"; then
    rm -rf "$cutlass_dir"
    mkdir -p "$cutlass_dir/tools/util"
    cp -r "$tmp/wheel/cutlass_library/source/include" "$cutlass_dir/include"
    cp -r "$tmp/wheel/cutlass_library/source/tools/util/include" "$cutlass_dir/tools/util/include"
    echo "$cutlass_version" >"$cutlass_dir/VERSION"
    echo "[install-deps] CUTLASS $cutlass_version headers in $cutlass_dir"
  else
    echo "[install-deps] warning: could not fetch nvidia-cutlass $cutlass_version; the CUDA build uses cuBLAS only"
  fi
  rm -rf "$tmp"
else
  echo "[install-deps] CUTLASS $cutlass_version headers present"
fi
