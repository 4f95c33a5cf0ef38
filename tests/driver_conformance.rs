//! One conformance suite for every backend present: the host backend always, CUDA when a driver and
//! a device exist (otherwise each test prints "skipped: no CUDA driver" for it).
//!
//! What it proves: memory is allocated within a finite capacity, out-of-memory is reported as such
//! and the device is usable afterwards; copies round-trip exactly; the kernels compute the reference
//! pattern; streams are really asynchronous and events really order them, within a process and across
//! processes; and every misuse is a typed error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use cudalloc::backend::capability::Kernels;
use cudalloc::internals::pattern;
use std::sync::Arc;

use cudalloc::{
    backend::Driver, backend::EventFlags, backend::IpcEventHandle, backend::IpcMemHandle,
    backend::SimDriver, DeviceAddr, ErrorKind,
};

const MIB: u64 = 1 << 20;

fn write(d: &dyn Driver, dst: DeviceAddr, bytes: &[u8]) {
    let s = d.default_stream(0).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_host_to_device(s, dst, bytes) }.unwrap();
}

fn read(d: &dyn Driver, src: DeviceAddr, len: usize) -> Vec<u8> {
    let s = d.default_stream(0).unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_host(s, &mut out, src) }.unwrap();
    out
}

#[test]
fn an_imported_stream_is_the_library_stream_and_is_never_destroyed() {
    let _device = device_shared();
    for b in backends("an_imported_stream_is_the_library_stream_and_is_never_destroyed") {
        let d = b.driver.as_ref();
        // The "library" made a stream; cudalloc adopts it by its raw handle.
        let library = d.stream_create(0).unwrap();
        let raw = d.interop().raw_stream(library).unwrap();
        // SAFETY: `raw` names a live stream of this driver on device 0.
        let adopted = unsafe { d.interop().import_stream(0, raw) }.unwrap();
        assert_eq!(d.interop().raw_stream(adopted).unwrap(), raw, "{}", b.name);
        assert_eq!(d.stream_device(adopted).unwrap(), 0, "{}", b.name);
        // Work on either id is one queue: a slow write on the library's id, then a read on the
        // adopted id, sees the write without any event.
        let p = d.malloc(0, MIB).unwrap();
        d.kernels().sleep(library, 20_000).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(library, p, MIB, 9) }.unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(adopted, p, MIB, 9) }.unwrap(),
            0,
            "{}",
            b.name
        );
        // Forgetting the adopted id leaves the library's stream alive.
        if b.name == "cuda" {
            d.stream_destroy(adopted).unwrap();
        }
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(library, p, MIB, 10) }.unwrap();
        d.stream_synchronize(library).unwrap();
        // A stream of another device is refused.
        if d.device_count() > 1 {
            // SAFETY: as above.
            let err = unsafe { d.interop().import_stream(1, raw) }.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{}: {err}", b.name);
        }
        // The default stream's raw handle: CUDA's legacy NULL stream.
        let default = d.default_stream(0).unwrap();
        if b.name == "cuda" {
            assert_eq!(d.interop().raw_stream(default).unwrap(), 0);
        }
        d.free(p).unwrap();
        d.stream_destroy(library).unwrap();
    }
}

