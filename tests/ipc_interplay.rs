//! Where sharing meets the rest: several allocators and threads in one consumer process, COW ×
//! sharing, and the ordering of leases. Each test here reproduces a bug found by the adversarial
//! review of issue 9 and failed before its fix. Children are this test binary re-executed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{backend::Driver, ipc::IpcHandle, Runtime, Storage};

const CHILD: &str = "interplay_child";

fn allocator(driver: Arc<dyn Driver>) -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(test_config(""))
            .ipc_slots_per_file(64)
            .check_invariants(true)
            .build(driver)
            .unwrap(),
    )
}

fn producer() -> Arc<Runtime> {
    allocator(test_driver())
}

fn send(h: IpcHandle) -> String {
    hex(&h.into_bytes())
}

fn open(a: &Arc<Runtime>, text: &str) -> Storage {
    Storage::from_ipc(a, IpcHandle::from_bytes(&unhex(text)).unwrap()).unwrap()
}

/// Shares a patterned storage twice to a child playing `role`, drops the producer's storage (so it
/// sits in limbo), lets the child drop one of its two receipts, then collects: the memory must stay
/// allocated (no "dead consumer" reclaim) and the child's other receipt must still read the pattern.
/// `busy_drop` gates a stream, which only the host backend can: it runs on host in every run.
fn one_receipt_dropped_keeps_the_other(role: &str) {
    let backend = if role == "busy_drop" {
        "host"
    } else {
        test_backend()
    };
    let a = allocator(child_driver(backend));
    let s = Storage::new(&a, 0, 1 << 20).unwrap();
    s.fill_pattern(77).unwrap();
    let (h1, h2) = (send(s.share_ipc().unwrap()), send(s.share_ipc().unwrap()));
    let mut child = ChildProcess::spawn(CHILD, role, backend);
    child.send(&format!("{h1} {h2}"));
    assert_eq!(child.recv(), "opened");
    drop(s);
    assert_eq!(a.ipc_limbo().0, 1, "consumers count on it: limbo");
    child.send("drop one");
    assert_eq!(child.recv(), "dropped one");
    let collected = a.ipc_collect();
    assert_eq!(
        collected.from_dead_consumers, 0,
        "a live consumer still holds the slot: nothing may be reclaimed"
    );
    assert_eq!(a.ipc_limbo().0, 1, "still counted by the live receipt");
    // Reuse the memory if it was wrongly freed: the poison and the new data would show.
    let reuse = Storage::new(&a, 0, 1 << 20).unwrap();
    reuse.fill_pattern(1).unwrap();
    child.send("verify");
    assert_eq!(child.recv(), "mismatches=0");
    child.send("stop");
    child.finish();
    drop(reuse);
    assert_eq!(a.ipc_collect().storages, 1, "freed once released");
    assert_eq!(a.ipc_limbo(), (0, 0));
}

#[test]
fn two_allocators_with_their_own_drivers_in_one_consumer() {
    one_receipt_dropped_keeps_the_other("two_drivers");
}

#[test]
fn two_allocators_over_one_driver_in_one_consumer() {
    one_receipt_dropped_keeps_the_other("one_driver");
}

#[test]
fn drop_waiting_on_a_busy_stream_while_another_thread_reopens() {
    one_receipt_dropped_keeps_the_other("busy_drop");
}

