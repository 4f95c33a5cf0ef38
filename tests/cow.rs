//! Copy-on-write: ports of c10's `cow_test.cpp` cases (named after them), `test_torch.py`'s lazy
//! clone checks, and host-backend stream-order, stress and out-of-memory tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use cudalloc::internals::cell::{CowCell, Materialized};
use cudalloc::{backend::Driver, ErrorKind, Runtime, Storage};

const MIB: u64 = 1 << 20;

fn allocator() -> Arc<Runtime> {
    checked_allocator(test_driver(), "")
}

fn live_blocks(a: &Runtime) -> i64 {
    a.memory_stats(0).unwrap().allocation.all.current
}

struct CountsDrops(Arc<AtomicUsize>);
impl Drop for CountsDrops {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn context_basic() {
    let drops = Arc::new(AtomicUsize::new(0));
    let cell = CowCell::new(CountsDrops(drops.clone()), 1);
    assert_eq!(cell.refs(), 1);
    cell.add_ref();
    assert_eq!(cell.refs(), 2);
    // Not the last reference: nothing handed back.
    assert!(cell.release().is_none());
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    // The last reference gets the data; dropping it frees it exactly once.
    let data = cell.release().unwrap();
    drop(data);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    assert!(cell.with_data(|d| d.is_none()));
}

#[test]
fn context_materialize_copies_unless_last() {
    let cell = CowCell::new(41u64, 2);
    match cell.materialize(|src| Ok(*src + 1)).unwrap() {
        Materialized::Copied(v) => assert_eq!(v, 42),
        Materialized::Stole(_) => panic!("not the last reference"),
    }
    match cell
        .materialize(|_| -> cudalloc::Result<u64> { panic!("no copy for the last reference") })
        .unwrap()
    {
        Materialized::Stole(v) => assert_eq!(v, 41),
        Materialized::Copied(_) => panic!("the last reference steals"),
    }
    // A failing preparation changes nothing.
    let cell = CowCell::new(1u64, 2);
    let failed =
        cell.materialize(|_| Err::<u64, _>(cudalloc::Error::InvalidArgument("no memory".into())));
    assert!(failed.is_err());
    assert_eq!(cell.refs(), 2);
}

#[test]
fn deleter_path() {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let clones: Vec<_> = (0..3).map(|_| s.lazy_clone().unwrap()).collect();
    assert_eq!(live_blocks(&a), 1, "lazy clones allocate nothing");
    drop(s);
    drop(clones);
    assert_eq!(
        live_blocks(&a),
        0,
        "the data is freed once, with the last reference"
    );
    a.check_invariants().unwrap();
}

#[test]
fn lazy_clone_of_a_plain_storage() {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    assert!(!s.is_cow());
    let c = s.lazy_clone().unwrap();
    assert!(s.is_cow(), "the source is converted in place");
    assert!(c.is_cow());
    assert!(!c.is_alias_of(&s), "a lazy clone is a distinct storage");
    assert_eq!(
        c.unordered_data_ptr(),
        s.unordered_data_ptr(),
        "sharing the same data"
    );
}

#[test]
fn lazy_clone_of_an_already_cow_storage() {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let c1 = s.lazy_clone().unwrap();
    let c2 = c1.lazy_clone().unwrap();
    assert!(c2.is_cow());
    assert_eq!(c2.unordered_data_ptr(), s.unordered_data_ptr());
    assert_eq!(live_blocks(&a), 1);
}

#[test]
fn lazy_clone_of_a_shared_storage_is_an_eager_copy() {
    // Shared memory is an alias of other processes' storages: a COW view of it could change under
    // the clone (a consumer writes) and a steal would take it from them. So, as PyTorch does for
    // storages whose data pointer is not its own, the clone is a stream-ordered copy up front.
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    s.fill_pattern(3).unwrap();
    let handle = s.share_ipc().unwrap();
    let c = s.lazy_clone().unwrap();
    assert!(!c.is_cow() && !s.is_cow());
    assert_ne!(c.unordered_data_ptr(), s.unordered_data_ptr());
    assert_eq!(c.count_pattern_mismatches(3).unwrap(), 0);
    s.fill_pattern(4).unwrap();
    assert_eq!(c.count_pattern_mismatches(3).unwrap(), 0);
    drop(handle);
}

#[test]
fn materialize_of_a_non_cow_storage_is_a_no_op() {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let before = s.unordered_data_ptr();
    assert_eq!(s.unordered_mutable_data_ptr().unwrap(), before);
    assert!(!s.is_cow());
}

#[test]
fn materialize_of_a_single_reference_cow_storage_steals() {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let c = s.lazy_clone().unwrap();
    let addr = s.unordered_data_ptr();
    drop(c);
    assert!(s.is_cow(), "still tagged until written");
    assert_eq!(
        s.unordered_mutable_data_ptr().unwrap(),
        addr,
        "steal: same address, no copy"
    );
    assert!(!s.is_cow());
    assert_eq!(live_blocks(&a), 1);
}

#[test]
fn materialize_of_a_shared_cow_storage_copies() {
    let a = allocator();
    let s = Storage::new(&a, 0, MIB).unwrap();
    s.fill_pattern(9).unwrap();
    let c = s.lazy_clone().unwrap();
    let original = s.unordered_data_ptr();
    let written = c.unordered_mutable_data_ptr().unwrap();
    assert_ne!(written, original, "copy: new address");
    assert_eq!(
        s.unordered_data_ptr(),
        original,
        "the other keeps the original"
    );
    assert_eq!(c.count_pattern_mismatches(9).unwrap(), 0, "same bytes");
    assert!(!c.is_cow());
    assert!(s.is_cow());
    assert_eq!(live_blocks(&a), 2);
    // Now the source is the last reference: it steals.
    assert_eq!(s.unordered_mutable_data_ptr().unwrap(), original);
    assert!(!s.is_cow());
}

#[test]
fn test_lazy_clone_addresses_and_reads() {
    // test_torch.py: addresses are equal until a write; the writer's address changes and the other
    // keeps the original; reads of both (a "binary op") do not materialize.
    let a = allocator();
    let x = Storage::new(&a, 0, 4096).unwrap();
    x.fill_pattern(1).unwrap();
    let y = x.lazy_clone().unwrap();
    assert_eq!(x.unordered_data_ptr(), y.unordered_data_ptr());
    assert_eq!(
        x.count_pattern_mismatches(1).unwrap() + y.count_pattern_mismatches(1).unwrap(),
        0
    );
    assert!(x.is_cow() && y.is_cow(), "reads did not materialize");
    let original = x.unordered_data_ptr();
    y.fill_pattern(2).unwrap(); // a write through y
    assert_ne!(y.unordered_data_ptr(), original);
    assert_eq!(x.unordered_data_ptr(), original);
    assert_eq!(
        x.count_pattern_mismatches(1).unwrap(),
        0,
        "x unaffected by y's write"
    );
    assert_eq!(y.count_pattern_mismatches(2).unwrap(), 0);
}

#[test]
fn a_slow_copier_still_sees_the_original_when_the_stealer_writes_on_another_stream() {
    // The copier's copy is queued behind a gate on stream A; the last reference then steals on
    // stream B and writes at once. The stealer's stream must wait for the copier's event.
    let driver = Arc::new(host_driver());
    let d: Arc<dyn Driver> = common::sanitized(driver.clone());
    let a = checked_allocator(d.clone(), "");
    let (sa, sb) = (a.create_stream(0).unwrap(), a.create_stream(0).unwrap());
    let s = Storage::new(&a, 0, MIB).unwrap();
    s.fill_pattern(1).unwrap();
    let c = s.lazy_clone().unwrap();
    let gate = driver.gate_stream(sa).unwrap();
    // Stream-ordered first writes (`mutable_data_ptr_on`): `mutable_data_ptr()` would wait for
    // the copy, which the gate holds.
    c.mutable_data_ptr_on(sa).unwrap(); // copy enqueued behind the gate
    let addr = s.mutable_data_ptr_on(sb).unwrap(); // last reference: steal
                                                   // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(sb, addr, MIB, 2) }.unwrap(); // write at once on B
    assert!(!d.stream_query(sb).unwrap(), "B waits for the gated copy");
    gate.open();
    d.stream_synchronize(sb).unwrap();
    d.stream_synchronize(sa).unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            d.kernels()
                .count_pattern_mismatches(sa, c.unordered_data_ptr(), MIB, 1)
        }
        .unwrap(),
        0,
        "copy saw the original"
    );
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            d.kernels()
                .count_pattern_mismatches(sb, s.unordered_data_ptr(), MIB, 2)
        }
        .unwrap(),
        0
    );
}