#[test]
fn every_device_has_a_name_and_a_bad_ordinal_is_an_error() {
    let _device = device_shared();
    for b in backends("every_device_has_a_name_and_a_bad_ordinal_is_an_error") {
        let d = b.driver.as_ref();
        for device in 0..d.device_count() {
            let name = d.device_name(device).unwrap();
            assert!(!name.trim().is_empty(), "{}: device {device}", b.name);
        }
        let err = d.device_name(d.device_count()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{}: {err}", b.name);
    }
}

#[test]
fn filling_a_device_ends_in_a_retryable_out_of_memory_and_frees_recover() {
    // Requests that each fit the device's total but not what is left: the driver's own
    // out-of-memory answer (not a size check in front of it) must come back typed.
    let _device = device_alone();
    for b in backends("filling_a_device_ends_in_a_retryable_out_of_memory") {
        let d = b.driver.as_ref();
        let chunk = (d.mem_info(0).unwrap().total / 3).max(MIB);
        let mut held = Vec::new();
        let err = loop {
            match d.malloc(0, chunk) {
                Ok(p) => held.push(p),
                Err(e) => break e,
            }
            assert!(
                held.len() <= 8,
                "{}: {} chunks fit in the device",
                b.name,
                held.len()
            );
        };
        assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{}: {err}", b.name);
        assert!(err.is_retryable(), "{}", b.name);
        assert!(!held.is_empty(), "{}", b.name);
        for p in held {
            d.free(p).unwrap();
        }
        let again = d.malloc(0, chunk).unwrap();
        d.free(again).unwrap();
    }
}

#[test]
fn malloc_free_capacity_and_out_of_memory() {
    let _device = device_alone();
    for b in backends("malloc_free_capacity_and_out_of_memory") {
        let d = b.driver.as_ref();
        assert!(d.device_count() >= 1);
        let before = d.mem_info(0).unwrap();
        assert!(
            before.free <= before.total && before.total > 0,
            "{}",
            b.name
        );
        let p = d.malloc(0, 4 * MIB).unwrap();
        assert_eq!(p.0 % 512, 0, "{}: segment base {p} not 512-aligned", b.name);
        let during = d.mem_info(0).unwrap();
        assert!(
            during.free + 4 * MIB <= before.free,
            "{}: free {} -> {}",
            b.name,
            before.free,
            during.free
        );

        let err = d.malloc(0, before.total + 1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{}: {err}", b.name);
        assert!(err.is_retryable());
        let err = d.malloc(0, u64::MAX).unwrap_err();
        assert!(
            matches!(
                err.kind(),
                ErrorKind::OutOfMemory | ErrorKind::InvalidArgument
            ),
            "{err}"
        );

        // The device is fully usable after the failures.
        let s = d.default_stream(0).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(s, p, 4 * MIB, 5) }.unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(s, p, 4 * MIB, 5) }.unwrap(),
            0,
            "{}",
            b.name
        );
        d.free(p).unwrap();
        let after = d.mem_info(0).unwrap();
        assert!(
            after.free >= during.free + 4 * MIB,
            "{}: free did not come back",
            b.name
        );
    }
}

#[test]
fn host_capacity_is_exact_and_recovers_after_free() {
    let d = host_driver();
    let total = d.mem_info(1).unwrap().total;
    let a = d.malloc(1, total / 2).unwrap();
    let b = d.malloc(1, total / 2).unwrap();
    assert_eq!(d.mem_info(1).unwrap().free, 0);
    assert_eq!(d.malloc(1, 1).unwrap_err().kind(), ErrorKind::OutOfMemory);
    // Device 0 is a separate budget.
    d.free(d.malloc(0, 4096).unwrap()).unwrap();
    d.free(a).unwrap();
    let c = d.malloc(1, total / 4).unwrap();
    let s = d.default_stream(1).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.fill_pattern(s, c, total / 4, 9) }.unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.count_pattern_mismatches(s, c, total / 4, 9) }.unwrap(),
        0
    );
    d.free(b).unwrap();
    d.free(c).unwrap();
    assert_eq!(d.mem_info(1).unwrap().free, total);
}

#[test]
fn copies_round_trip_exactly() {
    let _device = device_shared();
    for b in backends("copies_round_trip_exactly") {
        let d = b.driver.as_ref();
        let s = d.default_stream(0).unwrap();
        let len = 3 * MIB as usize + 123;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        let x = d.malloc(0, len as u64).unwrap();
        let y = d.malloc(0, 4 * MIB).unwrap();
        write(d, x, &src);
        assert_eq!(read(d, x, len), src, "{}: host->device->host", b.name);
        // Device to device at an unaligned offset, then memset a window.
        let y_off = y.offset(1001).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.copy_device_to_device(s, y_off, x, len as u64) }.unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.memset(s, y_off.offset(10).unwrap(), 0xAB, 20) }.unwrap();
        let back = read(d, y_off, len);
        let mut expect = src.clone();
        expect[10..30].fill(0xAB);
        assert_eq!(back, expect, "{}: device->device + memset", b.name);
        // Zero-length copies are no-ops, not errors.
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.copy_host_to_device(s, x, &[]) }.unwrap();
        d.free(x).unwrap();
        d.free(y).unwrap();
    }
}

