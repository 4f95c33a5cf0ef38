//! The stream sanitizer: every planted hazard is reported, 100 times out of 100, whatever the
//! timing (the verdict is taken when work is enqueued: no sleep decides anything); correct code
//! (waits, `record_stream`, the COW copy's own ordering) is never reported.
//!
//! Hazards (each test's name says which): a forgotten `record_stream`, a free while another
//! stream reads, a write on one stream and a read on another without a wait, a consumer process
//! reading a received storage on a stream that did not wait for the producer's event, a COW copy
//! raced by a kernel. Then what the reports say, stickiness, panic mode, and the stream API that
//! prevents the hazards (library default streams, `new_on`, first writes complete on return).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{host_driver, no_reports, one_report, ChildProcess, ParentLink, ROLE_VAR};
use cudalloc::sanitizer::HazardKind;
use cudalloc::{backend::HostKernelMemory, backend::HostRange};
use cudalloc::{
    ipc::IpcHandle, sanitizer::Sanitize, sanitizer::SanitizeOptions, ErrorKind, Runtime, Storage,
    StreamId,
};

const MIB: u64 = 1 << 20;
const ROUNDS: usize = 100;
const CHILD: &str = "sanitizer_child";

fn sanitized_with(options: SanitizeOptions) -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            // The hazards of PyTorch's rules (a storage left to order itself has none of these).
            .config(cudalloc::AllocatorConfig::parse("stream_order:manual").unwrap())
            .sanitize(Sanitize::On(options))
            .check_invariants(true)
            .build(Arc::new(host_driver()))
            .unwrap(),
    )
}

fn sanitized() -> Arc<Runtime> {
    sanitized_with(SanitizeOptions::default())
}

fn two_streams(rt: &Runtime) -> (StreamId, StreamId) {
    (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap())
}

/// A storage filled on a new main stream and copied (read) on a new side stream that waited for
/// the fill: (main, side, source, copy).
fn copy_on_a_side_stream(
    rt: &Arc<Runtime>,
    round: usize,
) -> (StreamId, StreamId, Storage, Storage) {
    let (main, side) = two_streams(rt);
    let src = common::filled_on(rt, main, MIB, round as u64);
    common::wait_for(rt, side, main);
    let dst = Storage::new_on(rt, side, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        rt.driver().copy_device_to_device(
            side,
            dst.mutable_data_ptr_on(side).unwrap(),
            src.unordered_data_ptr(),
            MIB,
        )
    }
    .unwrap();
    (main, side, src, dst)
}

#[test]
fn forgotten_record_stream_is_a_use_after_free_every_time() {
    let rt = sanitized();
    for round in 0..ROUNDS {
        let (main, side, src, dst) = copy_on_a_side_stream(&rt, round);
        let freed = src.unordered_data_ptr();
        drop(src); // record_stream(side) forgotten
        let newcomer = Storage::new_on(&rt, main, MIB).unwrap();
        assert_eq!(
            newcomer.unordered_data_ptr(),
            freed,
            "best fit hands the block out again"
        );
        let report = one_report(&rt, HazardKind::UseAfterFree);
        assert!(
            report.earlier.what.starts_with("copy_device_to_device"),
            "{report}"
        );
        assert_eq!(report.earlier.kind, "read");
        // Sticky on the hand-out's stream, like a CUDA error; the other stream goes on.
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        let err = unsafe {
            rt.driver()
                .memset(main, newcomer.unordered_data_ptr(), 0, 1)
        }
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StreamRace);
        assert!(rt.driver().stream_synchronize(main).is_err());
        rt.driver().stream_synchronize(side).unwrap();
        drop((dst, newcomer));
        rt.empty_cache();
    }
}

#[test]
fn with_record_stream_the_same_program_is_never_reported() {
    let rt = sanitized();
    for round in 0..ROUNDS {
        let (main, side, src, dst) = copy_on_a_side_stream(&rt, round);
        src.record_stream(side).unwrap();
        drop(src);
        let newcomer = Storage::new_on(&rt, main, MIB).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            rt.driver()
                .memset(main, newcomer.mutable_data_ptr_on(main).unwrap(), 1, MIB)
        }
        .unwrap();
        rt.driver().stream_synchronize(main).unwrap();
        rt.driver().stream_synchronize(side).unwrap();
        no_reports(&rt);
        drop((dst, newcomer));
        rt.empty_cache();
    }
}

