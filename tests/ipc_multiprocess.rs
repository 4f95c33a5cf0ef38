//! Cross-process sharing on the host backend: ports of PyTorch's `test_multiprocessing.py` CUDA IPC
//! tests (named after them) and our own leak cases. Children are this test binary re-executed; they
//! talk to the parent over stdin/stdout lines, handles travel as hex. Every test ends with a
//! /dev/shm leak check of the producer's objects.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{backend::Driver, ipc::IpcHandle, Runtime, Storage};

const CHILD: &str = "ipc_child";

fn producer() -> (Arc<Runtime>, String) {
    producer_on(test_backend())
}

/// A producer allocator on `backend`; the prefix of its host objects ("" on CUDA).
fn producer_on(backend: &str) -> (Arc<Runtime>, String) {
    let (d, prefix): (Arc<dyn Driver>, String) = match backend {
        "cuda" => (child_driver("cuda"), String::new()),
        _ => {
            let driver = Arc::new(host_driver());
            let prefix = driver.shm_name_prefix();
            (driver, prefix)
        }
    };
    let a = Runtime::builder()
        .config(test_config(""))
        .ipc_slots_per_file(64)
        .build(d)
        .unwrap();
    (Arc::new(a), prefix)
}

/// The backends the ported tests run on: host, and CUDA when a driver and a device exist.
fn ipc_backends(test: &str) -> Vec<&'static str> {
    if cuda_suite() {
        return vec!["cuda"];
    }
    let mut out = vec!["host"];
    if cuda_present(test) {
        out.push("cuda");
    }
    out
}

fn pid_prefix() -> String {
    format!("cudalloc-{}-", std::process::id())
}

fn send(h: IpcHandle) -> String {
    hex(&h.into_bytes())
}

fn receive(a: &Arc<Runtime>, text: &str) -> Storage {
    let bytes = unhex(text);
    Storage::from_ipc(a, IpcHandle::from_bytes(&bytes).unwrap()).unwrap()
}

/// Everything the producer made is gone once its allocator and driver are gone.
fn assert_no_leaks(a: Arc<Runtime>, prefix: &str) {
    assert_eq!(a.ipc_limbo(), (0, 0), "limbo not empty");
    drop(a);
    if prefix.is_empty() {
        return; // CUDA backend: no host objects besides ref files, checked by the limbo
    }
    assert!(
        shm_names_with_prefix(prefix).is_empty(),
        "host objects left: {:?}",
        shm_names_with_prefix(prefix)
    );
    let refs: Vec<_> = shm_names_with_prefix(&pid_prefix())
        .into_iter()
        .filter(|n| n.contains("-ref"))
        .collect();
    assert!(
        refs.is_empty() || refs.iter().all(|n| !n.contains(&prefix[9..])),
        "ref files left: {refs:?}"
    );
}

#[test]
fn test_cuda_simple() {
    for backend in ipc_backends("test_cuda_simple") {
        let (a, prefix) = producer_on(backend);
        let s = Storage::new(&a, 0, 1 << 20).unwrap();
        s.fill_pattern(11).unwrap();
        let mut child = ChildProcess::spawn(CHILD, "simple", backend);
        let handle = s.share_ipc().unwrap();
        assert_eq!(
            handle.wire().pages.is_some(),
            expandable_run(),
            "an expandable run shares pages, a plain run whole segments"
        );
        child.send(&send(handle));
        assert_eq!(child.recv(), "verified mismatches=0");
        child.send("done");
        child.finish();
        assert_eq!(
            s.count_pattern_mismatches(12).unwrap(),
            0,
            "the consumer's answer is visible"
        );
        drop(s);
        a.ipc_collect();
        assert_no_leaks(a, &prefix);
    }
}

#[test]
fn test_cuda_small_tensors() {
    for backend in ipc_backends("test_cuda_small_tensors") {
        // Five storages carved from one 2 MiB segment, sent in one message: one mapping opened.
        let (a, prefix) = producer_on(backend);
        let storages: Vec<_> = (0..5u64)
            .map(|i| Storage::new(&a, 0, 1000 + i * 100).unwrap())
            .collect();
        for (i, s) in storages.iter().enumerate() {
            s.fill_pattern(100 + i as u64).unwrap();
        }
        assert_eq!(a.snapshot().segments.len(), 1);
        let line: Vec<String> = storages
            .iter()
            .map(|s| send(s.share_ipc().unwrap()))
            .collect();
        let mut child = ChildProcess::spawn(CHILD, "small_tensors", backend);
        child.send(&line.join(" "));
        assert_eq!(child.recv(), "ok mappings=1");
        child.finish();
        drop(storages);
        a.ipc_collect();
        assert_no_leaks(a, &prefix);
    }
}