#[test]
fn kernels_match_the_reference_pattern() {
    let _device = device_shared();
    for b in backends("kernels_match_the_reference_pattern") {
        let d = b.driver.as_ref();
        let s = d.stream_create(0).unwrap();
        let len = MIB + 5;
        let p = d.malloc(0, len).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(s, p, len, 0xC0FFEE) }.unwrap();
        d.stream_synchronize(s).unwrap();
        assert_eq!(
            read(d, p, len as usize),
            pattern::expected(len as usize, 0xC0FFEE),
            "{}",
            b.name
        );
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(s, p, len, 0xC0FFEE) }.unwrap(),
            0
        );
        assert!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(s, p, len, 0xC0FFEF) }.unwrap()
                > len - len / 64
        );
        // Flip three bytes; the verify kernel counts exactly three.
        let mut three = read(d, p.offset(4096).unwrap(), 3);
        three.iter_mut().for_each(|x| *x ^= 0x5A);
        write(d, p.offset(4096).unwrap(), &three);
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(s, p, len, 0xC0FFEE) }.unwrap(),
            3,
            "{}",
            b.name
        );
        // A fill of a sub-range uses offsets relative to its start.
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(s, p.offset(77).unwrap(), 1000, 3) }.unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                d.kernels()
                    .count_pattern_mismatches(s, p.offset(77).unwrap(), 1000, 3)
            }
            .unwrap(),
            0
        );
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().poison(s, p, len) }.unwrap();
        d.stream_synchronize(s).unwrap();
        assert_eq!(
            pattern::count_non_poison(&read(d, p, len as usize)),
            0,
            "{}",
            b.name
        );
        d.free(p).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

#[test]
fn an_event_orders_a_slow_writer_before_a_reader_on_another_stream() {
    let _device = device_shared();
    for b in backends("an_event_orders_a_slow_writer_before_a_reader_on_another_stream") {
        let d = b.driver.as_ref();
        let (a, r) = (d.stream_create(0).unwrap(), d.stream_create(0).unwrap());
        let len = 2 * MIB;
        let buf = d.malloc(0, len).unwrap();
        let copy = d.malloc(0, len).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(a, buf, len, 1) }.unwrap();
        d.stream_synchronize(a).unwrap();
        let e = d.event_create(0, EventFlags::default()).unwrap();
        // Stream A: sleep, then overwrite with pattern 2, then record.
        d.kernels().sleep(a, 200_000).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(a, buf, len, 2) }.unwrap();
        d.event_record(e, a).unwrap();
        // Stream R waits for the event, then copies: it must see pattern 2 in full.
        d.stream_wait_event(r, e).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.copy_device_to_device(r, copy, buf, len) }.unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(r, copy, len, 2) }.unwrap(),
            0,
            "{}",
            b.name
        );
        assert!(d.event_query(e).unwrap());
        for x in [buf, copy] {
            d.free(x).unwrap();
        }
        d.event_destroy(e).unwrap();
        d.stream_destroy(a).unwrap();
        d.stream_destroy(r).unwrap();
    }
}

