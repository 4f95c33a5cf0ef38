//! Shared memory is untrusted input: ref-counter files and event chunks that another process
//! scribbled over must not panic, hang or harm anything but the storages they concern.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cudalloc::backend::capability::Ipc;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use common::*;
use cudalloc::{backend::Driver, backend::EventFlags, ipc::IpcHandle, Runtime, Storage};

const CHILD: &str = "untrusted_child";
/// Offsets in a ref-counter file (see `src/ipc/refcount.rs`): ring control, then the slots.
const CONTROL: u64 = 64;
const SLOTS: u64 = 128 + 4 * 1024;

fn scribble(name: &str, offset: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/dev/shm/{name}"))
        .unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

fn allocator() -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(test_config(""))
            .ipc_slots_per_file(16)
            .build(Arc::new(host_driver()))
            .unwrap(),
    )
}

#[test]
fn a_scribbled_release_ring_neither_panics_nor_loses_the_storage() {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    s.fill_pattern(1).unwrap();
    let handle = s.share_ipc().unwrap();
    let ref_file = handle.wire().ref_file.clone();
    let mut child = ChildProcess::spawn(CHILD, "hold_then_release", "host");
    child.send(&hex(&handle.into_bytes()));
    assert_eq!(child.recv(), "holding");
    drop(s);
    assert_eq!(a.ipc_limbo().0, 1);
    // head = u64::MAX, tail = 3: positions that overflow any arithmetic on them.
    let mut control = u64::MAX.to_le_bytes().to_vec();
    control.extend_from_slice(&3u64.to_le_bytes());
    scribble(&ref_file, CONTROL, &control);
    child.send("release");
    assert_eq!(child.recv(), "released");
    child.finish();
    a.ipc_drain();
    // Whatever the ring said, the counters decide: the storage is freed, exactly once.
    a.ipc_collect();
    assert_eq!(a.ipc_limbo(), (0, 0));
    // Ring positions below: head > tail.
    let s2 = Storage::new(&a, 0, 4096).unwrap();
    let h2 = s2.share_ipc().unwrap();
    scribble(&ref_file, CONTROL, &[0xff; 20]);
    drop(h2);
    drop(s2);
    a.ipc_collect();
    assert_eq!(a.ipc_limbo(), (0, 0));
}

#[test]
fn scribbled_slot_counters_keep_only_their_storage() {
    let a = allocator();
    let victim = Storage::new(&a, 0, 4096).unwrap();
    let other = Storage::new(&a, 0, 4096).unwrap();
    let hv = victim.share_ipc().unwrap();
    let ho = other.share_ipc().unwrap();
    let ref_file = hv.wire().ref_file.clone();
    let slot = u64::from(hv.wire().slot);
    // pending = held = u64::MAX for the victim's slot.
    scribble(&ref_file, SLOTS + slot * 16, &[0xff; 16]);
    drop((hv, ho, victim, other));
    a.ipc_collect();
    // The victim's memory stays in limbo (its counters can no longer be trusted to reach 0);
    // the other storage is freed normally.
    assert_eq!(a.ipc_limbo().0, 1);
}

#[test]
fn a_scribbled_event_chunk_cannot_hang_or_panic_its_owner() {
    let driver = Arc::new(host_driver());
    let prefix = driver.shm_name_prefix();
    let stream = driver.default_stream(0).unwrap();
    let e = driver
        .event_create(0, EventFlags { interprocess: true })
        .unwrap();
    driver.ipc_export_event(e).unwrap();
    driver.event_record(e, stream).unwrap();
    driver.stream_synchronize(stream).unwrap();
    let chunk = format!("{prefix}evt0");
    // Every counter at u64::MAX (overflows a naive `+ 1`), then back to 0 after a record (a naive
    // wait for `completed >= recorded` never ends).
    scribble(&chunk, 0, &[0xff; 64 * 8]);
    driver.event_record(e, stream).unwrap();
    scribble(&chunk, 64, &[0; 64 * 8]);
    driver.event_synchronize(e).unwrap();
    assert!(driver.event_query(e).unwrap());
    let other = driver.stream_create(0).unwrap();
    driver.stream_wait_event(other, e).unwrap();
    driver.stream_synchronize(other).unwrap();
    driver.event_destroy(e).unwrap();
    // An allocator over the same driver: its events, empty_cache and teardown still work.
    let a = Arc::new(Runtime::new(driver, Default::default()).unwrap());
    let s = Storage::new(&a, 0, 1 << 20).unwrap();
    let c = s.lazy_clone().unwrap();
    c.fill_pattern(5).unwrap();
    drop(s);
    a.empty_cache();
    assert_eq!(c.count_pattern_mismatches(5).unwrap(), 0);
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn untrusted_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut parent = ParentLink::new();
    match role.as_str() {
        "hold_then_release" => {
            let a = allocator();
            let h = IpcHandle::from_bytes(&unhex(&parent.recv())).unwrap();
            let s = Storage::from_ipc(&a, h).unwrap();
            assert_eq!(s.count_pattern_mismatches(1).unwrap(), 0);
            parent.send("holding");
            assert_eq!(parent.recv(), "release");
            drop(s);
            parent.send("released");
        }
        other => panic!("unknown role {other}"),
    }
}