#[test]
fn test_event() {
    for backend in ipc_backends("test_event") {
        // The producer's write is queued behind a sleep; the consumer sees it only thanks to the event.
        let (a, prefix) = producer_on(backend);
        let s = Storage::new(&a, 0, 4 << 20).unwrap();
        s.fill_pattern(1).unwrap();
        a.driver()
            .kernels()
            .sleep(a.default_stream(0).unwrap(), 300_000)
            .unwrap();
        s.fill_pattern(2).unwrap();
        let mut child = ChildProcess::spawn(CHILD, "event", backend);
        child.send(&send(s.share_ipc().unwrap()));
        assert_eq!(child.recv(), "mismatches=0");
        child.finish();
        drop(s);
        a.ipc_collect();
        assert_no_leaks(a, &prefix);
    }
}

#[test]
fn test_empty_storage_sharing() {
    for backend in ipc_backends("test_empty_storage_sharing") {
        let (a, prefix) = producer_on(backend);
        let s = Storage::new(&a, 0, 0).unwrap();
        let mut child = ChildProcess::spawn(CHILD, "empty", backend);
        child.send(&send(s.share_ipc().unwrap()));
        assert_eq!(child.recv(), "empty nbytes=0");
        child.finish();
        assert_no_leaks(a, &prefix);
    }
}

#[test]
fn test_mixed_types_cuda_sharing() {
    for backend in ipc_backends("test_mixed_types_cuda_sharing") {
        // Same segment, different offsets, 10 rounds of share / verify / release.
        let (a, prefix) = producer_on(backend);
        let storages: Vec<_> = [512u64, 4096, 777]
            .iter()
            .map(|&n| Storage::new(&a, 0, n).unwrap())
            .collect();
        let mut child = ChildProcess::spawn(CHILD, "rounds", backend);
        for round in 0..10u64 {
            for (i, s) in storages.iter().enumerate() {
                s.fill_pattern(round * 10 + i as u64).unwrap();
            }
            let line: Vec<String> = storages
                .iter()
                .map(|s| send(s.share_ipc().unwrap()))
                .collect();
            child.send(&format!("{round} {}", line.join(" ")));
            assert_eq!(child.recv(), format!("round {round} ok"));
        }
        child.send("stop");
        child.finish();
        drop(storages);
        a.ipc_collect();
        assert_no_leaks(a, &prefix);
    }
}

#[test]
fn producer_drop_goes_to_limbo_and_consumer_release_drains_it() {
    let (a, prefix) = producer();
    let s = Storage::new(&a, 0, 1 << 20).unwrap();
    s.fill_pattern(11).unwrap();
    let mut child = ChildProcess::spawn(CHILD, "simple", test_backend());
    child.send(&send(s.share_ipc().unwrap()));
    assert_eq!(child.recv(), "verified mismatches=0");
    drop(s); // the consumer still holds it
    assert_eq!(a.ipc_limbo().0, 1);
    assert_eq!(
        a.memory_stats(0).unwrap().allocation.all.current,
        1,
        "limbo keeps the block allocated"
    );
    child.send("done");
    child.finish();
    assert!(a.ipc_collect().storages > 0);
    assert_eq!(a.memory_stats(0).unwrap().allocation.all.current, 0);
    assert_no_leaks(a, &prefix);
}

#[test]
fn a_sigkilled_consumer_holding_100_storages_is_reclaimed() {
    let (a, prefix) = producer();
    let storages: Vec<_> = (0..100)
        .map(|_| Storage::new(&a, 0, 4096).unwrap())
        .collect();
    let line: Vec<String> = storages
        .iter()
        .map(|s| send(s.share_ipc().unwrap()))
        .collect();
    let mut child = ChildProcess::spawn(CHILD, "hold", test_backend());
    child.send(&line.join(" "));
    assert_eq!(child.recv(), "holding 100");
    drop(storages);
    assert_eq!(a.ipc_limbo().0, 100);
    assert_eq!(
        a.ipc_collect().storages,
        0,
        "live holders: nothing to reclaim"
    );
    child.kill();
    let freed = a.ipc_collect();
    assert_eq!(freed.storages, 100);
    assert_eq!(freed.from_dead_consumers, 100);
    assert_eq!(a.memory_stats(0).unwrap().allocation.all.current, 0);
    assert_no_leaks(a, &prefix);
}