#[test]
fn host_streams_are_truly_asynchronous() {
    // Without the wait, the reader's copy runs before the writer's queued write: the writer is held
    // by a gate (a host-side flag, like cuStreamWaitValue32), so this is deterministic, not timed.
    let d = host_driver();
    let (w, r) = (d.stream_create(0).unwrap(), d.stream_create(0).unwrap());
    let len = MIB;
    let buf = d.malloc(0, len).unwrap();
    let copy = d.malloc(0, len).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.fill_pattern(w, buf, len, 1) }.unwrap();
    d.stream_synchronize(w).unwrap();
    let gate = d.gate_stream(w).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.fill_pattern(w, buf, len, 2) }.unwrap(); // queued behind the gate
    assert!(!d.stream_query(w).unwrap(), "the writer must still be busy");
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(r, copy, buf, len) }.unwrap();
    d.stream_synchronize(r).unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.count_pattern_mismatches(r, copy, len, 1) }.unwrap(),
        0,
        "copy saw the old data"
    );
    gate.open();
    d.stream_synchronize(w).unwrap();
    assert!(d.stream_query(w).unwrap());
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.count_pattern_mismatches(r, buf, len, 2) }.unwrap(),
        0,
        "write landed afterwards"
    );
    d.free(buf).unwrap();
    d.free(copy).unwrap();
}

