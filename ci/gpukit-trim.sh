#!/usr/bin/env bash
# Trim .gpukit/site.tar.xz (from ../shared/gpu/make-kit.sh) by what neither compiling nor
# running needs: TVM's and tvm-ffi's C++ and Cython sources, tvm-ffi's third-party sources
# (dlpack's headers stay, in tvm_ffi/include), the ONNX and TFLite importers. About 0.8 MiB
# less to carry, which keeps the kit and the tracked files under 63 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
kit=.gpukit/site.tar.xz
[ -f "$kit" ] || { echo "gpukit-trim: no $kit (run bash ../shared/gpu/make-kit.sh first)" >&2; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
tar -C "$work" -xJf "$kit"
rm -rf "$work"/tvm/src "$work"/tvm_ffi/3rdparty "$work"/tvm_ffi/src "$work"/tvm_ffi/cython \
    "$work"/tvm/relax/frontend/tflite "$work"/tvm/relax/frontend/onnx
before=$(stat -c %s "$kit")
tar -C "$work" -cf - . | xz -9e -T2 >"$kit.part" && mv "$kit.part" "$kit"
echo "gpukit-trim: $kit $((before / 1024)) KiB -> $(($(stat -c %s "$kit") / 1024)) KiB" >&2
