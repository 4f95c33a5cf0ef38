#!/usr/bin/env bash
# Instructions per cached allocate + free pair (the host backend, no default features, as a
# tensor library builds cudalloc): callgrind over 10,000 and 20,000 pairs, the difference over
# 10,000, for each size given (default: 512 B, 1 MiB, 64 MiB). Deterministic: the machine's load
# does not move it. Built with one codegen unit: with the default sixteen, where the compiler
# happens to cut the crate moves the count by ±1 % between commits that do not touch the path.
# Needs valgrind.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 CARGO_TARGET_DIR=target/pair-instructions
cargo build --quiet --release --no-default-features --example cached_pair
exe=target/pair-instructions/release/examples/cached_pair
count() { valgrind --tool=callgrind --callgrind-out-file=/dev/null "$exe" "$1" "$2" 2>&1 \
  | awk '/Collected/ {print $4}'; }
for size in "${@:-512 1048576 67108864}"; do
  for s in $size; do
    a=$(count 10000 "$s"); b=$(count 20000 "$s")
    echo "pair/$s: $(( (b - a) / 10000 )) instructions"
  done
done