#[test]
fn two_threads_opening_one_storage_get_one_storage() {
    let a = producer();
    let mut child = ChildProcess::spawn(CHILD, "racing_opens", test_backend());
    for round in 0..200u64 {
        let s = Storage::new(&a, 0, 4096).unwrap();
        s.fill_pattern(round).unwrap();
        let (h1, h2) = (send(s.share_ipc().unwrap()), send(s.share_ipc().unwrap()));
        child.send(&format!("{round} {h1} {h2}"));
        drop(s);
        assert_eq!(child.recv(), format!("{round} same=true"));
        // The child still holds the storage: nothing may be reclaimed.
        assert_eq!(a.ipc_collect().from_dead_consumers, 0, "round {round}");
        child.send("release");
        assert_eq!(child.recv(), "released");
    }
    child.send("stop");
    child.finish();
    a.ipc_collect();
    assert_eq!(a.ipc_limbo(), (0, 0));
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn interplay_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut parent = ParentLink::new();
    match role.as_str() {
        "two_drivers" | "one_driver" | "busy_drop" => {
            let line = parent.recv();
            let (h1, h2) = line.split_once(' ').unwrap();
            let host1 = Arc::new(host_driver());
            let d1: Arc<dyn Driver> = if role == "busy_drop" {
                host1.clone()
            } else {
                child_test_driver()
            };
            let d2: Arc<dyn Driver> = if role == "two_drivers" {
                child_test_driver()
            } else {
                d1.clone()
            };
            let (a1, a2) = (allocator(d1), allocator(d2));
            let first = open(&a1, h1);
            let mut gate = None;
            let second = if role == "busy_drop" {
                // The first receipt's drop waits on its busy stream while the same handle is
                // opened again from another thread (the weak cache entry is already dead).
                gate = Some(host1.gate_stream(a1.default_stream(0).unwrap()).unwrap());
                let dropper = std::thread::spawn(move || drop(first));
                let h2 = h2.to_owned();
                let a1c = a1.clone();
                let second = std::thread::spawn(move || open(&a1c, &h2)).join().unwrap();
                parent.send("opened");
                assert_eq!(parent.recv(), "drop one");
                drop(gate.take());
                dropper.join().unwrap();
                second
            } else {
                let second = open(&a2, h2);
                parent.send("opened");
                assert_eq!(parent.recv(), "drop one");
                drop(first);
                second
            };
            parent.send("dropped one");
            assert_eq!(parent.recv(), "verify");
            parent.send(&format!(
                "mismatches={}",
                second.count_pattern_mismatches(77).unwrap()
            ));
            assert_eq!(parent.recv(), "stop");
            drop(gate);
        }
        "racing_opens" => {
            let a = allocator(child_test_driver());
            loop {
                let line = parent.recv();
                if line == "stop" {
                    break;
                }
                let mut parts = line.split(' ');
                let round: u64 = parts.next().unwrap().parse().unwrap();
                let handles: Vec<String> = parts.map(str::to_owned).collect();
                let barrier = Arc::new(std::sync::Barrier::new(2));
                let opened: Vec<Storage> = handles
                    .into_iter()
                    .map(|h| {
                        let (a, barrier) = (a.clone(), barrier.clone());
                        std::thread::spawn(move || {
                            let handle = IpcHandle::from_bytes(&unhex(&h)).unwrap();
                            barrier.wait();
                            Storage::from_ipc(&a, handle).unwrap()
                        })
                    })
                    .collect::<Vec<_>>()
                    .into_iter()
                    .map(|t| t.join().unwrap())
                    .collect();
                let same = opened[0].is_alias_of(&opened[1]);
                let survivor = opened[1].clone();
                drop(opened);
                parent.send(&format!("{round} same={same}"));
                assert_eq!(parent.recv(), "release");
                assert_eq!(survivor.count_pattern_mismatches(round).unwrap(), 0);
                drop(survivor);
                parent.send("released");
            }
        }
        "verify_and_write" => {
            let a = allocator(child_test_driver());
            let s = open(&a, &parent.recv());
            parent.send(&format!(
                "mismatches={}",
                s.count_pattern_mismatches(4).unwrap()
            ));
            s.fill_pattern(8).unwrap();
            a.driver()
                .stream_synchronize(a.default_stream(0).unwrap())
                .unwrap();
            parent.send("wrote 8");
            assert_eq!(parent.recv(), "stop");
        }
        "open_late" => {
            let a = allocator(child_test_driver());
            let bytes = unhex(&parent.recv());
            parent.send("got it");
            assert_eq!(parent.recv(), "open");
            let outcome = IpcHandle::from_bytes(&bytes).and_then(|h| Storage::from_ipc(&a, h));
            match outcome {
                Ok(_) => parent.send("opened"),
                Err(e) => parent.send(&format!("refused: {e}")),
            }
        }
        "producer_holds" => {
            let a = allocator(child_test_driver());
            let s = Storage::new(&a, 0, 1 << 20).unwrap();
            s.fill_pattern(31).unwrap();
            parent.send(&send(s.share_ipc().unwrap()));
            let _ = parent.recv(); // killed while waiting
        }
        "producer_dies" => {
            // A producer whose writes are held behind a gate when it shares, then is killed.
            let host = Arc::new(host_driver());
            let a = allocator(host.clone());
            let s = Storage::new(&a, 0, 1 << 20).unwrap();
            let gate = host.gate_stream(a.default_stream(0).unwrap()).unwrap();
            s.fill_pattern(21).unwrap();
            parent.send(&send(s.share_ipc().unwrap()));
            let _ = parent.recv(); // killed while waiting
            drop(gate);
        }
        other => panic!("unknown role {other}"),
    }
}

