#!/usr/bin/env bash
# Runs cudalloc's CUDA backend (CudaDriver) on the contract double of the CUDA driver API
# (tools/cuda-double): the conformance, allocator, COW, IPC (multi-process), capture, graph and pool
# suites with CUDALLOC_BACKEND=cuda, then the double's verdict — fails on any contract violation or on any
# driver entry point that src/driver/cuda uses and the run never called.
#
# This proves the CUDA backend executes and honours the documented API contract; it does not prove
# real device behaviour (scripts/gpu-check.sh on a GPU does). Needs NVRTC (the kernels are compiled
# to PTX and loaded): pass its lib folder, or set NVRTC_LIB, or have it on LD_LIBRARY_PATH.
#
# Usage: scripts/cuda-double.sh [NVRTC lib folder]
set -euo pipefail
cd "$(dirname "$0")/.."

nvrtc_lib="${1:-${NVRTC_LIB:-}}"
echo "== the double's own tests (each rule broken once on purpose)"
cargo test --quiet -p cuda-double
cargo build --quiet --release -p cuda-double
root="$PWD/target/cuda-double"
rm -rf "$root"
mkdir -p "$root/lib" "$root/report"
cp target/release/libcuda_double.so "$root/lib/libcuda.so.1"
# One file under both names cudarc and NVRTC open, so a process loads the double once.
ln -s libcuda.so.1 "$root/lib/libcuda.so"

export LD_LIBRARY_PATH="$root/lib${nvrtc_lib:+:$nvrtc_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDALLOC_BACKEND=cuda
export CUDA_DOUBLE_REPORT="$root/report"

suites=(driver_conformance allocator_pytorch allocator_policy allocator_properties allocator_stress cow
        ipc_multiprocess ipc_interplay ipc_expandable global_and_storage cuda_contract expandable pinned pinned_properties sleep_wake sleep_meets
        lifecycle_handover allocator_cross_stream oom_explained config_reconfigure allocator_bookkeeping
        model_exits fork_doors)
args=()
for s in "${suites[@]}"; do args+=(--test "$s"); done
echo "== CUDA backend on the contract double: ${suites[*]}"
cargo test --no-fail-fast "${args[@]}"
echo "== the allocator and IPC suites again with expandable segments (the driver's virtual memory)"
CUDALLOC_TEST_EXPANDABLE=1 cargo test --no-fail-fast --test allocator_pytorch --test allocator_policy \
  --test allocator_properties --test allocator_stress --test cow --test expandable \
  --test ipc_multiprocess --test ipc_interplay
echo "== pass-through (nothing cached: each allocation its own cuMemAlloc) under the suites that do not test caching"
CUDALLOC_TEST_PASS_THROUGH=1 cargo test --no-fail-fast --features cudarc --test allocator_pass_through --test cow \
  --test kernel_two_backends --test allocator_properties
echo "== stream capture, CUDA graphs and memory pools (one test at a time: a capture anywhere on the"
echo "   device forbids a free, which synchronizes it, and the double's device is the process's)"
cargo test --no-fail-fast --test stream_capture --test cuda_graphs --test mem_pool --test pool_stats --test graphs_meet \
  --test graph_mix -- --test-threads=1
CUDALLOC_TEST_EXPANDABLE=1 cargo test --no-fail-fast --test cuda_graphs --test mem_pool --test graph_mix -- \
  --test-threads=1
CUDALLOC_SANITIZE=panic cargo test --no-fail-fast --test stream_capture --test cuda_graphs --test graphs_meet -- \
  --test-threads=1
echo "== cudarc views: a library's own context, stream and kernels on cudalloc storages"
cargo test --features cudarc --test cudarc_views --test kernel_two_backends
echo "== a candle-style storage (storages, views, a lazy clone; its cuBLAS step needs libcublas, absent here)"
cargo run --quiet --features cudarc --example candle_storage
echo "== NVTX regions on the CUDA backend (the recorder as the NVTX tool; graph pools: one test at a time)"
cargo test --no-fail-fast --test allocator_nvtx_regions -- --test-threads=1
echo "== the planted write into a neighbour block (compute-sanitizer's case in gpu-check), as a program"
CUDALLOC_CONF=nvtx_regions:True cargo run --quiet --example memcheck_neighbour

echo "== the interplay test on the double (fresh seeds; killed consumers included): 20 s, then 20 s with expandable segments"
cargo test --test interplay -- --seconds 20
CUDALLOC_TEST_EXPANDABLE=1 cargo test --test interplay -- --seconds 20

echo "== the stream suites again under the stream sanitizer (CUDALLOC_SANITIZE=panic)"
# One test at a time: the sanitized tests are slower and overlap more on the double's one device per
# process (the tests that measure its free memory hold it alone anyway: tests/common device_alone).
CUDALLOC_SANITIZE=panic cargo test --no-fail-fast --features cudarc --test driver_conformance \
  --test cow --test global_and_storage --test ipc_interplay --test cudarc_views --test pinned --test sleep_wake --test sleep_meets \
  --test lifecycle_handover \
  -- --test-threads=1

echo "== the double's verdict"
target/release/cuda-double-report "$CUDA_DOUBLE_REPORT" src/driver/cuda