/// Fills 4 MiB on a new main stream, reads them in a host kernel on a new side stream (which
/// waited for the fill), and frees the storage at once without `record_stream`.
fn read_on_a_side_stream_then_free(rt: &Arc<Runtime>, round: usize) -> (StreamId, StreamId) {
    let (main, side) = two_streams(rt);
    let src = common::filled_on(rt, main, 4 * MIB, round as u64);
    common::wait_for(rt, side, main);
    // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
    unsafe {
        rt.driver().as_host().unwrap().enqueue_host(
            side,
            [HostRange::read(src.unordered_data_ptr(), 4 * MIB)],
            |m: &mut HostKernelMemory<1>| m.to_vec(0).map(drop),
        )
    }
    .unwrap();
    drop(src);
    (main, side)
}

#[test]
fn a_free_while_another_stream_reads_is_a_use_after_free_every_time() {
    let rt = sanitized();
    for round in 0..ROUNDS {
        // A library kernel on the side stream reads a tensor, which is freed at once...
        let (main, _side) = read_on_a_side_stream_then_free(&rt, round);
        // ...and its memory handed out again on its own stream.
        let _newcomer = Storage::new_on(&rt, main, 4 * MIB).unwrap();
        let report = one_report(&rt, HazardKind::UseAfterFree);
        assert!(report.earlier.what.starts_with("a host kernel"), "{report}");
        assert!(
            report.to_string().contains("the free of allocation"),
            "{report}"
        );
        rt.empty_cache();
    }
}

#[test]
fn a_write_and_an_unwaited_read_on_another_stream_race_every_time() {
    let rt = sanitized();
    for round in 0..ROUNDS {
        let (writer, reader) = two_streams(&rt);
        let s = common::filled_on(&rt, writer, MIB, round as u64);
        let out = Storage::new_on(&rt, reader, MIB).unwrap();
        // The writer's stream is busy for a long time: without a wait the read comes first.
        rt.driver().kernels().sleep(writer, 1_000).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        let err = unsafe {
            rt.driver().copy_device_to_device(
                reader,
                out.mutable_data_ptr_on(reader).unwrap(),
                s.unordered_data_ptr(),
                MIB,
            )
        }
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StreamRace);
        let report = one_report(&rt, HazardKind::Race);
        assert_eq!(report.earlier.what.split(' ').next(), Some("fill_pattern"));
        assert_eq!(report.later.kind, "read");
        assert_eq!(
            (report.later.start, report.later.len),
            (s.unordered_data_ptr().0, MIB)
        );
        assert!(
            err.to_string().contains("fill_pattern")
                && err.to_string().contains("copy_device_to_device"),
            "the error names both accesses: {err}"
        );
        rt.driver().stream_synchronize(writer).unwrap();
    }
}

#[test]
fn a_wait_orders_the_read_and_nothing_is_reported() {
    let rt = sanitized();
    for round in 0..ROUNDS {
        let (writer, reader) = two_streams(&rt);
        let s = common::filled_on(&rt, writer, MIB, round as u64);
        let out = Storage::new_on(&rt, reader, MIB).unwrap();
        common::wait_for(&rt, reader, writer);
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            rt.driver().copy_device_to_device(
                reader,
                out.mutable_data_ptr_on(reader).unwrap(),
                s.unordered_data_ptr(),
                MIB,
            )
        }
        .unwrap();
        // A host synchronization orders too.
        rt.driver().stream_synchronize(reader).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().memset(writer, s.unordered_data_ptr(), 0, MIB) }.unwrap();
        s.record_stream(reader).unwrap();
        no_reports(&rt);
    }
}

#[test]
fn only_overlapping_bytes_race() {
    let rt = sanitized();
    let (a, b) = two_streams(&rt);
    let s = Storage::new_on(&rt, a, 4096).unwrap();
    let base = s.unordered_data_ptr();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().memset(a, base, 1, 100) }.unwrap();
    // Bytes 100.. were not written by `a`: reading them on `b` is no race.
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        rt.driver()
            .kernels()
            .count_pattern_mismatches(b, base.offset(100).unwrap(), 100, 0)
    }
    .unwrap();
    no_reports(&rt);
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let err = unsafe {
        rt.driver()
            .kernels()
            .count_pattern_mismatches(b, base.offset(50).unwrap(), 100, 0)
    }
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamRace);
    let report = one_report(&rt, HazardKind::Race);
    assert_eq!((report.earlier.start, report.earlier.len), (base.0, 100));
    rt.driver().stream_synchronize(a).unwrap();
    s.record_stream(b).unwrap();
}