#[test]
fn a_handle_dropped_unopened_gives_its_count_back() {
    let (a, prefix) = producer();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let mut child = ChildProcess::spawn(CHILD, "drop_unopened", test_backend());
    child.send(&send(s.share_ipc().unwrap()));
    assert_eq!(child.recv(), "dropped");
    child.finish();
    drop(s);
    assert_eq!(a.ipc_limbo().0, 0, "freed at once: nobody counts on it");
    // And a handle the producer never sent gives its count back too.
    let t = Storage::new(&a, 0, 4096).unwrap();
    drop(t.share_ipc().unwrap());
    drop(t);
    assert_eq!(a.ipc_limbo().0, 0);
    assert_no_leaks(a, &prefix);
}

#[test]
fn the_consumer_survives_a_producer_that_exits_first() {
    let (a, prefix) = producer();
    let mut child = ChildProcess::spawn(CHILD, "outlive", test_backend());
    {
        let s = Storage::new(&a, 0, 8192).unwrap();
        s.fill_pattern(5).unwrap();
        child.send(&send(s.share_ipc().unwrap()));
        assert_eq!(child.recv(), "got it");
        drop(s);
        drop(a); // warns: one storage still counted by a consumer
    }
    let _ = prefix;
    child.send("producer gone");
    assert_eq!(child.recv(), "released mismatches=0");
    child.finish();
}

#[test]
fn same_process_receipt_returns_the_original_storage() {
    let (a, _) = producer();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let bytes = s.share_ipc().unwrap().into_bytes();
    let back = Storage::from_ipc(&a, IpcHandle::from_bytes(&bytes).unwrap()).unwrap();
    assert!(back.is_alias_of(&s));
    drop((s, back));
    assert_eq!(a.ipc_limbo().0, 0);
}

#[test]
fn test_cuda_send_many() {
    // A chain p1 -> p2 -> p3: p2 forwards what it receives (adding to the original slot's count),
    // p3 sums. Afterwards the limbo is empty and no ref-counter file is left.
    const N: usize = 100_000;
    let (a, prefix) = producer();
    let mut p2 = ChildProcess::spawn(CHILD, "forward", test_backend());
    let mut p3 = ChildProcess::spawn(CHILD, "sum", test_backend());
    let mut expected = 0u64;
    for chunk in 0..(N / 100) {
        let storages: Vec<_> = (0..100)
            .map(|_| Storage::new(&a, 0, 512).unwrap())
            .collect();
        let mut line = Vec::new();
        for (i, s) in storages.iter().enumerate() {
            let value = (chunk * 100 + i) as u8;
            s.copy_from_host(s.runtime().current_stream(s.device()).unwrap(), 0, &[value])
                .unwrap();
            expected += u64::from(value);
            line.push(send(s.share_ipc().unwrap()));
        }
        p2.send(&line.join(" "));
        let forwarded = p2.recv();
        p3.send(&forwarded);
        assert_eq!(p3.recv(), "ok");
        p2.send("release");
        assert_eq!(p2.recv(), "released");
    }
    p3.send("total");
    assert_eq!(p3.recv(), format!("sum={expected}"));
    p2.send("stop");
    p3.send("stop");
    p2.finish();
    p3.finish();
    a.ipc_collect();
    assert_no_leaks(a, &prefix);
}