/// Bytes of `s` that do not hold pattern `seed`.
fn mismatches(s: &Storage, seed: u64) -> u64 {
    s.count_pattern_mismatches(seed).unwrap()
}

#[test]
fn sharing_a_lazy_clone_taken_on_another_stream_keeps_every_byte() {
    // Written and synchronized, lazily cloned on one stream, shared on another, then written on
    // the default stream: the share's own copy must not land after (and over) that write.
    let a = producer();
    let (x, y) = (a.create_stream(0).unwrap(), a.create_stream(0).unwrap());
    let default = a.default_stream(0).unwrap();
    for (clone_on, share_on) in [(x, y), (x, x), (default, y), (x, default)] {
        let s = Storage::new(&a, 0, 1 << 20).unwrap();
        s.fill_pattern(5).unwrap();
        a.driver().stream_synchronize(default).unwrap();
        let clone = {
            let _on = a.set_current_stream(clone_on).unwrap();
            s.lazy_clone().unwrap()
        };
        let handle = {
            let _on = a.set_current_stream(share_on).unwrap();
            s.share_ipc().unwrap()
        };
        assert_eq!(
            mismatches(&s, 5),
            0,
            "the shared storage, read on the default stream"
        );
        s.fill_pattern(6).unwrap();
        for st in [default, x, y] {
            a.driver().stream_synchronize(st).unwrap();
        }
        assert_eq!(mismatches(&s, 6), 0, "the write after sharing stands");
        assert_eq!(mismatches(&clone, 5), 0, "the lazy clone kept its bytes");
        let again = Storage::from_ipc(&a, handle).unwrap();
        assert!(again.is_alias_of(&s), "same-process receipt is the storage");
        drop((s, again));
        assert_eq!(
            mismatches(&clone, 5),
            0,
            "the clone after the shared storage died"
        );
    }
}

#[test]
fn share_racing_lazy_clone_never_fails() {
    // The storage is COW when shared, so sharing materializes it; a lazy clone taken right after
    // that (the cloner waits on the storage's lock meanwhile) used to find it COW again when the
    // share went on to wrap it: "only memory from a caching allocator ... can be shared".
    let a = producer();
    let mut failures = Vec::new();
    for round in 0..500u64 {
        let s = Storage::new(&a, 0, 64 << 10).unwrap();
        s.fill_pattern(round).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cloner = {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut last = s.lazy_clone().unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    last = s.lazy_clone().unwrap();
                }
                last
            })
        };
        while !s.is_cow() {
            std::hint::spin_loop();
        }
        let shared = s.share_ipc();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let clone = cloner.join().unwrap();
        match shared {
            Ok(handle) => drop(handle),
            Err(e) => failures.push(format!("round {round}: {e}")),
        }
        for c in [&s, &clone] {
            assert_eq!(mismatches(c, round), 0, "round {round}");
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 500 rounds failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    a.ipc_collect();
    assert_eq!(a.ipc_limbo(), (0, 0));
}