#[test]
fn a_cow_copy_raced_by_a_kernel_is_reported_every_time() {
    let rt = sanitized();
    let host = rt.driver().as_host().unwrap();
    for round in 0..ROUNDS {
        let (copier, other) = two_streams(&rt);
        let s = common::filled_on(&rt, rt.default_stream(0).unwrap(), MIB, round as u64);
        let c = s.lazy_clone().unwrap();
        // The first write of the clone is ordered on `copier`: the copy is queued there...
        let private = c.mutable_data_ptr_on(copier).unwrap();
        // ...and a kernel on another stream writes the private copy without waiting for it.
        // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
        let err = unsafe {
            host.enqueue_host(
                other,
                [HostRange::write(private, MIB)],
                |m: &mut HostKernelMemory<1>| m.write(0, 0, &[7; 16]),
            )
        }
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StreamRace);
        let report = one_report(&rt, HazardKind::Race);
        // Named as the clone's copy-on-write copy (it was a plain `copy_device_to_device`).
        assert!(
            report.earlier.what.contains("copy-on-write copy"),
            "{report}"
        );
        assert_eq!(report.earlier.kind, "write");
        c.record_stream(copier).unwrap();
        rt.driver().stream_synchronize(copier).unwrap();
    }
}

#[test]
fn the_cow_copy_is_ordered_for_its_stream_and_complete_for_any_other() {
    let rt = sanitized();
    let host = rt.driver().as_host().unwrap();
    for round in 0..ROUNDS {
        let (copier, other) = two_streams(&rt);
        let s = common::filled_on(&rt, rt.default_stream(0).unwrap(), MIB, round as u64);
        let (c1, c2) = (s.lazy_clone().unwrap(), s.lazy_clone().unwrap());
        // Stream-ordered first write, then a kernel on the same stream.
        let p1 = c1.mutable_data_ptr_on(copier).unwrap();
        // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
        unsafe {
            host.enqueue_host(
                copier,
                [HostRange::write(p1, MIB)],
                |m: &mut HostKernelMemory<1>| m.write(0, 0, &[1; 16]),
            )
        }
        .unwrap();
        // First write complete on return: any stream may write at once.
        let p2 = c2.unordered_mutable_data_ptr().unwrap();
        // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
        unsafe {
            host.enqueue_host(
                other,
                [HostRange::write(p2, MIB)],
                |m: &mut HostKernelMemory<1>| m.write(0, 0, &[2; 16]),
            )
        }
        .unwrap();
        c1.record_stream(copier).unwrap();
        c2.record_stream(other).unwrap();
        no_reports(&rt);
        rt.driver().stream_synchronize(copier).unwrap();
        rt.driver().stream_synchronize(other).unwrap();
    }
}

#[test]
fn panic_mode_panics_at_the_hazard() {
    let rt = sanitized_with(SanitizeOptions::panic());
    let (a, b) = two_streams(&rt);
    let s = common::filled_on(&rt, a, 4096, 1);
    let d = Arc::clone(rt.driver());
    let ptr = s.unordered_data_ptr();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.memset(b, ptr, 0, 4096) }
    }));
    let message = caught.unwrap_err();
    let text = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        text.contains("stream race") && text.contains("memset"),
        "{text}"
    );
    rt.driver().stream_synchronize(a).unwrap();
}

#[test]
fn reports_name_the_rust_stacks_of_both_accesses_when_stacks_are_on() {
    let rt = sanitized_with(SanitizeOptions::report().with_stacks());
    let (a, b) = two_streams(&rt);
    let s = common::filled_on(&rt, a, 4096, 1);
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let err = unsafe { rt.driver().memset(b, s.unordered_data_ptr(), 0, 4096) }.unwrap_err();
    let report = one_report(&rt, HazardKind::Race);
    let (earlier, later) = (report.earlier.stack.unwrap(), report.later.stack.unwrap());
    assert!(earlier.contains("common::filled_on"), "{earlier}");
    assert!(later.contains("reports_name_the_rust_stacks"), "{later}");
    assert!(err.to_string().contains("enqueued at"), "{err}");
    rt.driver().stream_synchronize(a).unwrap();
}