#[test]
fn event_query_and_synchronize() {
    let _device = device_shared();
    for b in backends("event_query_and_synchronize") {
        let d = b.driver.as_ref();
        let s = d.stream_create(0).unwrap();
        let e = d.event_create(0, EventFlags::default()).unwrap();
        assert!(
            d.event_query(e).unwrap(),
            "{}: a never-recorded event is complete",
            b.name
        );
        let gate = b.host.as_ref().map(|h| h.gate_stream(s).unwrap());
        if gate.is_none() {
            d.kernels().sleep(s, 50_000).unwrap();
        }
        d.event_record(e, s).unwrap();
        if let Some(gate) = gate {
            // Deterministic on the host backend: the stream is held, so neither is complete.
            assert!(!d.event_query(e).unwrap());
            assert!(!d.stream_query(s).unwrap());
            gate.open();
        }
        d.event_synchronize(e).unwrap();
        assert!(d.event_query(e).unwrap(), "{}", b.name);
        d.stream_synchronize(s).unwrap();
        assert!(d.stream_query(s).unwrap(), "{}", b.name);
        // Re-recording on an idle stream completes again.
        d.event_record(e, s).unwrap();
        d.event_synchronize(e).unwrap();
        assert!(d.event_query(e).unwrap());
        d.event_destroy(e).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

#[test]
fn a_wait_captures_the_record_current_at_call_time() {
    // Like cuStreamWaitEvent: re-recording the event later does not extend an earlier wait.
    let d = host_driver();
    let (a, b, c) = (
        d.stream_create(0).unwrap(),
        d.stream_create(0).unwrap(),
        d.stream_create(0).unwrap(),
    );
    let e = d.event_create(0, EventFlags::default()).unwrap();
    d.event_record(e, a).unwrap();
    d.event_synchronize(e).unwrap();
    let gate = d.gate_stream(b).unwrap();
    d.event_record(e, b).unwrap(); // held by the gate
    d.stream_wait_event(c, e).unwrap(); // waits for the held record
    assert!(!d.event_query(e).unwrap());
    assert!(!d.stream_query(c).unwrap(), "c must wait for b's record");
    gate.open();
    d.stream_synchronize(c).unwrap();
    assert!(d.event_query(e).unwrap());
}

#[test]
fn destroying_an_event_with_a_record_in_flight_keeps_its_waiters_waiting() {
    // CUDA lets a record finish after cuEventDestroy; a new event must not inherit (and complete)
    // the destroyed event's in-flight record.
    let d = host_driver();
    let (a, b) = (d.stream_create(0).unwrap(), d.stream_create(0).unwrap());
    let gate = d.gate_stream(a).unwrap();
    let e1 = d.event_create(0, EventFlags::default()).unwrap();
    d.event_record(e1, a).unwrap();
    d.stream_wait_event(b, e1).unwrap();
    d.event_destroy(e1).unwrap();
    let e2 = d.event_create(0, EventFlags::default()).unwrap();
    assert!(d.event_query(e2).unwrap(), "a new event starts complete");
    assert!(
        !d.stream_query(b).unwrap(),
        "b still waits for the destroyed event's record"
    );
    gate.open();
    d.stream_synchronize(b).unwrap();
    d.event_destroy(e2).unwrap();
}

#[test]
fn misuse_is_a_typed_error() {
    let _device = device_shared();
    for b in backends("misuse_is_a_typed_error") {
        let d = b.driver.as_ref();
        let invalid = |r: cudalloc::Result<()>, what: &str| {
            let err = r.expect_err(what);
            assert_eq!(
                err.kind(),
                ErrorKind::InvalidArgument,
                "{}: {what}: {err}",
                b.name
            );
        };
        let s = d.default_stream(0).unwrap();
        let p = d.malloc(0, MIB).unwrap();
        let foreign = DeviceAddr(0x10);
        invalid(d.malloc(0, 0).map(|_| ()), "size 0");
        invalid(d.malloc(99, MIB).map(|_| ()), "unknown device");
        invalid(d.mem_info(99).map(|_| ()), "mem_info of unknown device");
        invalid(d.stream_create(99).map(|_| ()), "stream on unknown device");
        invalid(d.free(foreign), "free of a foreign pointer");
        invalid(
            d.free(p.offset(512).unwrap()),
            "free of an interior pointer",
        );
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        invalid(
            unsafe { d.memset(s, foreign, 0, 1) },
            "memset of a foreign pointer",
        );
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        invalid(
            unsafe { d.memset(s, p, 0, MIB + 1) },
            "memset past the segment end",
        );
        invalid(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.memset(s, p.offset(1).unwrap(), 0, u64::MAX) },
            "length overflow",
        );
        invalid(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.copy_device_to_device(s, p, foreign, 16) },
            "copy from a foreign pointer",
        );
        invalid(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.copy_host_to_device(s, foreign, &[1, 2, 3]) },
            "upload to a foreign pointer",
        );
        invalid(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().fill_pattern(s, p, MIB * 2, 1) },
            "fill past the end",
        );
        invalid(
            d.ipc()
                .ipc_export_memory(p.offset(512).unwrap())
                .map(|_| ()),
            "export of an interior pointer",
        );
        // Same-process open of our own handle is refused.
        let handle = d.ipc().ipc_export_memory(p).unwrap();
        assert!(
            d.ipc().ipc_open_memory(0, &handle).is_err(),
            "{}: same-process open",
            b.name
        );
        // Events: not interprocess -> not exportable; destroyed ids are unknown.
        let e = d.event_create(0, EventFlags::default()).unwrap();
        invalid(
            d.ipc().ipc_export_event(e).map(|_| ()),
            "export of a plain event",
        );
        d.event_destroy(e).unwrap();
        invalid(d.event_query(e).map(|_| ()), "query of a destroyed event");
        invalid(d.event_destroy(e), "double destroy");
        let t = d.stream_create(0).unwrap();
        d.stream_destroy(t).unwrap();
        invalid(d.stream_synchronize(t), "synchronize of a destroyed stream");
        invalid(d.stream_destroy(s), "destroying the default stream");
        invalid(
            d.ipc().ipc_close_memory(p),
            "closing a segment that was allocated, not opened",
        );
        d.free(p).unwrap();
        invalid(d.free(p), "double free");
        // Garbage handles never panic.
        let garbage = IpcMemHandle([0x5A; 64]);
        assert!(d.ipc().ipc_open_memory(0, &garbage).is_err());
        assert!(d.ipc().ipc_open_event(0, &IpcEventHandle([0; 64])).is_err());
    }
}

#[test]
fn host_objects_leave_no_shared_memory_behind() {
    let d = host_driver();
    let prefix = d.shm_name_prefix();
    let p = d.malloc(0, MIB).unwrap();
    let q = d.malloc(1, MIB).unwrap();
    let e = d
        .event_create(0, EventFlags { interprocess: true })
        .unwrap();
    d.event_record(e, d.default_stream(0).unwrap()).unwrap();
    assert_eq!(
        shm_names_with_prefix(&prefix).len(),
        3,
        "two segments and one event chunk"
    );
    d.free(p).unwrap();
    assert_eq!(
        shm_names_with_prefix(&prefix).len(),
        2,
        "free unlinks the segment"
    );
    let _ = q; // still allocated when the driver drops
    drop(d);
    assert!(
        shm_names_with_prefix(&prefix).is_empty(),
        "drop unlinks everything"
    );
}

