#!/usr/bin/env bash
# The CUDA evidence of cudalloc, for a machine with a GPU.
#
#   scripts/gpu-check.sh --prepare   on a machine with cargo and the registry: builds every test
#                                    binary into target/gpu-bin/ (carry that folder to the GPU box,
#                                    which may have no network to fetch crates).
#   scripts/gpu-check.sh             on the GPU machine: builds the tests if cargo can, else uses
#                                    target/gpu-bin/; finds NVRTC; runs every suite with the CUDA
#                                    backend present and prints a table. Exit code 1 if anything failed
#                                    or a CUDA case was skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
bin_dir=target/gpu-bin

prepare() {
  mkdir -p "$bin_dir"
  cargo test --release --no-run --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    try: msg = json.loads(line)
    except ValueError: continue
    exe = msg.get("executable")
    if msg.get("reason") == "compiler-artifact" and exe and msg["target"]["kind"] != ["bin"]:
        name = msg["target"]["name"] + ("-lib" if "lib" in msg["target"]["kind"] else "")
        shutil.copy(exe, os.path.join(sys.argv[1], name)); print("prepared", name)
' "$bin_dir"
}

if [ "${1:-}" = "--prepare" ]; then
  prepare
  exit 0
fi

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi not available"

# NVRTC: the CUDA toolkit, or the nvidia-cuda-nvrtc-cu12 wheel that PyTorch installs.
nvrtc_dir=$(python3 -c 'import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null \
  || dirname "$(find / -name 'libnvrtc.so*' -not -path '*/proc/*' 2>/dev/null | head -n 1)" 2>/dev/null || true)
if [ -n "$nvrtc_dir" ] && [ -d "$nvrtc_dir" ]; then
  export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "NVRTC: $nvrtc_dir"
else
  echo "NVRTC: not found (kernel tests will fail on CUDA)"
fi

if command -v cargo >/dev/null 2>&1 && cargo test --release --no-run >/dev/null 2>&1; then
  echo "== building test binaries with cargo"
  prepare >/dev/null
fi
[ -d "$bin_dir" ] || { echo "no test binaries: run scripts/gpu-check.sh --prepare first"; exit 1; }

export CUDALLOC_BACKEND=cuda
log=$(mktemp)
status=0
printf '\n%-58s %s\n' "test" "result"
for exe in "$bin_dir"/*; do
  suite=$(basename "$exe")
  if ! "$exe" --test-threads=1 --nocapture >"$log" 2>&1; then status=1; fi
  grep -E '^test .* \.\.\. ' "$log" | sed -E 's/^test (.*) \.\.\. (.*)$/\1|\2/' \
    | while IFS='|' read -r name result; do printf '%-58s %s\n' "$suite::$name" "$result"; done
  if grep -q 'skipped: no CUDA driver' "$log"; then
    echo "  ^ $suite: a CUDA case was skipped on a GPU machine"; status=1
  fi
  grep -E 'panicked|FAILED|test result' "$log" | sed 's/^/  /'
done
rm -f "$log"
echo
[ "$status" -eq 0 ] && echo "gpu-check: all CUDA evidence passed" || echo "gpu-check: FAILURES above"
exit "$status"