#[test]
fn host_kernels_may_not_write_ranges_named_for_reading() {
    let rt = sanitized();
    let s = Storage::new(&rt, 0, 4096).unwrap();
    let stream = rt.current_stream(0).unwrap();
    // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
    unsafe {
        rt.driver().as_host().unwrap().enqueue_host(
            stream,
            [HostRange::read(s.unordered_data_ptr(), 4096)],
            |m: &mut HostKernelMemory<1>| m.write(0, 0, &[1]),
        )
    }
    .unwrap();
    let err = rt.driver().stream_synchronize(stream).unwrap_err();
    assert!(err.to_string().contains("named for reading"), "{err}");
}

#[test]
fn off_means_no_wrapper_and_no_checks() {
    let rt = Runtime::builder()
        .sanitize(Sanitize::Off)
        .build(Arc::new(host_driver()))
        .unwrap();
    assert!(rt.sanitizer().is_none());
    assert!(rt.driver().sanitizer().is_none());
}

#[test]
fn a_library_default_stream_serves_every_thread_without_a_guard() {
    let rt = sanitized();
    let library = rt.create_stream(0).unwrap();
    rt.set_default_stream(library).unwrap();
    let on_thread = {
        let rt = Arc::clone(&rt);
        std::thread::spawn(move || {
            let s = Storage::new(&rt, 0, 4096).unwrap();
            s.fill_pattern(3).unwrap(); // on the library's stream
            (s.allocation_stream(), rt.current_stream(0).unwrap(), s)
        })
        .join()
        .unwrap()
    };
    assert_eq!(on_thread.0, Some(library));
    assert_eq!(on_thread.1, library);
    // A kernel on the library's stream reads it: same stream, no wait needed, nothing reported.
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        rt.driver().kernels().count_pattern_mismatches(
            library,
            on_thread.2.unordered_data_ptr(),
            4096,
            3,
        )
    }
    .unwrap();
    no_reports(&rt);
    rt.clear_default_stream(0).unwrap();
    assert_eq!(
        rt.current_stream(0).unwrap(),
        rt.driver().default_stream(0).unwrap()
    );
}

#[test]
fn stream_guards_stay_on_their_thread() {
    // Compiles only while StreamGuard is not Send (two impls would make the call ambiguous).
    trait AmbiguousIfSend<A> {
        fn check() {}
    }
    impl<T: ?Sized> AmbiguousIfSend<()> for T {}
    #[allow(dead_code)]
    struct IsSend;
    impl<T: ?Sized + Send> AmbiguousIfSend<IsSend> for T {}
    <cudalloc::StreamGuard as AmbiguousIfSend<_>>::check();
}

#[test]
fn a_lazy_clones_first_write_is_complete_for_a_kernel_on_another_stream() {
    // The case: the default stream is busy, the clone's first write through
    // mutable_data_ptr(), then a kernel on the tensor's own stream. Before, the copy was queued
    // behind the busy stream and landed after the kernel: all 4 MiB of the clone came out wrong.
    let rt = Arc::new(
        Runtime::builder()
            .sanitize(Sanitize::Off)
            .build(Arc::new(host_driver()))
            .unwrap(),
    );
    let own = rt.create_stream(0).unwrap();
    let s = Storage::new(&rt, 0, 4 * MIB).unwrap();
    s.fill_pattern(5).unwrap();
    let c = s.lazy_clone().unwrap();
    rt.driver()
        .kernels()
        .sleep(rt.current_stream(0).unwrap(), 20_000)
        .unwrap();
    let ptr = c.unordered_mutable_data_ptr().unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(own, ptr, 4 * MIB, 6) }.unwrap();
    c.record_stream(own).unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            rt.driver()
                .kernels()
                .count_pattern_mismatches(own, ptr, 4 * MIB, 6)
        }
        .unwrap(),
        0
    );
}

