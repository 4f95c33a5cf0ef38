//! Storages order themselves (`stream_order:auto`, the default; `src/storage/order.rs`): the
//! newcomer's two bugs of issue 36 — a read on another stream without a wait, a free without
//! `record_stream` — give the right bytes, 100 of 100, with no wait or `record_stream` written;
//! a write waits for every earlier reader, not only the last. Deterministic: the earlier stream
//! is held by a gate while the later access is enqueued, so an unordered access would run first.
//! The same programs under `stream_order:manual` read wrong bytes (measured here, so the tests
//! show what the ordering buys); the sanitizer reports them there (`tests/sanitizer.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::storage::{clean as ordered_and_clean, ordered_or_manual as runtime};
use cudalloc::{backend::HostDriver, Runtime, Storage};

const ROUNDS: u64 = 100;
const LEN: u64 = 64 << 10;

/// A storage on `stream` filled there with the pattern of `seed` (through the storage's door).
fn filled(rt: &Arc<Runtime>, stream: cudalloc::StreamId, seed: u64) -> Storage {
    let s = Storage::new_on(rt, stream, LEN).unwrap();
    fill(rt, &s, stream, seed);
    s
}

fn fill(rt: &Arc<Runtime>, s: &Storage, stream: cudalloc::StreamId, seed: u64) {
    let p = s.mutable_data_ptr_on(stream).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(stream, p, LEN, seed) }.unwrap();
}

fn mismatches(rt: &Arc<Runtime>, s: &Storage, seed: u64) -> u64 {
    let stream = rt.create_stream(0).unwrap();
    let p = s.data_ptr_on(stream).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        rt.driver()
            .kernels()
            .count_pattern_mismatches(stream, p, LEN, seed)
    }
    .unwrap()
}

/// A read on stream `b` of bytes written on `a`, with `a` held: ordered, the copy waits.
fn read_on_another_stream(conf: &str) -> u64 {
    let (rt, host) = runtime(conf);
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let mut wrong = 0;
    for round in 0..ROUNDS {
        // Allocated before the gate: an allocation may synchronize the streams (out of memory).
        let x = Storage::new_on(&rt, a, LEN).unwrap();
        let y = Storage::new_on(&rt, b, LEN).unwrap();
        let gate = host.gate_stream(a).unwrap();
        fill(&rt, &x, a, round);
        let d = y.mutable_data_ptr_on(b).unwrap();
        let src = x.data_ptr_on(b).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().copy_device_to_device(b, d, src, LEN) }.unwrap();
        // Unordered, `b` has copied already (it does not wait for the held `a`): wait for it
        // by the driver, behind the storages' backs.
        if conf.contains("manual") {
            rt.driver().stream_synchronize(b).unwrap();
        }
        drop(gate);
        rt.driver().stream_synchronize(b).unwrap();
        wrong += u64::from(mismatches(&rt, &y, round) != 0);
    }
    ordered_and_clean(&rt);
    wrong
}

#[test]
fn a_read_on_another_stream_waits_for_the_write() {
    assert_eq!(read_on_another_stream(""), 0, "auto: every round right");
    assert_eq!(
        read_on_another_stream("stream_order:manual"),
        ROUNDS,
        "manual, no wait written: every round wrong"
    );
}

/// A storage read on `b` (held), then dropped with no `record_stream`; the next allocation on
/// `a` writes new bytes. Ordered, the free waited for `b`: the block is not reused under the read.
fn free_while_another_stream_reads(conf: &str) -> u64 {
    let (rt, host) = runtime(conf);
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let mut wrong = 0;
    for round in 0..ROUNDS {
        let x = filled(&rt, a, round);
        rt.driver().stream_synchronize(a).unwrap();
        let y = Storage::new_on(&rt, b, LEN).unwrap();
        let gate = host.gate_stream(b).unwrap();
        let d = y.mutable_data_ptr_on(b).unwrap();
        let src = x.data_ptr_on(b).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().copy_device_to_device(b, d, src, LEN) }.unwrap();
        drop(x);
        let next = filled(&rt, a, 1_000 + round);
        rt.driver().stream_synchronize(a).unwrap();
        drop(gate);
        rt.driver().stream_synchronize(b).unwrap();
        wrong += u64::from(mismatches(&rt, &y, round) != 0);
        drop(next);
    }
    ordered_and_clean(&rt);
    wrong
}

#[test]
fn a_free_waits_for_every_stream_that_read_without_record_stream() {
    assert_eq!(
        free_while_another_stream_reads(""),
        0,
        "auto: every round right"
    );
    assert_eq!(
        free_while_another_stream_reads("stream_order:manual"),
        ROUNDS,
        "manual, no record_stream written: the block was reused under the read every round"
    );
}

