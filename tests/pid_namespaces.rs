//! A consumer in another pid namespace (containers sharing one `/dev/shm`: Docker's `--ipc=host`,
//! pods sharing a memory volume). Its producer's pid names nothing there — or another process —
//! so every liveness question across processes is answered by locks, never by `kill(pid, 0)`.
//! Where the machine refuses a new pid namespace, each test says it skipped and why.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{ipc::IpcHandle, Runtime, Storage};

const CHILD: &str = "namespaced_child";

fn runtime() -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(test_config(""))
            .build(Arc::new(host_driver()))
            .unwrap(),
    )
}

/// A storage written on a stream of its own and shared before that stream finished: the handle
/// carries the producer's event, which the consumer's stream waits for.
fn shared_storage(rt: &Arc<Runtime>, seed: u64) -> (Storage, IpcHandle) {
    let stream = rt.create_stream(0).unwrap();
    let _on = rt.set_current_stream(stream).unwrap();
    let s = Storage::new(rt, 0, 4 << 20).unwrap();
    s.fill_pattern(seed).unwrap();
    let h = s.share_ipc().unwrap();
    (s, h)
}

fn namespaced_consumer(test: &str) -> Option<ChildProcess> {
    match ChildProcess::spawn_in_pid_namespace(CHILD, "consumer", "host") {
        Ok(c) => Some(c),
        Err(why) => {
            println!("{test} [host]: skipped: {why}");
            None
        }
    }
}

#[test]
fn a_consumer_in_another_pid_namespace_waits_for_a_live_producer() {
    let Some(mut consumer) =
        namespaced_consumer("a_consumer_in_another_pid_namespace_waits_for_a_live_producer")
    else {
        return;
    };
    assert_eq!(
        consumer.recv(),
        "pid 1",
        "the consumer is not pid 1 of a new namespace"
    );
    let rt = runtime();
    let (s, h) = shared_storage(&rt, 21);
    consumer.send(&format!("open 21 {}", hex(&h.into_bytes())));
    // Before: "its producer (pid …) exited before its writes completed" — the producer's pid
    // named nobody in the consumer's namespace.
    assert_eq!(consumer.recv(), "mismatches=0");
    drop(s);
    assert_eq!(rt.ipc_limbo().0, 1, "the consumer holds it");
    // The other way: the namespaced process produces (its objects carry its namespace's pid, 1),
    // the producer's sweep runs, and its storage opens here and holds its bytes.
    rt.ipc_collect();
    consumer.send("make 23");
    let made = consumer.recv();
    assert!(made.starts_with("handle "), "{made}");
    let h2 = IpcHandle::from_bytes(&unhex(&made["handle ".len()..])).unwrap();
    rt.ipc_collect();
    let theirs = Storage::from_ipc(&rt, h2).unwrap();
    assert_eq!(theirs.count_pattern_mismatches(23).unwrap(), 0);
    drop(theirs);
    consumer.send("release");
    assert_eq!(consumer.recv(), "released");
    consumer.finish();
    rt.ipc_collect();
    assert_eq!(rt.ipc_limbo(), (0, 0));
}

#[test]
fn a_killed_consumer_in_another_pid_namespace_is_reclaimed_by_its_locks() {
    let Some(mut consumer) =
        namespaced_consumer("a_killed_consumer_in_another_pid_namespace_is_reclaimed_by_its_locks")
    else {
        return;
    };
    assert_eq!(consumer.recv(), "pid 1");
    let rt = runtime();
    let (s, h) = shared_storage(&rt, 22);
    consumer.send(&format!("open 22 {}", hex(&h.into_bytes())));
    assert_eq!(consumer.recv(), "mismatches=0");
    drop(s);
    rt.ipc_collect();
    assert_eq!(
        rt.ipc_limbo().0,
        1,
        "a live holder in another namespace keeps it"
    );
    consumer.send("pid");
    let outer: i32 = consumer.recv().parse().unwrap();
    // SAFETY: kill has no memory preconditions; `outer` is the consumer (our grandchild).
    assert_eq!(unsafe { libc::kill(outer, libc::SIGKILL) }, 0);
    // `unshare` waits for its child: once it exits, the consumer is gone with its locks.
    let _ = consumer.wait();
    let stats = rt.ipc_collect();
    assert_eq!((stats.storages, stats.from_dead_consumers), (1, 1));
    assert_eq!(rt.ipc_limbo(), (0, 0));
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn namespaced_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    assert_eq!(role, "consumer");
    let mut parent = ParentLink::new();
    parent.send(&format!("pid {}", std::process::id()));
    let rt = runtime();
    let mut held = None;
    let mut made = Vec::new();
    while let Some(line) = parent.recv_or_eof() {
        let (cmd, arg) = line.split_once(' ').unwrap_or((line.as_str(), ""));
        match cmd {
            "open" => {
                let (seed, bytes) = arg.split_once(' ').unwrap();
                let h = IpcHandle::from_bytes(&unhex(bytes)).unwrap();
                match Storage::from_ipc(&rt, h) {
                    Ok(s) => {
                        let bad = s.count_pattern_mismatches(seed.parse().unwrap()).unwrap();
                        parent.send(&format!("mismatches={bad}"));
                        held = Some(s);
                    }
                    Err(e) => parent.send(&format!("error {e}")),
                }
            }
            "make" => {
                let (s, h) = shared_storage(&rt, arg.parse().unwrap());
                parent.send(&format!("handle {}", hex(&h.into_bytes())));
                made.push(s);
            }
            "pid" => {
                // `/proc` is the parent namespace's: `/proc/self` names this process there.
                let outer = std::fs::read_link("/proc/self").unwrap();
                parent.send(&outer.display().to_string());
            }
            "release" => {
                held = None;
                parent.send("released");
            }
            other => panic!("unknown command {other}"),
        }
    }
    drop((held, made));
}