#[test]
fn a_consumer_reading_before_its_stream_waited_is_reported_every_time() {
    let rt = Arc::new(Runtime::builder().build(Arc::new(host_driver())).unwrap());
    let mut child = ChildProcess::spawn(CHILD, "consumer", "host");
    let storages: Vec<Storage> = (0..ROUNDS as u64)
        .map(|i| {
            let s = Storage::new(&rt, 0, 64 * 1024).unwrap();
            s.fill_pattern(i).unwrap();
            s
        })
        .collect();
    for (i, s) in storages.iter().enumerate() {
        let handle = s.share_ipc().unwrap();
        child.send(&format!("{i} {}", common::hex(&handle.into_bytes())));
        assert_eq!(child.recv(), format!("{i} reported clean"));
    }
    child.send("done");
    assert_eq!(child.recv(), format!("reports={ROUNDS}"));
    child.finish();
    drop(storages);
    rt.ipc_collect();
}

#[test]
#[ignore = "child process of the multi-process tests"]
fn sanitizer_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    assert_eq!(role, "consumer");
    let mut parent = ParentLink::new();
    let rt = sanitized();
    loop {
        let line = parent.recv();
        if line == "done" {
            let reports = rt.sanitizer().unwrap().hazard_count();
            parent.send(&format!("reports={reports}"));
            return;
        }
        let (i, hex) = line.split_once(' ').unwrap();
        let seed: u64 = i.parse().unwrap();
        let handle = IpcHandle::from_bytes(&common::unhex(hex)).unwrap();
        let s = Storage::from_ipc(&rt, handle).unwrap();
        // A stream that did not wait for the producer's event reads: reported.
        let other = rt.create_stream(0).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        let err = unsafe {
            rt.driver().kernels().count_pattern_mismatches(
                other,
                s.unordered_data_ptr(),
                s.nbytes(),
                seed,
            )
        }
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
        assert!(err.to_string().contains("producer process"), "{err}");
        // The current stream waited at receipt: its read is correct and clean.
        assert_eq!(s.count_pattern_mismatches(seed).unwrap(), 0);
        parent.send(&format!("{i} reported clean"));
    }
}

#[test]
fn sharing_bytes_another_stream_wrote_without_a_wait_is_reported_every_time() {
    // The demo's bug (phase 1 filled on a second stream, phase 3 shared from the default one):
    // the consumer waits for the sharing stream's event only, so it could read before the fill.
    let rt = sanitized();
    for round in 0..ROUNDS {
        let (writer, sharer) = two_streams(&rt);
        let s = common::filled_on(&rt, writer, 64 * 1024, round as u64);
        let _on = rt.set_current_stream(sharer).unwrap();
        let err = s.share_ipc().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
        let report = one_report(&rt, HazardKind::Race);
        assert!(
            report
                .later
                .what
                .starts_with("sharing with another process"),
            "{report}"
        );
        // After a wait it is shared (on a stream of its own: `sharer` is failed now).
        let fresh = rt.create_stream(0).unwrap();
        common::wait_for(&rt, fresh, writer);
        let _on = rt.set_current_stream(fresh).unwrap();
        drop(s.share_ipc().unwrap());
        no_reports(&rt);
    }
    rt.ipc_collect();
}

#[test]
fn a_wait_after_the_free_but_before_the_reuse_is_enough() {
    let rt = sanitized();
    for round in 0..ROUNDS {
        // No record_stream, but the side stream's work is ordered before the reuse on `main`.
        let (main, side) = read_on_a_side_stream_then_free(&rt, round);
        if round % 2 == 0 {
            rt.driver().stream_synchronize(side).unwrap();
        } else {
            common::wait_for(&rt, main, side);
        }
        let _again = Storage::new_on(&rt, main, 4 * MIB).unwrap();
        no_reports(&rt);
        rt.empty_cache();
    }
}