// ----- cross-process -------------------------------------------------------------------------

const CHILD_ENTRY: &str = "cross_process_child";

/// Parent side. The child opens the parent's segment and interprocess event, verifies the parent's
/// pattern after waiting on the event (the parent's fill is queued behind a 300 ms sleep, so without
/// the wait the child would see stale bytes), checks that a second open fails, writes its own
/// pattern and hands back its own interprocess event; the parent waits on that event and sees the
/// child's bytes. Then the parent frees the segment and the child sees the poison (host backend).
fn cross_process(backend: &str) {
    let d = child_driver(backend);
    let s = d.stream_create(0).unwrap();
    let len = 4 * MIB;
    let seg = d.malloc(0, len).unwrap();
    let ev = d
        .event_create(0, EventFlags { interprocess: true })
        .unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, seg, 0, len) }.unwrap();
    d.kernels().sleep(s, 300_000).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, seg, len, 11) }.unwrap();
    d.event_record(ev, s).unwrap();
    let mem_handle = d.ipc().ipc_export_memory(seg).unwrap();
    let ev_handle = d.ipc().ipc_export_event(ev).unwrap();
    assert!(
        d.ipc().ipc_open_memory(0, &mem_handle).is_err(),
        "same-process open must fail"
    );

    let mut child = ChildProcess::spawn(CHILD_ENTRY, "cross_process", backend);
    child.send(&format!(
        "mem={} event={} len={len}",
        hex(&mem_handle.0),
        hex(&ev_handle.0)
    ));
    let answer = child.recv();
    assert_eq!(
        field(&answer, "mismatches"),
        "0",
        "child saw stale or wrong bytes: {answer}"
    );
    assert_eq!(field(&answer, "double_open"), "refused", "{answer}");

    let child_event = d
        .ipc()
        .ipc_open_event(0, &IpcEventHandle(unhex64(field(&answer, "event"))))
        .unwrap();
    d.stream_wait_event(s, child_event).unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().count_pattern_mismatches(s, seg, len, 22) }.unwrap(),
        0,
        "parent must see the child's writes"
    );

    d.free(seg).unwrap();
    child.send("freed");
    let after = child.recv();
    if backend == "host" {
        assert_eq!(
            field(&after, "non_poison"),
            "0",
            "freed memory must read as poison: {after}"
        );
    }
    child.send("bye");
    child.finish();
    d.event_destroy(child_event).unwrap();
    d.event_destroy(ev).unwrap();
}

#[test]
fn cross_process_segment_and_events() {
    cross_process("host");
    let _device = device_shared();
    if cuda_present("cross_process_segment_and_events") {
        cross_process("cuda");
    }
}

#[test]
#[ignore = "child process entry: run by cross_process_segment_and_events"]
fn cross_process_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    assert_eq!(role, "cross_process");
    let backend = std::env::var(BACKEND_VAR).unwrap();
    let d = child_driver(&backend);
    let mut parent = ParentLink::new();
    let line = parent.recv();
    let mem = IpcMemHandle(unhex64(field(&line, "mem")));
    let ev = IpcEventHandle(unhex64(field(&line, "event")));
    let len: u64 = field(&line, "len").parse().unwrap();

    let s = d.stream_create(0).unwrap();
    let seg = d.ipc().ipc_open_memory(0, &mem).unwrap();
    assert_eq!(seg.size, len);
    let double_open = if d.ipc().ipc_open_memory(0, &mem).is_err() {
        "refused"
    } else {
        "accepted"
    };
    let parent_event = d.ipc().ipc_open_event(0, &ev).unwrap();
    d.stream_wait_event(s, parent_event).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let mismatches = unsafe { d.kernels().count_pattern_mismatches(s, seg.ptr, len, 11) }.unwrap();

    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, seg.ptr, len, 22) }.unwrap();
    let mine = d
        .event_create(0, EventFlags { interprocess: true })
        .unwrap();
    d.event_record(mine, s).unwrap();
    let mine_handle = d.ipc().ipc_export_event(mine).unwrap();
    parent.send(&format!(
        "mismatches={mismatches} double_open={double_open} event={}",
        hex(&mine_handle.0)
    ));

    assert_eq!(parent.recv(), "freed");
    let mut bytes = vec![0u8; len as usize];
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_host(s, &mut bytes, seg.ptr) }.unwrap();
    parent.send(&format!("non_poison={}", pattern::count_non_poison(&bytes)));
    assert_eq!(parent.recv(), "bye");
    d.ipc().ipc_close_memory(seg.ptr).unwrap();
    d.event_destroy(parent_event).unwrap();
    d.event_destroy(mine).unwrap();
}

