"""PyTorch side of scripts/gpu-check.sh: medians of torch's caching allocator pair
(`caching_allocator_alloc` / `caching_allocator_delete`), of `torch.empty` + `del`, of the same
pair on CUDA's stream-ordered allocator (`PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`, in a
child process: the backend is chosen once per process) and of its CUDA IPC round trip
(reduce_tensor / rebuild_cuda_tensor in a child process), printed as `torch <case> <median ns>`
lines that gpu-check.sh puts beside ours. Needs a GPU and PyTorch."""
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


def pair_ns(size, reps=200_000):
    stream = torch.cuda.current_stream()
    ptr = torch.cuda.caching_allocator_alloc(size, stream=stream)
    torch.cuda.caching_allocator_delete(ptr)
    samples = []
    for _ in range(10):
        start = time.perf_counter_ns()
        for _ in range(reps // 10):
            p = torch.cuda.caching_allocator_alloc(size, stream=stream)
            torch.cuda.caching_allocator_delete(p)
        samples.append((time.perf_counter_ns() - start) / (reps // 10))
    return statistics.median(samples)


def empty_ns(size, reps=200_000):
    t = torch.empty(size, dtype=torch.uint8, device="cuda")
    del t
    samples = []
    for _ in range(10):
        start = time.perf_counter_ns()
        for _ in range(reps // 10):
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            del t
        samples.append((time.perf_counter_ns() - start) / (reps // 10))
    return statistics.median(samples)


SIZES = (512, 65536, 1 << 20, 16 << 20, 64 << 20)


def consumer(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        rebuild, args = msg
        t = rebuild(*args)
        conn.send(int(t[0].item()))
        del t


def ipc_round_trip_ns(reps=2000):
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=consumer, args=(child,))
    proc.start()
    t = torch.full((1024,), 42, dtype=torch.uint8, device="cuda")
    samples = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        parent.send(reduce_tensor(t))
        assert parent.recv() == 42
        samples.append(time.perf_counter_ns() - start)
    parent.send(None)
    proc.join()
    torch.cuda.ipc_collect()
    return statistics.median(samples)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("torch: skipped: no CUDA device")
        sys.exit(0)
    if sys.argv[1:] == ["--async"]:
        for size in SIZES:
            print(f"torch async_pair/{size} {pair_ns(size):.1f}")
        sys.exit(0)
    for size in SIZES:
        print(f"torch pair/{size} {pair_ns(size):.1f}")
        print(f"torch empty/{size} {empty_ns(size):.1f}")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    child = subprocess.run([sys.executable, __file__, "--async"], env=env,
                           capture_output=True, text=True, timeout=300)
    print(child.stdout, end="")
    if child.returncode != 0:
        print(f"torch async: failed: {child.stderr.strip()[-300:]}")
    print(f"torch round_trip {ipc_round_trip_ns():.1f}")
