//! Fuzz-style tests of the handle decoder: over a million random and mutated inputs, no panic;
//! every mutation of a valid handle is rejected; structurally valid handles that name files or
//! slots that do not exist are rejected with `InvalidIpcHandle`, never a crash.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use cudalloc::internals::pattern;
use cudalloc::internals::{WireHandle, WirePages, WIRE_SIZE};
use cudalloc::{
    backend::Backend, backend::HostDriver, ipc::IpcHandle, ErrorKind, Runtime, Storage,
};

fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut i = 0u64;
    move || {
        i += 1;
        pattern::word(seed, i)
    }
}

fn valid() -> WireHandle {
    WireHandle {
        backend: Backend::Host,
        device: 0,
        producer_pid: 4242,
        slot: 3,
        memory: [7; 64],
        segment_size: 2 << 20,
        offset: 512,
        nbytes: 4096,
        ref_file: "cudalloc-4242-0123456789abcdef-ref0".into(),
        event: Some([1; 64]),
        generation: 9,
        expires_ms: 0,
        pages: None,
    }
}

/// A valid handle of memory in an expandable segment (pages instead of a memory handle).
fn valid_expandable() -> WireHandle {
    WireHandle {
        memory: [0; 64],
        segment_size: 4 << 21,
        offset: (1 << 21) + 512,
        pages: Some(WirePages {
            page: 2 << 20,
            first: 0x7e00_0000_0000,
            count: 4,
            secret: [0x3c; 16],
        }),
        ..valid()
    }
}

#[test]
fn a_million_random_and_mutated_inputs_never_panic() {
    let mut next = rng(0xF022);
    let bases = [valid().encode(), valid_expandable().encode()];
    let mut rejected = 0u64;
    for round in 0..1_100_000u64 {
        let base = &bases[(round / 4 % 2) as usize];
        let input: Vec<u8> = match round % 4 {
            // Pure noise of random length.
            0 => (0..next() % 300).map(|_| next() as u8).collect(),
            // Noise of exactly the right length.
            1 => (0..WIRE_SIZE).map(|_| next() as u8).collect(),
            // A valid handle with 1..4 bytes changed.
            2 => {
                let mut b = base.clone();
                for _ in 0..1 + next() % 4 {
                    let at = (next() % WIRE_SIZE as u64) as usize;
                    b[at] ^= 1 + (next() % 255) as u8;
                }
                b
            }
            // Truncated or extended.
            _ => {
                let mut b = base.clone();
                if next().is_multiple_of(2) {
                    b.truncate((next() % WIRE_SIZE as u64) as usize);
                } else {
                    b.extend((0..1 + next() % 8).map(|_| next() as u8));
                }
                b
            }
        };
        if WireHandle::parse(&input).is_err() {
            rejected += 1;
        } else if &input != base {
            // (Two changes of one byte can cancel out: then the handle is the valid one.)
            assert!(
                round % 4 != 2 && round % 4 != 3,
                "a corrupted handle was accepted (round {round})"
            );
        }
    }
    assert!(rejected > 1_000_000, "{rejected}");
}

#[test]
fn structured_handles_with_bad_fields_are_rejected() {
    let mut next = rng(0x57);
    for _ in 0..50_000 {
        let mut h = valid();
        match next() % 6 {
            0 => h.offset = next(),
            1 => h.nbytes = next(),
            2 => {
                h.producer_pid = if next().is_multiple_of(2) {
                    0
                } else {
                    u32::MAX
                }
            }
            3 => {
                h.ref_file = [
                    "../x-ref1",
                    "cudalloc-1/2-ref3",
                    "cudalloc-1-2-seg3",
                    "cudalloc-..-ref4",
                    "x",
                ][(next() % 5) as usize]
                    .into()
            }
            4 => h.segment_size = next() % 1000,
            _ => {
                h.offset = u64::MAX - (next() % 10);
                h.nbytes = 100;
            }
        }
        let ok = h
            .offset
            .checked_add(h.nbytes)
            .is_some_and(|e| e <= h.segment_size)
            && h.producer_pid != 0
            && h.producer_pid <= i32::MAX as u32
            && h.ref_file.starts_with("cudalloc-")
            && !h.ref_file.contains('/')
            && !h.ref_file.contains("..")
            && h.ref_file.contains("-ref");
        assert_eq!(WireHandle::parse(&h.encode()).is_ok(), ok, "{h:?}");
    }
}

#[test]
fn handles_naming_missing_files_or_slots_are_typed_errors() {
    // Nonexistent file.
    let missing = IpcHandle::from_bytes(&valid().encode()).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::InvalidIpcHandle, "{missing}");
    // A real file of ours (same process), slot out of range, then a wrong producer pid.
    let a = Arc::new(
        Runtime::builder()
            .ipc_slots_per_file(8)
            .build(Arc::new(
                HostDriver::builder()
                    .memory_per_device(64 << 20)
                    .build()
                    .unwrap(),
            ))
            .unwrap(),
    );
    let s = Storage::new(&a, 0, 4096).unwrap();
    let good = s.share_ipc().unwrap();
    let mut wire = good.wire().clone();
    drop(good);
    wire.slot = 8;
    assert_eq!(
        IpcHandle::from_bytes(&wire.encode()).unwrap_err().kind(),
        ErrorKind::InvalidIpcHandle
    );
    wire.slot = 0;
    wire.producer_pid += 1;
    assert_eq!(
        IpcHandle::from_bytes(&wire.encode()).unwrap_err().kind(),
        ErrorKind::InvalidIpcHandle
    );
    drop(s);
    assert_eq!(a.ipc_limbo().0, 0);
}