#[test]
fn virtual_memory_maps_chunks_into_reservations_and_shares_them_by_descriptor() {
    let _device = device_shared();
    for b in backends("virtual_memory_maps_chunks_into_reservations") {
        let d = b.driver.as_ref();
        let s = d.default_stream(0).unwrap();
        let g = d.vm().vm_granularity(0).unwrap();
        assert!(g > 0 && g.is_power_of_two(), "{}: granularity {g}", b.name);
        let base = d.vm().vm_reserve(0, 4 * g).unwrap();
        let (c1, c2) = (
            d.vm().vm_create_chunk(0, g).unwrap(),
            d.vm().vm_create_chunk(0, g).unwrap(),
        );
        d.vm().vm_map(base, c1).unwrap();
        d.vm().vm_map(base.offset(g).unwrap(), c2).unwrap();
        // A range across the two chunks is one range.
        let across = base.offset(g / 2).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(s, across, g, 5) }.unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(s, across, g, 5) }.unwrap(),
            0,
            "{}",
            b.name
        );
        // Not mapped, misaligned, overlapping, partial: refused.
        let hole = base.offset(2 * g).unwrap();
        for err in [
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.memset(s, hole, 0, 16) }.unwrap_err(),
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.memset(s, base.offset(2 * g - 8).unwrap(), 0, 16) }.unwrap_err(),
            d.vm().vm_map(base.offset(g / 2).unwrap(), c1).unwrap_err(),
            d.vm().vm_map(base, c2).unwrap_err(),
            d.vm().vm_unmap(base, g / 2).unwrap_err(),
            d.vm().vm_free_reservation(base).unwrap_err(),
            d.vm().vm_create_chunk(0, g + 1).unwrap_err(),
            d.vm().vm_reserve(0, g / 2).unwrap_err(),
        ] {
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{}: {err}", b.name);
        }
        // A chunk's descriptor, imported, is the same memory: write through one mapping, read
        // through the other.
        let exported = d.vm().vm_export_chunk(c1).unwrap();
        let c3 = d.vm().vm_import_chunk(0, exported, g).unwrap();
        d.vm().vm_map(hole, c3).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(s, base, g, 6) }.unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(s, hole, g, 6) }.unwrap(),
            0,
            "{}",
            b.name
        );
        // Released while mapped: still usable until unmapped.
        d.vm().vm_release_chunk(c1).unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(s, base, g, 6) }.unwrap(),
            0,
            "{}",
            b.name
        );
        d.vm().vm_unmap(base, 2 * g).unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.memset(s, base, 0, 1) }.unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        if b.name == "host" {
            // Poison-on-free: the chunk's last local mapping is gone and it was released, so
            // another holder of its memory (here the import) now reads the poison pattern.
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            let wrong = unsafe { d.kernels().count_pattern_mismatches(s, hole, g, 6) }.unwrap();
            assert!(
                wrong > g - g / 64,
                "host: only {wrong} of {g} bytes poisoned"
            );
        }
        d.vm().vm_unmap(hole, g).unwrap();
        for chunk in [c2, c3] {
            d.vm().vm_release_chunk(chunk).unwrap();
        }
        assert!(
            d.vm().vm_release_chunk(c2).is_err(),
            "{}: released twice",
            b.name
        );
        d.vm().vm_free_reservation(base).unwrap();
    }
}

