"""A foreign NIXL peer: a program on the `nixl` wheel's public Python API only (no cudalloc),
driven line by line over stdin/stdout by `tests/nixl_foreign.rs`.

Commands (binary values in hex):
  META <hex>            load the other agent's metadata (NIXL's own form), replacing an earlier
                        copy; answers `OK <name>`
  READ <seed> <hex>     read the storage the pickled descriptor list names into a buffer of ours and
                        count the bytes that differ from the pattern of <seed>; answers
                        `READ <mismatches>` (the transfer notifies "read-done")
  WRITE <seed> <hex>    write the pattern of <seed> into that storage; answers `WROTE` (notifies
                        "write-done")
  OFFER <len> <seed>    register a buffer of ours filled with the pattern of <seed>; answers
                        `OFFER <hex of our descriptor list>` and then `META <hex of our metadata>`
  CHECK <seed>          count the bytes of the offered buffer that differ from the pattern of
                        <seed>; answers `CHECK <mismatches>`
  RELEASE <id>          tell the other agent we are done with its offer <id> (the notification
                        `cudalloc-release:<id>`); answers `RELEASED`
  SENDMD <ip> <port>    send our metadata to the NIXL listener there (NIXL's socket exchange);
                        answers `SENT`
  WAITMD <name>         wait for agent <name>'s metadata to reach our listener (started with a port
                        as second argument); answers `OK <name>`
  BENCH <reps> <hex>    read the storages the list names into one buffer of ours <reps> times with
                        one transfer handle; answers `BENCH <seconds>` (the transfers alone)
  QUIT
At start it prints `META <hex of its metadata>`. Errors are answered `ERR <message>`.

The wheel's `deserialize_descs` is `pickle.loads`: a program like this one must take descriptor
lists only from a peer it trusts (here, the test that started it).
"""

import os
import sys
import time

# The answers go to the original stdout; everything else written there (NIXL's and UCX's logs,
# from Python or C) goes to stderr.
ANSWERS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import numpy as np  # noqa: E402
from nixl_cu12._api import nixl_agent, nixl_agent_config  # noqa: E402

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)


def pattern(seed, n):
    """cudalloc's pattern bytes (src/driver/pattern.rs), the same function written again."""
    words = (n + 7) // 8
    with np.errstate(over="ignore"):
        w = np.arange(words, dtype=np.uint64)
        z = np.uint64(seed) + w * GOLDEN
        z = (z ^ (z >> np.uint64(30))) * M1
        z = (z ^ (z >> np.uint64(27))) * M2
        z = z ^ (z >> np.uint64(31))
    return z.astype("<u8").view(np.uint8)[:n]


def say(line):
    ANSWERS.write(line + "\n")
    ANSWERS.flush()


def main():
    name = sys.argv[1]
    # An optional second argument: run NIXL's metadata listener on that port.
    listen = int(sys.argv[2]) if len(sys.argv) > 2 else None
    config = (
        nixl_agent_config(backends=["UCX"], enable_listen_thread=True, listen_port=listen)
        if listen
        else nixl_agent_config(backends=["UCX"])
    )
    agent = nixl_agent(name, config)
    say("META " + agent.get_agent_metadata().hex())
    remote = None
    offered = None
    bench = None
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            cmd = words[0]
            if cmd == "QUIT":
                break
            if cmd == "META":
                if remote is not None:
                    # NIXL keeps the first copy of a peer's metadata: drop it, load the new one.
                    agent.remove_remote_agent(remote)
                remote = agent.add_remote_agent(bytes.fromhex(words[1]))
                if isinstance(remote, bytes):
                    remote = remote.decode()
                say("OK " + remote)
            elif cmd == "RELEASE":
                agent.send_notif(remote, b"cudalloc-release:" + words[1].encode())
                say("RELEASED")
            elif cmd == "SENDMD":
                agent.send_local_metadata(words[1], int(words[2]))
                say("SENT")
            elif cmd == "WAITMD":
                deadline = time.time() + 60
                while not agent.check_remote_metadata(words[1]) and time.time() < deadline:
                    time.sleep(0.001)
                if agent.check_remote_metadata(words[1]):
                    remote = words[1]
                    say("OK " + remote)
                else:
                    say("ERR no metadata from " + words[1])
            elif cmd in ("READ", "WRITE"):
                seed = int(words[1])
                descs = agent.deserialize_descs(bytes.fromhex(words[2]))
                lengths = [descs[i][1] for i in range(descs.descCount())]
                total = sum(lengths)
                buf = pattern(seed, total).copy() if cmd == "WRITE" else np.zeros(total, np.uint8)
                base = buf.ctypes.data
                reg = agent.register_memory([(base, total, 0, "")], "DRAM")
                local, at = [], 0
                for n in lengths:
                    local.append((base + at, n, 0))
                    at += n
                local = agent.get_xfer_descs(local, "DRAM")
                done = b"read-done" if cmd == "READ" else b"write-done"
                handle = agent.initialize_xfer(cmd, local, descs, remote, done)
                state = agent.transfer(handle)
                deadline = time.time() + 60
                while state not in ("DONE", "ERR") and time.time() < deadline:
                    state = agent.check_xfer_state(handle)
                agent.release_xfer_handle(handle)
                agent.deregister_memory(reg)
                if state != "DONE":
                    say("ERR transfer " + state)
                elif cmd == "READ":
                    say("READ %d" % int(np.count_nonzero(buf != pattern(seed, total))))
                else:
                    say("WROTE")
            elif cmd == "BENCH":
                reps = int(words[1])
                if bench is None or bench[0] != words[2]:
                    # Set up once per list: a buffer of ours with its pages touched, registered,
                    # and one transfer handle (what a serving loop keeps).
                    descs = agent.deserialize_descs(bytes.fromhex(words[2]))
                    lengths = [descs[i][1] for i in range(descs.descCount())]
                    buf = np.ones(sum(lengths), np.uint8)
                    base = buf.ctypes.data
                    reg = agent.register_memory([(base, len(buf), 0, "")], "DRAM")
                    local, at = [], 0
                    for n in lengths:
                        local.append((base + at, n, 0))
                        at += n
                    local = agent.get_xfer_descs(local, "DRAM")
                    handle = agent.initialize_xfer("READ", local, descs, remote)
                    bench = (words[2], buf, reg, handle)
                handle = bench[3]
                took = 0.0
                failed = None
                for _ in range(reps):
                    started = time.perf_counter()
                    state = agent.transfer(handle)
                    while state not in ("DONE", "ERR"):
                        state = agent.check_xfer_state(handle)
                    took += time.perf_counter() - started
                    if state != "DONE":
                        failed = state
                        break
                say("ERR transfer " + failed if failed else "BENCH %.9f" % took)
            elif cmd == "OFFER":
                n, seed = int(words[1]), int(words[2])
                buf = pattern(seed, n).copy()
                reg = agent.register_memory([(buf.ctypes.data, n, 0, "")], "DRAM")
                offered = (buf, reg)
                descs = agent.get_xfer_descs([(buf.ctypes.data, n, 0)], "DRAM")
                say("OFFER " + agent.get_serialized_descs(descs).hex())
                say("META " + agent.get_agent_metadata().hex())
            elif cmd == "CHECK":
                buf = offered[0]
                say("CHECK %d" % int(np.count_nonzero(buf != pattern(int(words[1]), len(buf)))))
            else:
                say("ERR unknown command " + cmd)
        except Exception as e:  # noqa: BLE001 - every failure is the driver's to judge
            say("ERR %s: %s" % (type(e).__name__, str(e).replace("\n", " ")))


if __name__ == "__main__":
    main()
