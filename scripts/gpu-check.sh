#!/usr/bin/env bash
# The CUDA evidence of cudalloc, for a machine with a GPU.
#
#   scripts/gpu-check.sh --prepare   on a machine with cargo and the registry: builds every test
#                                    binary into target/gpu-bin/ (carry that folder to the GPU box,
#                                    which may have no network to fetch crates).
#   scripts/gpu-check.sh --pack      packs target/gpu-bin/ as .gpu/gb.tar.xz to carry.
#   scripts/gpu-check.sh             on the GPU machine: builds the tests if cargo can, else uses
#                                    target/gpu-bin/; finds NVRTC; runs every suite with the CUDA
#                                    backend present and prints a table. Exit code 1 if anything failed
#                                    or a CUDA case was skipped.
#
# GPU_CHECK_ONLY="a b …" runs only those suites and parts (a device lease is short: split the check
# over calls), GPU_CHECK_SKIP="a b …" all but those; the parts are named `examples`, `expandable`
# (the allocator suites again with expandable segments), `sanitized` (the stream suites under the
# sanitizer), `pass_through` (the suites that do not test caching with nothing cached), `cli` (the
# command: `info`, then the demo), `memcheck` (NVIDIA's compute-sanitizer over a planted write into
# a neighbour block, with and without NVTX regions, and over a few suites) and `benches`. GPU_CHECK_SUITE_TIMEOUT (300 s) bounds each suite.
set -uo pipefail
cd "$(dirname "$0")/.."
bin_dir=target/gpu-bin

prepare() {
  mkdir -p "$bin_dir"
  # --features cudarc: the cudarc views' tests (a kernel launched through cudarc on a storage);
  # nccl: the allocator's regions registered with an NCCL communicator (tests/nccl_gpu.rs; it
  # needs libnccl.so.2, e.g. from the nvidia-nccl-cu12 wheel, on the library path).
  { cargo test --release --features cudarc,nccl --no-run --message-format=json 2>/dev/null
    cargo build --release --features cudarc,nccl --bins --examples --message-format=json 2>/dev/null
    cargo bench --features cudarc --no-run --message-format=json 2>/dev/null; } \
    | python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    try: msg = json.loads(line)
    except ValueError: continue
    exe = msg.get("executable")
    if msg.get("reason") == "compiler-artifact" and exe:
        kind = msg["target"]["kind"]
        name = msg["target"]["name"] + ("-lib" if "lib" in kind else "") + ("-bench" if "bench" in kind else "") + ("-example" if "example" in kind else "") + ("-cli" if kind == ["bin"] else "")
        shutil.copy(exe, os.path.join(sys.argv[1], name)); print("prepared", name)
' "$bin_dir"
  # The NVTX recorder (tests/allocator_nvtx_regions.rs loads it; CUDALLOC_NVTX_RECORDER names it).
  cargo build --release -p nvtx-recorder 2>/dev/null \
    && cp target/release/libnvtx_recorder.so "$bin_dir/libnvtx_recorder.so" && echo "prepared libnvtx_recorder.so"
}

if [ "${1:-}" = "--prepare" ]; then
  prepare
  exit 0
