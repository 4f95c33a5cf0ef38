//! What the stream sanitizer did not see (issue 36), 100 times out of 100 each: an access that
//! runs past its allocation (checked against the allocator's block, not the 2 MiB segment), a
//! write into memory lazy clones still share (through a read pointer). Correct code beside each
//! is never reported. (The third blind spot, a lazy clone's copy reported as a plain
//! `copy_device_to_device`, is `sanitizer.rs::a_cow_copy_raced_by_a_kernel_is_reported_every_time`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{no_reports, one_report, sanitized_host_runtime};
use cudalloc::{
    backend::HostKernelMemory, backend::HostRange, sanitizer::HazardKind, ErrorKind, Storage,
};

const ROUNDS: usize = 100;
const MIB: u64 = 1 << 20;

/// Before: a host kernel declaring a 4096-byte write over a 16-byte storage zeroed the tensor
/// next to it, 0 reports (ranges were checked against the segment). Now the write is refused
/// before it runs, the report names the allocation, and the neighbour keeps its bytes.
#[test]
fn an_access_past_its_allocation_is_reported_and_refused() {
    let rt = sanitized_host_runtime();
    let host = rt.driver().as_host().unwrap();
    for round in 0..ROUNDS {
        // A report fails its stream (sticky): the bad write goes on a fresh stream `s` that
        // waited for `t`, where the storages live and the checks run.
        let t = rt.create_stream(0).unwrap();
        let small = Storage::new_on(&rt, t, 16).unwrap();
        let neighbour = common::filled_on(&rt, t, 4096, round as u64);
        let s = rt.create_stream(0).unwrap();
        common::wait_for(&rt, s, t);
        // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
        let err = unsafe {
            host.enqueue_host(
                s,
                [HostRange::write(
                    small.mutable_data_ptr_on(t).unwrap(),
                    4096,
                )],
                |m: &mut HostKernelMemory<1>| m.write(0, 0, &[0; 4096]),
            )
        }
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
        let report = one_report(&rt, HazardKind::OutOfBounds);
        let allocation = report.later.allocation.clone().unwrap_or_default();
        assert!(allocation.starts_with("allocation #"), "{report}");
        assert!(report.to_string().contains("past the end"), "{report}");
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                rt.driver().kernels().count_pattern_mismatches(
                    t,
                    neighbour.unordered_data_ptr(),
                    4096,
                    round as u64,
                )
            }
            .unwrap(),
            0
        );
        // Inside the allocation: never reported.
        let fine = Storage::new_on(&rt, t, 16).unwrap();
        // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
        unsafe {
            host.enqueue_host(
                t,
                [HostRange::write(fine.mutable_data_ptr_on(t).unwrap(), 16)],
                |m: &mut HostKernelMemory<1>| m.write(0, 0, &[1; 16]),
            )
        }
        .unwrap();
        no_reports(&rt);
        rt.driver().stream_synchronize(t).unwrap();
        drop((small, neighbour, fine));
    }
}

/// Before: a write through a lazy clone's `data_ptr()` (its read pointer) overwrote the source,
/// `clone[0] = 9, a[0] = 9`, 0 reports. Now it is refused and reported; writing through
/// `mutable_data_ptr` (which copies first) is never reported, and once the clone owns its bytes
/// any pointer may write them.
#[test]
fn a_write_into_memory_lazy_clones_share_is_reported() {
    let rt = sanitized_host_runtime();
    for round in 0..ROUNDS {
        let t = rt.create_stream(0).unwrap();
        let a = common::filled_on(&rt, t, 4096, round as u64);
        let clone = a.lazy_clone().unwrap();
        // The bad write on a fresh stream that waited for `t` (a report fails its stream).
        let s = rt.create_stream(0).unwrap();
        common::wait_for(&rt, s, t);
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        let err = unsafe { rt.driver().memset(s, clone.unordered_data_ptr(), 9, 16) }.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
        let report = one_report(&rt, HazardKind::CowWrite);
        assert!(report.to_string().contains("lazy clones share"), "{report}");
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                rt.driver().kernels().count_pattern_mismatches(
                    t,
                    a.unordered_data_ptr(),
                    4096,
                    round as u64,
                )
            }
            .unwrap(),
            0
        );
        // The right door: the clone's first write copies, then writes its own bytes.
        let own = clone.mutable_data_ptr_on(t).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().memset(t, own, 9, 16) }.unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().memset(t, clone.unordered_data_ptr(), 8, 16) }.unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                rt.driver().kernels().count_pattern_mismatches(
                    t,
                    a.unordered_data_ptr(),
                    4096,
                    round as u64,
                )
            }
            .unwrap(),
            0
        );
        no_reports(&rt);
        rt.driver().stream_synchronize(t).unwrap();
    }
}

