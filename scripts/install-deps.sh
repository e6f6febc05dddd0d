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