/// Two readers on `b` and `c` (both held), then a write on `a`: the write waits for both.
#[test]
fn a_write_waits_for_every_earlier_reader() {
    let (rt, host) = runtime("");
    let (a, b, c) = (
        rt.create_stream(0).unwrap(),
        rt.create_stream(0).unwrap(),
        rt.create_stream(0).unwrap(),
    );
    for round in 0..ROUNDS {
        let x = filled(&rt, a, round);
        rt.driver().stream_synchronize(a).unwrap();
        let (yb, yc) = (
            Storage::new_on(&rt, b, LEN).unwrap(),
            Storage::new_on(&rt, c, LEN).unwrap(),
        );
        let (gate_b, gate_c) = (host.gate_stream(b).unwrap(), host.gate_stream(c).unwrap());
        for (y, on) in [(&yb, b), (&yc, c)] {
            let d = y.mutable_data_ptr_on(on).unwrap();
            let src = x.data_ptr_on(on).unwrap();
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { rt.driver().copy_device_to_device(on, d, src, LEN) }.unwrap();
        }
        let p = x.mutable_data_ptr_on(a).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().kernels().fill_pattern(a, p, LEN, 5_000 + round) }.unwrap();
        drop(gate_b);
        drop(gate_c);
        for s in [a, b, c] {
            rt.driver().stream_synchronize(s).unwrap();
        }
        assert_eq!(mismatches(&rt, &yb, round), 0, "the first reader");
        assert_eq!(mismatches(&rt, &yc, round), 0, "the second reader");
        assert_eq!(mismatches(&rt, &x, 5_000 + round), 0, "the write");
    }
    ordered_and_clean(&rt);
}

// Found by review (each wrong or an error before its fix):

/// A lazy clone starts as written on the stream current at the clone (which waited for the
/// source's write): a read of the clone on a third stream waits for the source's write.
#[test]
fn a_lazy_clone_read_on_another_stream_waits_for_the_sources_write() {
    let (rt, host) = runtime("");
    let (a, c) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    for round in 0..ROUNDS {
        let x = Storage::new_on(&rt, a, LEN).unwrap();
        let y = Storage::new_on(&rt, c, LEN).unwrap();
        let gate = host.gate_stream(a).unwrap();
        fill(&rt, &x, a, round);
        let clone = {
            let _on = rt.set_current_stream(a).unwrap();
            x.lazy_clone().unwrap()
        };
        let d = y.mutable_data_ptr_on(c).unwrap();
        let src = clone.data_ptr_on(c).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().copy_device_to_device(c, d, src, LEN) }.unwrap();
        drop(gate);
        rt.driver().stream_synchronize(c).unwrap();
        assert_eq!(mismatches(&rt, &y, round), 0, "round {round}");
    }
    ordered_and_clean(&rt);
}

/// A lazy clone's first write through any door (`mutable_data_ptr()`, sharing) gives the storage
/// new memory written on that stream: an access on the old stream is ordered and recorded again
/// (it took the one-stream fast path, and the block was reused under its write).
#[test]
fn the_first_write_of_a_lazy_clone_by_any_door_starts_its_streams_afresh() {
    let (rt, host) = runtime("");
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    for round in 0..ROUNDS {
        let x = filled(&rt, a, round);
        rt.driver().stream_synchronize(a).unwrap();
        let clone = {
            let _on = rt.set_current_stream(a).unwrap();
            x.lazy_clone().unwrap()
        };
        {
            let _on = rt.set_current_stream(b).unwrap();
            x.unordered_mutable_data_ptr().unwrap(); // the copy, on `b`
        }
        drop(clone);
        let gate = host.gate_stream(a).unwrap();
        fill(&rt, &x, a, 2); // held: not run yet
        drop(x);
        let next = filled(&rt, b, 3);
        rt.driver().stream_synchronize(b).unwrap();
        drop(gate);
        rt.driver().stream_synchronize(a).unwrap();
        assert_eq!(mismatches(&rt, &next, 3), 0, "round {round}");
    }
    ordered_and_clean(&rt);
}

