#!/usr/bin/env bash
# Installs every Debian package nibble needs to build, test and run its main job.
# Idempotent and quick when everything is already there. Run as root (or with sudo).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  clang libclang-rt-dev libomp-dev          # sanitizer + libFuzzer build
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev                            # CPU GEMM
  libsentencepiece-dev sentencepiece         # tokenizer
  libcli11-dev nlohmann-json3-dev libfmt-dev libspdlog-dev
  libcpp-httplib-dev                         # `nibble serve` (HTTP server; the tests' client)
  libpng-dev zlib1g-dev                      # loss-curve plots
  libopenmpi-dev openmpi-bin                 # data-parallel training across processes (mpirun)
  bible-kjv bible-kjv-text                   # the default public-domain training corpus
  python3 xz-utils                           # corpus cleaner and repro tooling tests (stdlib only)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi
echo "setup: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