fi
# --pack: the prepared binaries as .gpu/gb.tar.xz (ignored by git) for a device call to carry and
# unpack with `tar -xJf .gpu/gb.tar.xz`: debug information stripped (symbols kept, so the tests
# of Rust stacks still see function names), the loom models and the layering check left out.
if [ "${1:-}" = "--pack" ]; then
  stage=$(mktemp -d)
  mkdir -p "$stage/$bin_dir" .gpu
  for exe in "$bin_dir"/*; do
    case "$(basename "$exe")" in loom_*|layering|msrv) continue ;; esac
    strip --strip-debug -o "$stage/$bin_dir/$(basename "$exe")" "$exe"
  done
  tar -C "$stage" -cf - target | xz -9 -T2 > .gpu/gb.tar.xz
  rm -rf "$stage"
  ls -l .gpu/gb.tar.xz
  exit 0
fi

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi not available"

# NVRTC: the CUDA toolkit, or the nvidia-cuda-nvrtc-cu12 wheel that PyTorch installs.
nvrtc_dir=$(python3 -c 'import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null \
  || dirname "$(find / -name 'libnvrtc.so*' -not -path '*/proc/*' 2>/dev/null | head -n 1)" 2>/dev/null || true)
if [ -z "$nvrtc_dir" ] || ! ls "$nvrtc_dir"/libnvrtc.so* >/dev/null 2>&1; then
  # CUDA 13's wheels keep their libraries elsewhere (nvidia/cu13/lib).
  found=$(find / -name 'libnvrtc.so*' -not -path '/proc/*' 2>/dev/null | head -n 1)
  nvrtc_dir=${found:+$(dirname "$found")}
fi
if [ -n "$nvrtc_dir" ] && ls "$nvrtc_dir"/libnvrtc.so* >/dev/null 2>&1; then
  export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # cudarc looks for libnvrtc.so or libnvrtc.so.12; a newer toolkit ships only libnvrtc.so.13.
  if [ ! -e "$nvrtc_dir/libnvrtc.so" ] && [ ! -e "$nvrtc_dir/libnvrtc.so.12" ]; then
    versioned=$(ls "$nvrtc_dir"/libnvrtc.so.* 2>/dev/null | head -n 1)
    link_dir=$(mktemp -d)
    ln -s "$versioned" "$link_dir/libnvrtc.so"
    export LD_LIBRARY_PATH="$link_dir:$LD_LIBRARY_PATH"
    echo "NVRTC: $versioned (as libnvrtc.so)"
  fi
  echo "NVRTC: $nvrtc_dir"
else
  echo "NVRTC: not found (kernel tests will fail on CUDA)"
fi

if [ -z "${GPU_CHECK_NO_BUILD:-}" ] && command -v cargo >/dev/null 2>&1 \
    && cargo test --release --no-run >/dev/null 2>&1; then
  echo "== building test binaries with cargo"
  prepare >/dev/null
fi
[ -d "$bin_dir" ] || { echo "no test binaries: run scripts/gpu-check.sh --prepare first"; exit 1; }

only=${GPU_CHECK_ONLY:-}
# Not CUDA evidence, and they need cargo or the sources: the declared Rust version, the layering
# of the source files, the loom models.
skip="msrv layering loom_cow loom_ipc_slot ${GPU_CHECK_SKIP:-}"
# The command the end-to-end tests run (carried binaries live elsewhere than cargo built them).
[ -x "$bin_dir/cudalloc-cli" ] && export CUDALLOC_CLI="$PWD/$bin_dir/cudalloc-cli"
[ -f "$bin_dir/libnvtx_recorder.so" ] && export CUDALLOC_NVTX_RECORDER="$PWD/$bin_dir/libnvtx_recorder.so"
wanted() { { [ -z "$only" ] || [[ " $only " == *" $1 "* ]]; } && [[ " $skip " != *" $1 "* ]]; }

export CUDALLOC_BACKEND=cuda
log=$(mktemp)
status=0
printf '\n%-58s %s\n' "test" "result"
# The command first (it died by a signal on the last GPU: say which, and go on).
run_cli() { # what, then the command's arguments
  local what=$1; shift
  echo "== cudalloc $what"
  "$bin_dir/cudalloc-cli" "$@" 2>&1 | tail -n 25 | sed 's/^/  /'
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -gt 128 ]; then
    echo "  ^ cudalloc $what died by signal $((rc - 128)) ($(kill -l $((rc - 128)) 2>/dev/null))"; status=1
  elif [ "$rc" -ne 0 ]; then
    echo "  ^ cudalloc $what exited with $rc"; status=1
  fi
}
if wanted cli && [ -x "$bin_dir/cudalloc-cli" ]; then
  run_cli info info
  run_cli demo
fi
# The tensor-library example, on CUDA through cudarc (its host twin runs in CI), and the
# candle-style storage with its cuBLAS matmul (libcublas from the toolkit or PyTorch's wheels).
if wanted examples && [ -x "$bin_dir/candle_storage-example" ]; then
  echo "== examples/candle_storage on CUDA"
  cublas_dir=$(dirname "$(find / -name 'libcublas.so*' -not -path '/proc/*' 2>/dev/null | head -n 1)" 2>/dev/null || true)
  if ! LD_LIBRARY_PATH="${cublas_dir:+$cublas_dir:}$LD_LIBRARY_PATH" "$bin_dir/candle_storage-example"; then status=1; fi
fi
# The tensor-library example, on CUDA through cudarc (its host twin runs in CI).
if wanted examples && [ -x "$bin_dir/tensor_library-example" ]; then
  echo "== examples/tensor_library on CUDA"
  if ! "$bin_dir/tensor_library-example"; then status=1; fi
fi
# Every suite, the pinned host allocator's (pinned, pinned_properties: cuMemHostAlloc,
# cuMemHostRegister and async copies from page-locked memory) and sleep and wake by tag
# (sleep_wake: cuMemUnmap/cuMemRelease of a tag's pages, cuMemCreate/cuMemMap at the same
# addresses, a graph replayed after wake) included.
for exe in "$bin_dir"/*; do
  suite=$(basename "$exe")
  case "$suite" in *-bench|*-example|*-cli) continue ;; esac
  wanted "$suite" || continue
  # A suite that hangs on a GPU must not eat the whole check: each has a deadline.
  if ! timeout "${GPU_CHECK_SUITE_TIMEOUT:-300}" "$exe" --test-threads=1 --nocapture >"$log" 2>&1; then
    status=1
  fi
  grep -E '^test .* \.\.\. ' "$log" | sed -E 's/^test (.*) \.\.\. (.*)$/\1|\2/' \
    | while IFS='|' read -r name result; do printf '%-58s %s\n' "$suite::$name" "$result"; done
  if grep -q 'skipped: no CUDA driver' "$log"; then
    echo "  ^ $suite: a CUDA case was skipped on a GPU machine"; status=1
  fi
  # Each panic with its message (the line after), bounded: a device call returns only its tail.
  grep -E -A1 'panicked at' "$log" | grep -vE '^--$' | head -n 40 | sed 's/^/  /'
  grep -E -A12 '^graph mix failed' "$log" | head -n 26 | sed 's/^/  /'
  grep -E 'FAILED|test result' "$log" | sed 's/^/  /'
done
# The allocator and IPC suites again with expandable segments (the GPU's virtual-memory API;
# sharing by page: cuMemExportToShareableHandle / cuMemImportFromShareableHandle across processes).
wanted expandable || expandable_suites=""
for suite in ${expandable_suites-allocator_pytorch allocator_policy allocator_properties allocator_stress cow expandable \
             ipc_multiprocess ipc_interplay cuda_graphs mem_pool graph_mix}; do
  exe="$bin_dir/$suite"
  [ -x "$exe" ] || continue
  if ! CUDALLOC_TEST_EXPANDABLE=1 timeout "${GPU_CHECK_SUITE_TIMEOUT:-300}" "$exe" --test-threads=1 >"$log" 2>&1; then status=1; fi
  grep -E 'test result' "$log" | sed "s/^/  $suite (expandable): /"
done
# The stream sanitizer on a real GPU: the suites that drive streams, once more with every stream
# operation checked (a race or a use after free panics), and the sanitizer's own tests.
wanted sanitized || sanitized_suites=""
for suite in ${sanitized_suites-driver_conformance cow global_and_storage lifecycle_handover ipc_multiprocess cudarc_views sanitizer \
             stream_capture cuda_graphs graphs_meet graph_mix pinned pinned_properties sleep_wake sleep_meets}; do
  exe="$bin_dir/$suite"
  [ -x "$exe" ] || continue
  if ! CUDALLOC_SANITIZE=panic timeout "${GPU_CHECK_SUITE_TIMEOUT:-300}" "$exe" --test-threads=1 >"$log" 2>&1; then status=1; fi
  grep -E 'test result' "$log" | sed "s/^/  $suite (CUDALLOC_SANITIZE=panic): /"
done
# Nothing cached (pass_through:True, each allocation its own cuMemAlloc): what a memcheck run of a
# library's suite uses.
wanted pass_through || pass_through_suites=""
for suite in ${pass_through_suites-allocator_pass_through allocator_properties cow kernel_two_backends storage_doors \
             sleep_wake ipc_interplay cuda_graphs graph_mix}; do
  exe="$bin_dir/$suite"
  [ -x "$exe" ] || continue
  if ! CUDALLOC_TEST_PASS_THROUGH=1 timeout "${GPU_CHECK_SUITE_TIMEOUT:-300}" "$exe" --test-threads=1 >"$log" 2>&1; then status=1; fi
  grep -E 'test result' "$log" | sed "s/^/  $suite (pass_through): /"
done
# NVIDIA's compute-sanitizer. memcheck over a kernel that writes 1,024 bytes from the start of a
# 512-byte tensor into the next block of the same cached segment (examples/memcheck_neighbour):
# "valid memory" to memcheck unless the allocator describes its blocks (nvtx_regions:True, which
# memcheck's --nvtx yes reads); with nothing cached each tensor is a driver allocation of its own.
# Then memcheck with NVTX regions, and racecheck, over a few suites (CUDALLOC_TEST_NVTX=1).
sanitizer_bin=$(command -v compute-sanitizer 2>/dev/null \
  || find / -name compute-sanitizer -type f -perm -u+x -not -path '/proc/*' 2>/dev/null | head -n 1)
memcheck_case() { # what, expected (reported, silent or either), CUDALLOC_CONF, sanitizer options…
  local what=$1 expect=$2 conf=$3; shift 3
  local out got
  out=$(CUDALLOC_CONF="$conf" timeout 120 "$sanitizer_bin" --tool memcheck "$@" \
        "$bin_dir/memcheck_neighbour-example" 2>&1)
  if echo "$out" | grep -q 'Invalid __global__ write'; then got=reported; else got=silent; fi
  printf '  %-48s %-9s (expected: %s)\n' "$what" "$got" "$expect"
  echo "$out" | grep -E 'tensor at|Invalid __global__|is out of bounds|ERROR SUMMARY' | head -n 6 | sed 's/^/    /'
  if [ "$expect" != either ] && [ "$got" != "$expect" ]; then status=1; fi
}
if wanted memcheck; then
  echo "== compute-sanitizer"
  if [ -z "$sanitizer_bin" ]; then
    echo "  compute-sanitizer not found"; status=1
  elif [ ! -x "$bin_dir/memcheck_neighbour-example" ]; then
    echo "  examples/memcheck_neighbour was not built"; status=1
  else
    "$sanitizer_bin" --version | tail -n 1 | sed 's/^/  /'
    memcheck_case "cached, nvtx_regions:True, --nvtx yes" reported nvtx_regions:True --nvtx yes
    memcheck_case "cached, no NVTX regions" silent "" --nvtx yes
    memcheck_case "cached, nvtx_regions:True, --nvtx no" silent nvtx_regions:True
    memcheck_case "pass_through:True" either pass_through:True
    for suite in kernel_two_backends storage_doors cow; do
      exe="$bin_dir/$suite"
      [ -x "$exe" ] || continue
      for tool in memcheck racecheck; do
        extra=(); [ "$tool" = memcheck ] && extra=(--nvtx yes)
        if ! CUDALLOC_TEST_NVTX=1 timeout "${GPU_CHECK_SUITE_TIMEOUT:-300}" "$sanitizer_bin" --tool "$tool" \
             "${extra[@]}" --error-exitcode 97 "$exe" --test-threads=1 >"$log" 2>&1; then status=1; fi
        { grep -E 'test result|ERROR SUMMARY|RACECHECK SUMMARY' "$log" || tail -n 3 "$log"; } \
          | sed "s/^/  $suite ($tool): /"
      done
    done
  fi
fi
rm -f "$log"
# Sleep and wake of 1 GiB on the GPU against two plain copies and against copying out, freeing,
# allocating afresh and copying back (issue 26's target: sleep + wake <= 1.5x two plain copies).
if wanted benches && [ -x "$bin_dir/sleep-bench" ]; then
  echo
  echo "== sleep and wake by tag, 1 GiB (CUDA)"
  CUDALLOC_BENCH_BACKEND=cuda "$bin_dir/sleep-bench" --bench 2>&1 \
    | grep -E 'free memory|^sleep_wake|time:' | grep -v 'change' | sed 's/^/  /'
fi
# PyTorch side: torch's caching allocator pair and CUDA IPC round trip beside ours, same run.
median_ns() { # criterion's "time: [lo median hi]" line -> median in ns
  awk '/time:/ { v=$5; u=$6; if (u=="ps") v/=1000; if (u=="µs"||u=="us") v*=1000; if (u=="ms") v*=1e6; print v; exit }'
}
if ! wanted benches; then
  :
elif [ -x "$bin_dir/alloc-bench" ] && python3 -c 'import torch' 2>/dev/null; then
  echo
  echo "== cudalloc vs PyTorch (CUDA, medians in ns)"
  torch_out=$(python3 scripts/torch_peer.py 2>&1)
  echo "$torch_out" | grep -v '^torch ' | sed 's/^/  /'
  printf '%-22s %12s %12s %12s %14s %10s\n' case cudalloc torch-pair torch-empty cudaMallocAsync torch/ours
  for size in 512 65536 1048576 16777216 67108864; do
    ours=$(CUDALLOC_BENCH_BACKEND=cuda "$bin_dir/alloc-bench" --bench "pair/cudalloc/$size\$" 2>/dev/null | median_ns)
    theirs=$(echo "$torch_out" | awk -v k="pair/$size" '$2==k {print $3}')
    empty=$(echo "$torch_out" | awk -v k="empty/$size" '$2==k {print $3}')
    async=$(echo "$torch_out" | awk -v k="async_pair/$size" '$2==k {print $3}')
    ratio=$(awk -v a="$ours" -v b="$theirs" 'BEGIN { if (a>0 && b>0) printf "%.1fx", b/a; else print "n/a" }')
    printf '%-22s %12s %12s %12s %14s %10s\n' "pair/$size" "${ours:-n/a}" "${theirs:-n/a}" "${empty:-n/a}" "${async:-n/a}" "$ratio"
  done
  if [ -x "$bin_dir/ipc-bench" ]; then
    ours=$(CUDALLOC_BENCH_BACKEND=cuda "$bin_dir/ipc-bench" --bench "round_trip/share" 2>/dev/null | median_ns)
    theirs=$(echo "$torch_out" | awk '$2=="round_trip" {print $3}')
    ratio=$(awk -v a="$ours" -v b="$theirs" 'BEGIN { if (a>0 && b>0) printf "%.1fx", b/a; else print "n/a" }')
    printf '%-22s %12s %12s %10s\n' "ipc round trip" "${ours:-n/a}" "${theirs:-n/a}" "$ratio"
  fi
else
  echo "PyTorch comparison: skipped (no torch in python3, or no bench binaries)"
fi

# A launch through a storage's view against a raw cudarc launch (64 launches of a 4 KiB kernel).
if wanted benches && [ -x "$bin_dir/view_launch-bench" ]; then
  echo
  echo "== a storage view launch against a raw cudarc launch (CUDA, 64 launches per iteration)"
  "$bin_dir/view_launch-bench" --bench --warm-up-time 1 --measurement-time 3 2>&1 \
    | grep -E '^view_launch|time:|skipped' | sed 's/^/  /'
fi

echo
[ "$status" -eq 0 ] && echo "gpu-check: all CUDA evidence passed" || echo "gpu-check: FAILURES above"
exit "$status"