#[test]
fn test_cuda_ipc_deadlock() {
    // A bounded channel (one message in flight, the line protocol waits for each answer), 100
    // iterations of share / receive / release while the producer frees and drains. A watchdog
    // kills the child after 60 s (a hang, not a slow machine), which fails the test instead of
    // hanging CI.
    let (a, prefix) = producer();
    let mut child = ChildProcess::spawn(CHILD, "echo", test_backend());
    let pid = child.pid();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        std::thread::spawn(move || {
            for _ in 0..600 {
                std::thread::sleep(std::time::Duration::from_millis(100));
                if done.load(std::sync::atomic::Ordering::SeqCst) {
                    return false;
                }
            }
            // The standard library cannot signal a process by pid: use kill(1).
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
            true
        })
    };
    for i in 0..100u64 {
        let s = Storage::new(&a, 0, 4096).unwrap();
        s.fill_pattern(i).unwrap();
        child.send(&format!("{i} {}", send(s.share_ipc().unwrap())));
        drop(s);
        assert_eq!(child.recv(), format!("{i} ok"));
        a.ipc_drain();
    }
    child.send("stop");
    child.finish();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(
        !watchdog.join().unwrap(),
        "watchdog fired: the exchange deadlocked"
    );
    a.ipc_collect();
    assert_no_leaks(a, &prefix);
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn ipc_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let a = Arc::new(Runtime::new(child_test_driver(), Default::default()).unwrap());
    let mut parent = ParentLink::new();
    match role.as_str() {
        "simple" => {
            let s = receive(&a, &parent.recv());
            parent.send(&format!(
                "verified mismatches={}",
                s.count_pattern_mismatches(11).unwrap()
            ));
            s.fill_pattern(12).unwrap();
            assert_eq!(parent.recv(), "done");
        }
        "small_tensors" => {
            let line = parent.recv();
            let storages: Vec<_> = line.split(' ').map(|h| receive(&a, h)).collect();
            for (i, s) in storages.iter().enumerate() {
                assert_eq!(s.count_pattern_mismatches(100 + i as u64).unwrap(), 0);
            }
            parent.send(&format!("ok mappings={}", a.ipc_open_segments()));
        }
        "event" => {
            let s = receive(&a, &parent.recv());
            parent.send(&format!(
                "mismatches={}",
                s.count_pattern_mismatches(2).unwrap()
            ));
        }
        "echo" => loop {
            let line = parent.recv();
            if line == "stop" {
                break;
            }
            let (i, h) = line.split_once(' ').unwrap();
            let s = receive(&a, h);
            assert_eq!(s.count_pattern_mismatches(i.parse().unwrap()).unwrap(), 0);
            drop(s);
            parent.send(&format!("{i} ok"));
        },
        "empty" => {
            let s = receive(&a, &parent.recv());
            parent.send(&format!("empty nbytes={}", s.nbytes()));
        }
        "rounds" => loop {
            let line = parent.recv();
            if line == "stop" {
                break;
            }
            let mut parts = line.split(' ');
            let round: u64 = parts.next().unwrap().parse().unwrap();
            let storages: Vec<_> = parts.map(|h| receive(&a, h)).collect();
            for (i, s) in storages.iter().enumerate() {
                assert_eq!(
                    s.count_pattern_mismatches(round * 10 + i as u64).unwrap(),
                    0
                );
            }
            parent.send(&format!("round {round} ok"));
        },
        "hold" => {
            let storages: Vec<_> = parent.recv().split(' ').map(|h| receive(&a, h)).collect();
            parent.send(&format!("holding {}", storages.len()));
            let _ = parent.recv(); // killed while waiting
        }
        "drop_unopened" => {
            let line = parent.recv();
            let bytes = unhex(&line);
            drop(IpcHandle::from_bytes(&bytes).unwrap());
            parent.send("dropped");
        }
        "outlive" => {
            let s = receive(&a, &parent.recv());
            parent.send("got it");
            assert_eq!(parent.recv(), "producer gone");
            let bad = s.count_pattern_mismatches(5).unwrap();
            drop(s);
            parent.send(&format!("released mismatches={bad}"));
        }
        "forward" => {
            let mut held = Vec::new();
            loop {
                let line = parent.recv();
                match line.as_str() {
                    "stop" => break,
                    "release" => {
                        held.clear();
                        parent.send("released");
                    }
                    _ => {
                        let storages: Vec<_> = line.split(' ').map(|h| receive(&a, h)).collect();
                        let out: Vec<String> = storages
                            .iter()
                            .map(|s| send(s.share_ipc().unwrap()))
                            .collect();
                        held.extend(storages);
                        parent.send(&out.join(" "));
                    }
                }
            }
        }
        "sum" => {
            let mut sum = 0u64;
            loop {
                let line = parent.recv();
                match line.as_str() {
                    "stop" => break,
                    "total" => parent.send(&format!("sum={sum}")),
                    _ => {
                        for h in line.split(' ') {
                            let s = receive(&a, h);
                            let mut b = [0u8; 1];
                            s.copy_to_host(
                                s.runtime().current_stream(s.device()).unwrap(),
                                0,
                                &mut b,
                            )
                            .unwrap();
                            sum += u64::from(b[0]);
                        }
                        parent.send("ok");
                    }
                }
            }
        }
        other => panic!("unknown role {other}"),
    }
}