#[test]
fn an_unsplit_remainder_keeps_what_its_first_free_knew() {
    // 20 MiB is one large segment; 19 MiB reuses its block unsplit (the 1 MiB rest is too small
    // to split off), so the hand-out covers less than the block. The tail still holds the side
    // stream's write, recorded and waited for at the first free: never a report.
    let rt = sanitized();
    let (main, side) = two_streams(&rt);
    let x = Storage::new_on(&rt, main, 20 * MIB).unwrap();
    common::wait_for(&rt, side, main);
    let ptr = x.mutable_data_ptr_on(side).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().memset(side, ptr, 1, 20 * MIB) }.unwrap();
    x.record_stream(side).unwrap();
    drop(x);
    // The side stream's work done, unseen by the sanitizer (as the allocator's event polls are):
    // the block is free again, and only the first free's clock knows the side stream.
    let unseen = rt.driver().unsanitized().unwrap();
    unseen.stream_synchronize(side).unwrap();
    let y = Storage::new_on(&rt, main, 19 * MIB).unwrap();
    assert_eq!(y.unordered_data_ptr(), ptr, "the same block");
    drop(y);
    let z = Storage::new_on(&rt, main, 20 * MIB).unwrap();
    assert_eq!(z.unordered_data_ptr(), ptr);
    no_reports(&rt);
}

#[test]
fn work_enqueued_on_freed_memory_is_a_use_after_free() {
    let rt = sanitized();
    let main = rt.create_stream(0).unwrap();
    let s = common::filled_on(&rt, main, MIB, 1);
    let stale = s.unordered_data_ptr();
    drop(s); // a raw pointer kept past its storage
             // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let err = unsafe { rt.driver().memset(main, stale, 0, MIB) }.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamRace);
    let report = one_report(&rt, HazardKind::UseAfterFree);
    assert_eq!(report.earlier.kind, "free");
    assert!(report.to_string().contains("holds as free"), "{report}");
}

#[test]
fn a_panic_in_a_cow_copy_leaves_the_clone_a_valid_cow_storage() {
    let rt = sanitized_with(SanitizeOptions::panic());
    let (writer, copier) = two_streams(&rt);
    // Filled on `writer`, lazily cloned on the default stream, which never waited for it: the
    // first write's copy on `copier` (which waits for the clone's stream only) races the fill.
    let s2 = common::filled_on(&rt, writer, MIB, 5);
    let c2 = s2.lazy_clone().unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c2.mutable_data_ptr_on(copier)
    }));
    assert!(caught.is_err(), "the racing copy panicked");
    assert!(c2.is_cow(), "still a COW storage");
    assert_eq!(c2.unordered_data_ptr(), s2.unordered_data_ptr());
    // Once ordered, the first write works and copies the right bytes.
    let fresh = rt.create_stream(0).unwrap();
    common::wait_for(&rt, fresh, writer);
    let _on = rt.set_current_stream(fresh).unwrap();
    c2.unordered_mutable_data_ptr().unwrap();
    assert_eq!(c2.count_pattern_mismatches(5).unwrap(), 0);
}

#[test]
fn synchronization_made_outside_cudalloc_counts_once_told() {
    // What cudarc's own `synchronize` or events would be: orderings through the driver
    // underneath, which the sanitizer cannot see until the library says so.
    let rt = sanitized();
    let unseen = rt.driver().unsanitized().unwrap();
    let sanitizer = rt.sanitizer().unwrap();
    for told in [false, true] {
        let (a, b, c) = (
            rt.create_stream(0).unwrap(),
            rt.create_stream(0).unwrap(),
            rt.create_stream(0).unwrap(),
        );
        let s = common::filled_on(&rt, a, 4096, 1);
        // The host waits for `a` unseen; then `b` reads.
        unseen.stream_synchronize(a).unwrap();
        if told {
            sanitizer.host_synchronized(a);
        }
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        let read = unsafe {
            rt.driver()
                .kernels()
                .count_pattern_mismatches(b, s.unordered_data_ptr(), 4096, 1)
        };
        // `c` waits for `b` unseen; then `c` writes.
        unseen.stream_wait_stream(c, b).unwrap();
        if told {
            sanitizer.stream_waited(c, b);
            assert_eq!(read.unwrap(), 0);
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { rt.driver().memset(c, s.unordered_data_ptr(), 0, 4096) }.unwrap();
            no_reports(&rt);
        } else {
            assert_eq!(read.unwrap_err().kind(), ErrorKind::StreamRace);
            one_report(&rt, HazardKind::Race);
        }
        s.record_stream(b).unwrap();
        s.record_stream(c).unwrap();
        rt.driver().stream_synchronize(c).unwrap();
    }
}