#[test]
fn a_lazy_clone_of_a_shared_storage_leaves_the_shared_memory_with_it() {
    let a = producer();
    let s = Storage::new(&a, 0, 1 << 20).unwrap();
    s.fill_pattern(3).unwrap();
    let to_child = send(s.share_ipc().unwrap());
    let later = s.share_ipc().unwrap();
    let clone = s.lazy_clone().unwrap();
    // The shared storage is written after the clone: consumers see its memory, so they see this.
    s.fill_pattern(4).unwrap();
    a.driver()
        .stream_synchronize(a.default_stream(0).unwrap())
        .unwrap();
    let mut child = ChildProcess::spawn(CHILD, "verify_and_write", test_backend());
    child.send(&to_child);
    assert_eq!(
        child.recv(),
        "mismatches=0",
        "the consumer sees the producer's write"
    );
    assert_eq!(child.recv(), "wrote 8");
    assert_eq!(
        mismatches(&s, 8),
        0,
        "the producer sees the consumer's write"
    );
    assert_eq!(
        mismatches(&clone, 3),
        0,
        "the lazy clone kept the old bytes"
    );
    // The clone written, the original dropped: the handle names the shared storage, which is
    // gone here — not the clone.
    clone.fill_pattern(6).unwrap();
    drop(s);
    let err = Storage::from_ipc(&a, later).unwrap_err();
    assert!(err.to_string().contains("no longer exists"), "{err}");
    assert_eq!(mismatches(&clone, 6), 0);
    child.send("stop");
    child.finish();
    a.ipc_collect();
    assert_eq!(a.ipc_limbo(), (0, 0));
}

#[test]
fn receipt_through_a_second_allocator_of_the_producer_process_is_the_original() {
    let a = producer();
    let b = producer();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let back = Storage::from_ipc(&b, s.share_ipc().unwrap()).unwrap();
    assert!(back.is_alias_of(&s));
}

#[test]
fn a_producer_that_dies_before_its_data_is_ready_is_an_error_for_the_consumer() {
    // Host backend in every run: the producer gates its stream, and the failed wait is the host
    // backend's interprocess-event report.
    let a = allocator(Arc::new(host_driver()));
    // Died before the receipt: `from_ipc` refuses.
    let mut child = ChildProcess::spawn(CHILD, "producer_dies", "host");
    let handle = IpcHandle::from_bytes(&unhex(&child.recv())).unwrap();
    child.kill();
    let err = Storage::from_ipc(&a, handle).unwrap_err();
    assert!(err.to_string().contains("exited before"), "{err}");
    // Died after the receipt, while the consumer's stream waits: that stream reports the failure.
    let stream = a.create_stream(0).unwrap();
    let _on = a.set_current_stream(stream).unwrap();
    let mut child = ChildProcess::spawn(CHILD, "producer_dies", "host");
    let s = open(&a, &child.recv());
    let theirs = format!("cudalloc-{}-", child.pid());
    child.kill();
    let err = s.count_pattern_mismatches(21).unwrap_err();
    assert!(err.to_string().contains("exited before"), "{err}");
    // Nothing of the dead producers stays in /dev/shm once nobody holds it.
    drop(s);
    cudalloc::ipc::sweep_orphans().unwrap();
    assert!(shm_names_with_prefix(&theirs).is_empty());
}

#[test]
fn a_dead_producers_objects_are_swept_once_no_consumer_holds_them() {
    // Host backend in every run: the segment and event chunk are /dev/shm objects only there.
    let a = allocator(Arc::new(host_driver()));
    let mut child = ChildProcess::spawn(CHILD, "producer_holds", "host");
    let received = open(&a, &child.recv());
    // The producer's writes are complete before it dies.
    assert_eq!(received.count_pattern_mismatches(31).unwrap(), 0);
    let theirs = format!("cudalloc-{}-", child.pid());
    let objects = shm_names_with_prefix(&theirs);
    assert!(
        objects.len() >= 3,
        "segment, event chunk, ref file, liveness: {objects:?}"
    );
    // Other tests sweep concurrently (every runtime sweeps when it starts): what is checked is
    // what stays in /dev/shm, not which sweep removed it.
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let objects = sorted(objects);
    cudalloc::ipc::sweep_orphans().unwrap();
    assert_eq!(
        sorted(shm_names_with_prefix(&theirs)),
        objects,
        "alive: kept"
    );
    child.kill();
    cudalloc::ipc::sweep_orphans().unwrap();
    assert_eq!(
        sorted(shm_names_with_prefix(&theirs)),
        objects,
        "dead, but we hold a lease: kept"
    );
    assert_eq!(received.count_pattern_mismatches(31).unwrap(), 0);
    drop(received);
    cudalloc::ipc::sweep_orphans().unwrap();
    assert!(
        shm_names_with_prefix(&theirs).is_empty(),
        "every object of the dead producer removed: {:?}",
        shm_names_with_prefix(&theirs)
    );
}