/// The last reference steals the memory: from then on it is the storage's alone, and a write
/// through either pointer is never reported.
#[test]
fn a_stolen_lazy_clone_owns_its_bytes() {
    let rt = sanitized_host_runtime();
    let s = rt.create_stream(0).unwrap();
    for round in 0..ROUNDS {
        let a = common::filled_on(&rt, s, MIB, round as u64);
        let clone = a.lazy_clone().unwrap();
        drop(a);
        let p = clone.mutable_data_ptr_on(s).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().memset(s, p, 1, 16) }.unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().memset(s, clone.unordered_data_ptr(), 2, 16) }.unwrap();
        no_reports(&rt);
    }
    rt.driver().stream_synchronize(s).unwrap();
}

/// Found by review: a sleep forgot the allocations of its tag, so after the wake neither check
/// applied to them (both writes below went unreported). The wake's own restore of the offloaded
/// bytes — into memory a lazy clone shares — is the allocator's, and never reported.
#[test]
fn after_a_sleep_and_wake_both_checks_hold_and_the_wake_is_not_reported() {
    let rt = sanitized_host_runtime();
    let v = common::tagged(&rt, "w", &[4096, 4096], 7);
    let c = v[0].lazy_clone().unwrap();
    rt.sleep(&["w"], &[]).unwrap();
    rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    no_reports(&rt);
    let t = rt.create_stream(0).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let err = unsafe { rt.driver().memset(t, c.unordered_data_ptr(), 1, 16) }.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
    one_report(&rt, HazardKind::CowWrite);
    let t2 = rt.create_stream(0).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let err = unsafe { rt.driver().memset(t2, v[1].unordered_data_ptr(), 1, 8192) }.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
    one_report(&rt, HazardKind::OutOfBounds);
    assert_eq!(
        v[1].count_pattern_mismatches(8).unwrap(),
        0,
        "the second storage kept its bytes"
    );
}

/// Before: a kernel touching bytes of an allocator segment that no allocation held (the tail of a
/// segment the allocator never handed out) was not reported: the bounds were checked only for
/// accesses that began in, or ran into, a live allocation. Now it is refused as out of bounds,
/// naming the allocator's segment; the live allocation beside it is never reported.
#[test]
fn an_access_to_memory_the_allocator_never_handed_out_is_reported() {
    let rt = sanitized_host_runtime();
    let host = rt.driver().as_host().unwrap();
    for _ in 0..ROUNDS {
        let t = rt.create_stream(0).unwrap();
        // One small block in a fresh 2 MiB segment: 1 MiB past it is nobody's.
        let small = Storage::new_on(&rt, t, 512).unwrap();
        let nobodys = small.unordered_data_ptr().offset(MIB).unwrap();
        let s = rt.create_stream(0).unwrap();
        common::wait_for(&rt, s, t);
        // SAFETY: raw test ranges; no typed kernel sees them (the write is refused before it runs).
        let err = unsafe {
            host.enqueue_host(
                s,
                [HostRange::write(nobodys, 64)],
                |m: &mut HostKernelMemory<1>| m.write(0, 0, &[7; 64]),
            )
        }
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
        let report = one_report(&rt, HazardKind::OutOfBounds);
        assert!(report.to_string().contains("never handed out"), "{report}");
        // The live allocation: never reported.
        // SAFETY: as above; the storage's own bytes, on its stream.
        unsafe {
            host.enqueue_host(
                t,
                [HostRange::write(small.mutable_data_ptr_on(t).unwrap(), 512)],
                |m: &mut HostKernelMemory<1>| m.write(0, 0, &[1; 512]),
            )
        }
        .unwrap();
        no_reports(&rt);
        rt.driver().stream_synchronize(t).unwrap();
        drop(small);
    }
}
