#!/usr/bin/env python3
"""Checks that a cudalloc snapshot pickle (Snapshot::to_pytorch_pickle, or the file written on
out-of-memory with CUDALLOC_CONF=oom_snapshot_path:FILE) has the layout PyTorch's memory tools read:
the invariants torch.cuda._memory_viz asserts (block sizes add up to their segment; allocated,
internal and external free bytes add up to what is reserved), PyTorch's states and actions, frames
of {filename, line, name}, frees that follow their allocations, time that does not go back.
Where `import torch` works, it also runs torch.cuda._memory_viz's segsum, trace, trace_plot and
segment_plot on it; without torch, CUDALLOC_MEMORY_VIZ may name a copy of PyTorch's
torch/cuda/_memory_viz.py (it needs only the standard library), e.g. taken from a torch wheel.

Usage: scripts/check_snapshot.py FILE      (exit 0: valid; 1: a violation, printed)
"""
import pickle
import sys

STATES = {"active_allocated", "active_pending_free", "inactive"}
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot"}


def fail(message):
    print(f"check_snapshot: {message}")
    sys.exit(1)


def check_frames(frames, where):
    if not isinstance(frames, list):
        fail(f"{where}: frames is not a list")
    for f in frames:
        if set(f) != {"filename", "line", "name"}:
            fail(f"{where}: frame keys {sorted(f)}")
        if not (isinstance(f["filename"], str) and isinstance(f["line"], int)
                and isinstance(f["name"], str)):
            fail(f"{where}: frame types {f}")


def check_segments(data):
    for i, seg in enumerate(data["segments"]):
        where = f"segments[{i}]"
        for key in ("device", "address", "total_size", "allocated_size", "active_size",
                    "requested_size", "stream", "segment_type", "blocks"):
            if key not in seg:
                fail(f"{where}: no {key}")
        if seg["segment_type"] not in ("small", "large"):
            fail(f"{where}: segment_type {seg['segment_type']!r}")
        blocks = seg["blocks"]
        sizes = sum(b["size"] for b in blocks)
        if sizes != seg["total_size"]:
            fail(f"{where}: blocks add up to {sizes}, total_size is {seg['total_size']}")
        allocated = free_internal = free_external = 0
        end = None
        for j, b in enumerate(blocks):
            bw = f"{where}.blocks[{j}]"
            if b["state"] not in STATES:
                fail(f"{bw}: state {b['state']!r}")
            if b["requested_size"] > b["size"]:
                fail(f"{bw}: requested {b['requested_size']} > size {b['size']}")
            if end is not None and b["address"] < end:
                fail(f"{bw}: overlaps the block before")
            if not seg.get("is_expandable") and end is not None and b["address"] != end:
                fail(f"{bw}: a gap in a whole segment")
            end = b["address"] + b["size"]
            check_frames(b["frames"], bw)
            if b["state"] == "active_allocated":
                allocated += b["requested_size"]
                free_internal += b["size"] - b["requested_size"]
            else:
                free_external += b["size"]
        if blocks and blocks[0]["address"] != seg["address"] and not seg.get("is_expandable"):
            fail(f"{where}: the first block is not at the segment's address")
        # _memory_viz.segsum's assertion.
        if free_external + free_internal + allocated != seg["total_size"]:
            fail(f"{where}: free + allocated != total_size")
        active_allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        if active_allocated != seg["allocated_size"]:
            fail(f"{where}: allocated_size {seg['allocated_size']} != {active_allocated}")
        active = sum(b["size"] for b in blocks if b["state"] != "inactive")
        if active != seg["active_size"]:
            fail(f"{where}: active_size {seg['active_size']} != {active}")


def check_traces(data):
    devices = {seg["device"] for seg in data["segments"]}
    if devices and max(devices) >= len(data["device_traces"]):
        fail("a segment's device has no device_traces list")
    for d, entries in enumerate(data["device_traces"]):
        state = {}  # addr -> "live" | "requested"
        last_time = None
        for k, e in enumerate(entries):
            where = f"device_traces[{d}][{k}]"
            for key in ("action", "addr", "size", "stream", "time_us", "frames"):
                if key not in e:
                    fail(f"{where}: no {key}")
            action, addr = e["action"], e["addr"]
            if action not in ACTIONS:
                fail(f"{where}: action {action!r}")
            check_frames(e["frames"], where)
            if last_time is not None and e["time_us"] < last_time:
                fail(f"{where}: time goes back")
            last_time = e["time_us"]
            if action == "oom" and "device_free" not in e:
                fail(f"{where}: an oom without device_free")
            if action == "alloc":
                if state.get(addr) in ("live", "requested"):
                    fail(f"{where}: {addr:#x} allocated twice without a free")
                state[addr] = "live"
            elif action == "free_requested":
                if state.get(addr) == "requested":
                    fail(f"{where}: {addr:#x} freed twice")
                # live -> requested; unknown (allocated before history began) -> requested
                state[addr] = "requested"
            elif action == "free_completed":
                # Allocated before history began: a free without an alloc is allowed.
                state.pop(addr, None)


def main():
    if len(sys.argv) != 2:
        fail("usage: check_snapshot.py FILE")
    with open(sys.argv[1], "rb") as f:
        data = pickle.load(f)
    for key in ("segments", "device_traces"):
        if key not in data:
            fail(f"no {key}")
    check_segments(data)
    check_traces(data)
    entries = sum(len(t) for t in data["device_traces"])
    print(f"check_snapshot: valid ({len(data['segments'])} segments, {entries} trace entries)")
    viz = memory_viz()
    if viz is None:
        return
    viz.segsum(data)
    viz.trace(data)
    viz.trace_plot(data)
    viz.segment_plot(data)
    print("check_snapshot: torch.cuda._memory_viz segsum, trace, trace_plot and segment_plot ran")


def memory_viz():
    """PyTorch's _memory_viz module: from torch, or from the file CUDALLOC_MEMORY_VIZ names."""
    import os
    path = os.environ.get("CUDALLOC_MEMORY_VIZ")
    if path:
        import importlib.util
        spec = importlib.util.spec_from_file_location("_memory_viz", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        from torch.cuda import _memory_viz
        return _memory_viz
    except Exception as err:  # noqa: BLE001 - any import failure means: no torch here
        print(f"check_snapshot: torch.cuda._memory_viz: skipped (no torch: {err}; "
              "CUDALLOC_MEMORY_VIZ may name a copy of _memory_viz.py)")
        return None


if __name__ == "__main__":
    main()