#[test]
fn a_stale_handle_cannot_take_the_count_of_the_slots_next_storage() {
    let a = producer();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let old = s.share_ipc().unwrap().into_bytes();
    // The handle is used once (here: a same-process receipt) and its storage freed.
    let back = Storage::from_ipc(&a, IpcHandle::from_bytes(&old).unwrap()).unwrap();
    drop((s, back));
    assert_eq!(a.ipc_limbo(), (0, 0));
    // The slot is reused by the next shared storage.
    let s2 = Storage::new(&a, 0, 4096).unwrap();
    let h2 = s2.share_ipc().unwrap();
    assert_eq!(h2.wire().slot, wire_slot(&old));
    let err = IpcHandle::from_bytes(&old).unwrap_err();
    assert!(err.to_string().contains("stale"), "{err}");
    // The new storage's count is intact: its handle opens, and once dropped nothing is pending.
    let back2 = Storage::from_ipc(&a, h2).unwrap();
    assert!(back2.is_alias_of(&s2));
    drop((s2, back2));
    a.ipc_collect();
    assert_eq!(a.ipc_limbo(), (0, 0));
}

fn wire_slot(bytes: &[u8]) -> u32 {
    cudalloc::internals::WireHandle::parse(bytes).unwrap().slot
}

/// Waits (on the clock: the time-to-live is the behaviour under test) until `expires_ms` passed.
fn wait_past(expires_ms: u64) {
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        if now > expires_ms {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(expires_ms + 1 - now));
    }
}

#[test]
fn handles_lost_in_flight_expire_and_are_reclaimed() {
    let config = test_config("ipc_handle_ttl_s:0.2");
    let a = Arc::new(
        Runtime::builder()
            .config(config)
            .build(test_driver())
            .unwrap(),
    );
    let s = Storage::new(&a, 0, 1 << 20).unwrap();
    let lost = s.share_ipc().unwrap();
    let late = s.share_ipc().unwrap();
    let expires = late.wire().expires_ms;
    assert!(expires > 0);
    // One consumer dies holding a handle it never opened; another opens its handle too late.
    let mut killed = ChildProcess::spawn(CHILD, "open_late", test_backend());
    killed.send(&send(lost));
    assert_eq!(killed.recv(), "got it");
    killed.kill();
    let mut slow = ChildProcess::spawn(CHILD, "open_late", test_backend());
    slow.send(&send(late));
    assert_eq!(slow.recv(), "got it");
    drop(s);
    assert_eq!(a.ipc_limbo().0, 1, "two unopened handles count on it");
    wait_past(expires);
    slow.send("open");
    let answer = slow.recv();
    assert!(
        answer.starts_with("refused") && answer.contains("expired"),
        "{answer}"
    );
    slow.finish();
    let collected = a.ipc_collect();
    assert_eq!(collected.storages, 1, "both expired counts reclaimed");
    assert_eq!(a.ipc_limbo(), (0, 0));
}

#[test]
fn a_lazy_clone_of_shared_memory_taken_on_one_stream_and_shared_on_another_is_complete() {
    // Found by the interplay test: the eager copy of a shared storage's lazy clone was enqueued
    // on the clone's stream only, so sharing the clone on another stream handed the consumer a
    // storage whose bytes were still being copied.
    let a = producer();
    let (x, y) = (a.create_stream(0).unwrap(), a.create_stream(0).unwrap());
    let s = Storage::new(&a, 0, 8 << 20).unwrap();
    s.fill_pattern(41).unwrap();
    a.driver()
        .stream_synchronize(a.default_stream(0).unwrap())
        .unwrap();
    let _held = s.share_ipc().unwrap(); // the source is shared memory now
                                        // Stream x is busy for a while (the sleep kernel: what exposes a missing wait, not a wait).
    a.driver().kernels().sleep(x, 300_000).unwrap();
    let clone = {
        let _on = a.set_current_stream(x).unwrap();
        s.lazy_clone().unwrap()
    };
    let _on = a.set_current_stream(y).unwrap();
    assert_eq!(clone.count_pattern_mismatches(41).unwrap(), 0);
}