/// Work on a plain segment that begins exactly where a reservation ends: the address is the
/// segment's, not one past the reservation's (a CI run failed a copy this way when the operating
/// system placed a new reservation right below a segment). The simulator places them so always;
/// the other backends are asked for pairs until one is adjacent (or say that none was).
#[test]
fn a_segment_right_after_a_reservation_is_its_own() {
    let _device = device_shared();
    let sim: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 256 * MIB).unwrap());
    let sim = TestBackend {
        name: "sim",
        driver: sim,
        host: None,
    };
    for b in backends("a_segment_right_after_a_reservation_is_its_own")
        .into_iter()
        .chain([sim])
    {
        let d = b.driver.as_ref();
        let s = d.default_stream(0).unwrap();
        let g = d.vm().vm_granularity(0).unwrap();
        let (mut reservations, mut segments, mut adjacent) = (Vec::new(), Vec::new(), None);
        for attempt in 0..16 {
            // Both orders: a reservation made after a segment lands below it when mappings grow
            // down, one made before lies below the next segment when they grow up.
            let (r, m) = if attempt % 2 == 0 {
                let m = d.malloc(0, g).unwrap();
                (d.vm().vm_reserve(0, g).unwrap(), m)
            } else {
                let r = d.vm().vm_reserve(0, g).unwrap();
                (r, d.malloc(0, g).unwrap())
            };
            reservations.push(r);
            segments.push(m);
            if r.offset(g).unwrap() == m {
                adjacent = Some((r, m));
                break;
            }
        }
        match adjacent {
            Some((r, m)) => {
                let chunk = d.vm().vm_create_chunk(0, g).unwrap();
                d.vm().vm_map(r, chunk).unwrap();
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe { d.memset(s, m, 7, g) }.unwrap();
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe { d.copy_device_to_device(s, r, m, g) }.unwrap();
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe { d.memset(s, m.offset(g - 1).unwrap(), 7, 1) }.unwrap();
                if b.name != "sim" {
                    assert_eq!(read(d, r, 16), vec![7u8; 16], "{}", b.name);
                }
                // A range running from the reservation into the segment is still refused.
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                let err = unsafe { d.memset(s, r.offset(g / 2).unwrap(), 0, g) }.unwrap_err();
                assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{}: {err}", b.name);
                d.stream_synchronize(s).unwrap();
                d.vm().vm_unmap(r, g).unwrap();
                d.vm().vm_release_chunk(chunk).unwrap();
            }
            None => {
                assert_ne!(b.name, "sim", "the simulator places them adjacent");
                println!("{}: no segment landed right after a reservation", b.name);
            }
        }
        for r in reservations {
            d.vm().vm_free_reservation(r).unwrap();
        }
        for m in segments {
            d.free(m).unwrap();
        }
    }
}

#[test]
fn chunks_count_against_capacity_and_out_of_memory_is_typed() {
    let _device = device_alone();
    for b in backends("chunks_count_against_capacity") {
        let d = b.driver.as_ref();
        let g = d.vm().vm_granularity(0).unwrap();
        let size = (d.mem_info(0).unwrap().total / 3 / g).max(1) * g;
        let mut chunks = Vec::new();
        let err = loop {
            match d.vm().vm_create_chunk(0, size) {
                Ok(c) => chunks.push(c),
                Err(e) => break e,
            }
            assert!(chunks.len() <= 8, "{}: too many chunks fit", b.name);
        };
        assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{}: {err}", b.name);
        for c in chunks {
            d.vm().vm_release_chunk(c).unwrap();
        }
        d.vm()
            .vm_release_chunk(d.vm().vm_create_chunk(0, size).unwrap())
            .unwrap();
    }
}
