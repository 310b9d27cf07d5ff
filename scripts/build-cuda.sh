#!/usr/bin/env bash
# Builds the prefill node with CUDA on a machine that has no system CUDA toolkit: the toolkit
# comes from NVIDIA's wheels on PyPI (pinned below), unpacked into .build/cuda (no Python
# environment is touched). A second run downloads nothing: the wheels are kept in
# .build/cuda/wheels and installed from there.
#
#   scripts/build-cuda.sh                       sm_75, sm_86, sm_89 and sm_90 (laptop GPUs + H100/H200)
#   CUDA_ARCHS="86" scripts/build-cuda.sh       one architecture (a shorter build)
#
# Output: target/cuda-<architectures>/release/edgesplit-prefill (for the default list
# target/cuda-75-86-89-90/...), its path the last line on stdout. It loads libcublas and
# libcublasLt from .build/cuda (an rpath is set; copy that folder with the binary) and the
# NVIDIA driver's libcuda.so.1 from the system at run time. On a machine without a GPU or
# driver it serves on the CPU (ggml finds no CUDA device and says so in its log;
# scripts/check-cuda-build.sh checks it).
#
# Not part of scripts/test.sh: ggml's CUDA kernels take a long time on 2 cores (one
# architecture: ~38 minutes here; docs/BENCHMARKS.md "The CUDA build").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${EDGESPLIT_CUDA_PREFIX:-$ROOT/.build/cuda}"
ARCHS="${CUDA_ARCHS:-75;86;89;90}"
ARCHS="${ARCHS// /;}"
START=$(date +%s)

# CUDA 13.5 as the `cuda-toolkit` 13.5 meta-package pins it, and a CMake that knows CUDA 13.
WHEELS=(
    nvidia-cuda-nvcc==13.5.37
    nvidia-nvvm==13.5.37
    nvidia-cuda-crt==13.5.37
    nvidia-cuda-runtime==13.5.37
    nvidia-cuda-cccl==13.3.5.0.6
    nvidia-cublas==13.10.0.20
    cmake==3.31.10
)

bash "$ROOT/scripts/setup.sh"

mkdir -p "$PREFIX/wheels"
if ! python3 -m pip download --no-deps --only-binary=:all: --no-index --find-links "$PREFIX/wheels" \
        -d "$PREFIX/wheels" "${WHEELS[@]}" >/dev/null 2>&1; then
    echo "[cuda] downloading the CUDA toolkit wheels (~570 MB, once)" >&2
    python3 -m pip download --no-deps --only-binary=:all: -d "$PREFIX/wheels" "${WHEELS[@]}"
fi
STAMP="$PREFIX/py/.installed"
if [[ ! -f "$STAMP" ]] || [[ "$(cat "$STAMP")" != "${WHEELS[*]}" ]]; then
    rm -rf "$PREFIX/py"
    python3 -m pip install --quiet --no-deps --no-index --find-links "$PREFIX/wheels" \
        --target "$PREFIX/py" "${WHEELS[@]}"
    echo "${WHEELS[*]}" >"$STAMP"
fi

# The wheels unpack to a toolkit root (bin, include, lib, nvvm); what CMake and the linker look
# for under their usual names is added beside them.
CUDA="$PREFIX/py/nvidia/cu13"
[[ -x "$CUDA/bin/nvcc" ]] || { echo "[cuda] no nvcc in $CUDA/bin" >&2; exit 1; }
for lib in cudart cublas cublasLt; do
    ln -sf "lib$lib.so.13" "$CUDA/lib/lib$lib.so"
done
# llama-cpp-sys-2 links cuBLAS statically (cublas_static, cublasLt_static, culibos), which
# the wheels do not ship: empty archives take those names and the shared cuBLAS is linked
# instead (the link arguments below). cudart stays static (the wheel has libcudart_static.a).
SHIM="$PREFIX/shim"
mkdir -p "$SHIM"
for lib in cublas_static cublasLt_static culibos; do
    [[ -f "$SHIM/lib$lib.a" ]] || ar rc "$SHIM/lib$lib.a"
done

# The cmake wheel's own binary (its bin/ wrapper needs the wheel on the Python path).
export PATH="$PREFIX/py/cmake/data/bin:$CUDA/bin:$PATH"
export CUDA_PATH="$CUDA" CUDAToolkit_ROOT="$CUDA" CUDACXX="$CUDA/bin/nvcc"
# CMake reads the architectures from CUDAARCHS when the project does not set them.
export CUDAARCHS="$ARCHS"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# One target folder per architecture list: CMake keeps the architectures it first
# configured with, so another list is another build.
export CARGO_TARGET_DIR="$ROOT/target/cuda-${ARCHS//;/-}"
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$SHIM -L native=$CUDA/lib \
-C link-arg=-Wl,-rpath,$CUDA/lib -C link-arg=-lcublas -C link-arg=-lcublasLt"
echo "[cuda] nvcc $("$CUDA/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), cmake $(cmake --version | head -1 | cut -d' ' -f3), architectures $CUDAARCHS" >&2

# cuda-no-vmm: without it ggml links the driver library (libcuda.so), which only a driver
# installation provides; cudart loads it at run time either way.
cd "$ROOT"
cargo build --release -p edgesplit-prefill --features cuda-no-vmm

BIN="$CARGO_TARGET_DIR/release/edgesplit-prefill"
echo "[cuda] built in $(( $(date +%s) - START )) s: $BIN" >&2
echo "[cuda] it needs at run time: $CUDA/lib (libcublas, libcublasLt; found by its rpath) and the NVIDIA driver's libcuda.so.1" >&2
echo "$BIN"