#[test]
fn out_of_memory_during_materialization_leaves_the_storage_cow_and_readable() {
    // Host backend in every run: the expectations need its 64 MiB device.
    let a = checked_allocator(Arc::new(host_driver()), "");
    let s = Storage::new(&a, 0, 40 * MIB).unwrap();
    s.fill_pattern(4).unwrap();
    let c = s.lazy_clone().unwrap();
    let err = c.unordered_mutable_data_ptr().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert!(c.is_cow());
    assert_eq!(c.count_pattern_mismatches(4).unwrap(), 0);
    drop(s);
    assert_eq!(
        c.unordered_mutable_data_ptr().unwrap(),
        c.unordered_data_ptr(),
        "now the last reference: steal"
    );
    a.check_invariants().unwrap();
}

#[test]
fn stress_four_threads_of_concurrent_materializations() {
    let a = Arc::new(Runtime::new(test_driver(), Default::default()).unwrap());
    let baseline = live_blocks(&a);
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                for round in 0..10_000u64 {
                    let seed = t * 1_000_000 + round;
                    let s = Storage::new(&a, 0, 1024).unwrap();
                    s.copy_from_host(
                        s.runtime().current_stream(s.device()).unwrap(),
                        0,
                        &cudalloc::internals::pattern::expected(1024, seed),
                    )
                    .unwrap();
                    let c = s.lazy_clone().unwrap();
                    let (writer, other) = if round % 2 == 0 { (&s, &c) } else { (&c, &s) };
                    writer.unordered_mutable_data_ptr().unwrap();
                    other.unordered_mutable_data_ptr().unwrap();
                    if round % 100 == 0 {
                        assert_eq!(s.count_pattern_mismatches(seed).unwrap(), 0);
                        assert_eq!(c.count_pattern_mismatches(seed).unwrap(), 0);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(live_blocks(&a), baseline);
    a.check_invariants().unwrap();
}

#[test]
fn a_failed_copy_leaves_the_storage_a_valid_cow_storage() {
    // The copy step (allocate, enqueue, record the copier's stream on the source) runs before the
    // reference is given up: a device copy that cannot be enqueued is an error and the storage
    // stays COW with its bytes — it never hands back a "copy" that holds stale bytes. (The step
    // creates no event: a stealer waits for the streams recorded on the source, `handover.rs`.)
    let faulty = Arc::new(common::faulty::FaultyDriver::new(Arc::new(host_driver())));
    let faults = faulty.faults.clone();
    let a = Arc::new(Runtime::builder().build(faulty).unwrap());
    let s = Storage::new(&a, 0, 8192).unwrap();
    s.fill_pattern(3).unwrap();
    let c = s.lazy_clone().unwrap();
    faults
        .device_copies
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let err = c
        .copy_from_host(
            c.runtime().current_stream(c.device()).unwrap(),
            0,
            &[1, 2, 3],
        )
        .unwrap_err();
    assert!(err.to_string().contains("injected"), "{err}");
    faults
        .device_copies
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(c.is_cow(), "still a COW storage");
    assert_eq!(
        c.unordered_data_ptr(),
        s.unordered_data_ptr(),
        "still sharing"
    );
    assert_eq!(c.count_pattern_mismatches(3).unwrap(), 0);
    c.copy_from_host(
        c.runtime().current_stream(c.device()).unwrap(),
        0,
        &[1, 2, 3],
    )
    .unwrap();
    assert!(!c.is_cow());
    let mut head = [0u8; 8192];
    c.copy_to_host(
        c.runtime().current_stream(c.device()).unwrap(),
        0,
        &mut head,
    )
    .unwrap();
    assert_eq!(&head[..3], &[1, 2, 3]);
    let expected: Vec<u8> = (3..8192u64)
        .map(|i| cudalloc::internals::pattern::byte(3, i))
        .collect();
    assert!(
        head[3..] == expected[..],
        "the rest of the copy holds the original bytes"
    );
    assert_eq!(s.count_pattern_mismatches(3).unwrap(), 0);
}