/// A stream of another device is the program's to order, as in manual mode (it was an error of
/// `record_stream`); a stream destroyed after its access is not waited for (every later access
/// failed).
#[test]
fn other_devices_and_destroyed_streams_are_not_errors() {
    let host = Arc::new(HostDriver::builder().devices(2).build().unwrap());
    let rt = Arc::new(Runtime::builder().build(host).unwrap());
    let a = rt.create_stream(0).unwrap();
    let x = filled(&rt, a, 1);
    x.data_ptr_on(rt.create_stream(1).unwrap()).unwrap();
    // A reader destroyed, then a write.
    let worker = rt.create_stream(0).unwrap();
    x.data_ptr_on(worker).unwrap();
    rt.driver().stream_synchronize(worker).unwrap();
    rt.driver().stream_destroy(worker).unwrap();
    x.mutable_data_ptr_on(a).unwrap();
    // A writer destroyed, then a read.
    let worker = rt.create_stream(0).unwrap();
    let z = filled(&rt, worker, 2);
    rt.driver().stream_synchronize(worker).unwrap();
    rt.driver().stream_destroy(worker).unwrap();
    let b = rt.create_stream(0).unwrap();
    z.data_ptr_on(b).unwrap();
    assert_eq!(mismatches(&rt, &z, 2), 0);
}

const CHILD: &str = "storage_order_child";

/// A storage received from another process starts as written on the receipt's stream (it waited
/// for the producer's event): a read on another stream of the consumer waits for the producer's
/// write (found by review: it started with no writer, and the consumer's copy ran before the
/// producer's fill — the producer's stream is held until the consumer has queued its copy).
#[test]
fn a_received_storage_read_on_another_stream_waits_for_the_producer() {
    let (rt, host) = runtime("");
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let x = Storage::new_on(&rt, a, LEN).unwrap();
    rt.driver().stream_synchronize(a).unwrap();
    let gate = host.gate_stream(a).unwrap();
    fill(&rt, &x, a, 42);
    let handle = {
        let _on = rt.set_current_stream(b).unwrap();
        x.share_ipc().unwrap()
    };
    let mut child = common::ChildProcess::spawn(CHILD, "read", "host");
    child.send(&common::hex(&handle.into_bytes()));
    assert_eq!(child.recv(), "queued");
    drop(gate);
    child.send("released");
    assert_eq!(child.recv(), "mismatches=0");
    child.send("done");
    child.finish();
    drop(x);
    rt.ipc_collect();
}

/// A second receipt of a storage still open in the consumer: the producer wrote again (held on
/// its stream) and shared it again; the consumer's second `from_ipc` gives the storage it has, and
/// a read on another stream waits for the new write (before the fix the second receipt returned
/// the storage without waiting for the new handle's event: the copy read the first write's bytes,
/// every byte wrong against the second pattern).
#[test]
fn a_second_receipt_of_a_live_storage_waits_for_the_producers_new_write() {
    let (rt, host) = runtime("");
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let x = filled(&rt, a, 42);
    rt.driver().stream_synchronize(a).unwrap();
    let first = {
        let _on = rt.set_current_stream(b).unwrap();
        x.share_ipc().unwrap()
    };
    let mut child = common::ChildProcess::spawn(CHILD, "again", "host");
    child.send(&common::hex(&first.into_bytes()));
    assert_eq!(child.recv(), "open");
    let gate = host.gate_stream(a).unwrap();
    fill(&rt, &x, a, 43);
    let second = {
        let _on = rt.set_current_stream(b).unwrap();
        x.share_ipc().unwrap()
    };
    child.send(&common::hex(&second.into_bytes()));
    assert_eq!(child.recv(), "queued");
    drop(gate);
    child.send("released");
    assert_eq!(child.recv(), "mismatches=0");
    child.send("done");
    child.finish();
    drop(x);
    rt.ipc_collect();
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn storage_order_child() {
    let Ok(role) = std::env::var(common::ROLE_VAR) else {
        return;
    };
    let rt = Arc::new(Runtime::new(common::child_test_driver(), Default::default()).unwrap());
    let mut parent = common::ParentLink::new();
    let handle = cudalloc::ipc::IpcHandle::from_bytes(&common::unhex(&parent.recv())).unwrap();
    let mut s = Storage::from_ipc(&rt, handle).unwrap();
    let mut seed = 42;
    if role == "again" {
        parent.send("open");
        let handle = cudalloc::ipc::IpcHandle::from_bytes(&common::unhex(&parent.recv())).unwrap();
        let again = Storage::from_ipc(&rt, handle).unwrap();
        assert!(again.is_alias_of(&s), "the storage open here");
        s = again;
        seed = 43;
    } else {
        assert_eq!(role, "read");
    }
    let d = rt.create_stream(0).unwrap();
    let y = Storage::new_on(&rt, d, LEN).unwrap();
    let dst = y.mutable_data_ptr_on(d).unwrap();
    let src = s.data_ptr_on(d).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().copy_device_to_device(d, dst, src, LEN) }.unwrap();
    parent.send("queued");
    assert_eq!(parent.recv(), "released");
    rt.driver().stream_synchronize(d).unwrap();
    parent.send(&format!("mismatches={}", mismatches(&rt, &y, seed)));
    assert_eq!(parent.recv(), "done");
}
