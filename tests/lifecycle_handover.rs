//! Bytes changing owner where features meet (issue 35): a lazy clone's steal after a dropped
//! clone was read on a busy stream, two launches of one instantiated graph on two streams, and
//! the stream-ordered reuse of a block inside a pool a live graph holds. Each case checks every
//! byte on the backends present, and that the stream sanitizer (in report mode, on a driver of
//! its own) finds nothing to report in this correct code.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{
    backend::Driver, backend::HostKernelMemory, backend::HostRange, graph::CaptureMode,
    sanitizer::Sanitize, sanitizer::SanitizeOptions, Runtime, Storage, StreamId,
};

const MIB: u64 = 1 << 20;

fn runtime(driver: Arc<dyn Driver>) -> Arc<Runtime> {
    checked_allocator(driver, "")
}

/// A runtime on its own host driver with the sanitizer on in report mode (whatever
/// `CUDALLOC_SANITIZE` says): its reports are this test's alone.
fn reporting_runtime() -> (Arc<Runtime>, Arc<cudalloc::backend::HostDriver>) {
    let host = Arc::new(host_driver());
    let rt = Arc::new(
        Runtime::builder()
            // PyTorch's rules: the program records streams and waits (the bugs were there).
            .config(cudalloc::AllocatorConfig::parse("stream_order:manual").unwrap())
            .sanitize(Sanitize::On(SanitizeOptions::report()))
            .check_invariants(true)
            .build(host.clone())
            .unwrap(),
    );
    (rt, host)
}

fn no_reports(rt: &Runtime) {
    let reports = rt.sanitizer().unwrap().take_reports();
    assert!(
        reports.is_empty(),
        "correct code was reported: {reports:#?}"
    );
}

fn two_streams(rt: &Runtime) -> (StreamId, StreamId) {
    (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap())
}

/// How a dropped clone was read on the busy stream `t`.
#[derive(Clone, Copy, Debug)]
enum Read {
    /// `copy_to_pinned(.., t)`: the storage records `t` itself.
    Pinned,
    /// A device copy on `t` and `record_stream(t)`, as PyTorch code does.
    DeviceCopyAndRecordStream,
}

/// `c = x.lazy_clone()`; the busy stream `t` reads `c`; `drop(c)`; `x`'s first write on `s`
/// steals the memory back and writes at once. `t`'s read must still see `x`'s old bytes: the
/// steal is a change of owner, and the new owner waits for the streams recorded on the memory.
fn steal_after_a_read_on_a_busy_stream(b: &TestBackend, rt: &Arc<Runtime>, how: Read) -> u64 {
    let (s, t) = two_streams(rt);
    let x = filled_on(rt, s, MIB, 1);
    let c = x.lazy_clone().unwrap();
    wait_for(rt, t, s); // `t` reads what `s` wrote
    let mut pinned = rt.pinned(MIB).unwrap();
    let device_copy = Storage::new_on(rt, t, MIB).unwrap();
    let hold = hold_stream(b, t);
    match how {
        Read::Pinned => c.copy_to_pinned(t, 0, &mut pinned, 0, MIB).unwrap(),
        Read::DeviceCopyAndRecordStream => {
            let dst = device_copy.mutable_data_ptr_on(t).unwrap();
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                rt.driver()
                    .copy_device_to_device(t, dst, c.unordered_data_ptr(), MIB)
            }
            .unwrap();
            c.record_stream(t).unwrap();
        }
    }
    drop(c);
    // The last reference: a steal, and a write on `s` right after it.
    let addr = x.mutable_data_ptr_on(s).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(s, addr, MIB, 2) }.unwrap();
    let held = hold.still_held();
    drop(hold);
    rt.driver().stream_synchronize(t).unwrap();
    rt.driver().stream_synchronize(s).unwrap();
    if !held {
        println!(
            "{how:?} [{}]: the hold ran out early; the claim proves less",
            b.name
        );
    }
    assert_eq!(x.count_pattern_mismatches(2).unwrap(), 0, "{how:?}");
    match how {
        Read::Pinned => {
            cudalloc::internals::pattern::count_mismatches(pinned.as_slice().unwrap(), 1)
        }
        Read::DeviceCopyAndRecordStream => device_copy.count_pattern_mismatches(1).unwrap(),
    }
}

#[test]
fn a_steal_waits_for_streams_that_read_a_dropped_clone() {
    for b in backends("a_steal_waits_for_streams_that_read_a_dropped_clone") {
        let _device = device_shared();
        let rt = runtime(b.driver.clone());
        for how in [Read::Pinned, Read::DeviceCopyAndRecordStream] {
            let wrong = steal_after_a_read_on_a_busy_stream(&b, &rt, how);
            assert_eq!(wrong, 0, "{how:?} [{}]: bytes wrong", b.name);
        }
    }
}

#[test]
fn a_steal_after_a_read_on_another_stream_is_not_reported() {
    let (rt, host) = reporting_runtime();
    let b = TestBackend {
        name: "host",
        driver: Arc::clone(rt.driver()),
        host: Some(host),
    };
    for how in [Read::Pinned, Read::DeviceCopyAndRecordStream] {
        assert_eq!(steal_after_a_read_on_a_busy_stream(&b, &rt, how), 0);
        no_reports(&rt);
    }
}

/// A graph that reads an 8-byte counter, takes its time, and writes the counter plus one.
fn counting_graph(
    rt: &Arc<Runtime>,
    host: &cudalloc::backend::HostDriver,
    counter: &Storage,
) -> cudalloc::graph::Graph {
    let capture_stream = rt.create_stream(0).unwrap();
    let addr = counter.mutable_data_ptr_on(capture_stream).unwrap();
    let capture = rt
        .begin_capture(capture_stream, None, CaptureMode::Global)
        .unwrap();
    // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
    unsafe {
        host.enqueue_host(
            capture_stream,
            [HostRange::write(addr, 8)],
            |m: &mut HostKernelMemory<1>| {
                let mut word = [0u8; 8];
                m.read(0, 0, &mut word)?;
                // Long enough for a second launch that is not ordered to read the same value.
                std::thread::sleep(std::time::Duration::from_millis(100));
                m.write(0, 0, &(u64::from_le_bytes(word) + 1).to_le_bytes())
            },
        )
    }
    .unwrap();
    capture.end().unwrap()
}

/// Replays the counting graph on `a`, then on another stream `b`, waits for `b` alone and reads
/// the counter: 2 when the second launch ran after the first.
fn count_on_two_streams(rt: &Arc<Runtime>, host: &cudalloc::backend::HostDriver) -> u64 {
    let (a, b) = two_streams(rt);
    let counter = Storage::new(rt, 0, 8).unwrap();
    counter
        .copy_from_host(
            counter.runtime().current_stream(counter.device()).unwrap(),
            0,
            &[0; 8],
        )
        .unwrap();
    let graph = counting_graph(rt, host, &counter);
    graph.replay(a).unwrap();
    graph.replay(b).unwrap();
    // Waiting for `b` waits for the first launch too.
    rt.driver().stream_synchronize(b).unwrap();
    let mut out = [0u8; 8];
    counter
        .copy_to_host(
            counter.runtime().current_stream(counter.device()).unwrap(),
            0,
            &mut out,
        )
        .unwrap();
    u64::from_le_bytes(out)
}

/// CUDA orders each launch of an instantiated graph behind its earlier launches, whatever the
/// stream (`cuGraphLaunch`): two replays on two streams count to two.
#[test]
fn launches_of_one_graph_on_two_streams_run_one_after_the_other() {
    let host = Arc::new(host_driver());
    let rt = runtime(sanitized(host.clone()));
    assert_eq!(count_on_two_streams(&rt, &host), 2);
}

/// The sanitizer models the same order: the second replay, on another stream, is ordered after
/// the first, and so is what the host reads once it waited for the second.
#[test]
fn the_sanitizer_orders_launches_of_one_graph_on_two_streams() {
    let (rt, host) = reporting_runtime();
    assert_eq!(count_on_two_streams(&rt, &host), 2);
    no_reports(&rt);
}

/// The canonical cross-stream pattern inside a pool that a live graph also uses: allocate on
/// `a`, fill, `b` waits and copies, `record_stream(b)`, drop; the next allocation on `a` reuses
/// the block once `b`'s copy is done and writes it. Correct code: not reported, every byte right
/// (it was reported while a graph held the pool: frees there were not told to the sanitizer).
#[test]
fn stream_ordered_reuse_in_a_pool_a_live_graph_holds_is_not_reported() {
    let (rt, host) = reporting_runtime();
    let (a, b) = two_streams(&rt);
    let pool = rt.mem_pool(Default::default()).unwrap();
    // A graph captured into the pool, alive for the whole test.
    let capture_stream = rt.create_stream(0).unwrap();
    let capture = rt
        .begin_capture(capture_stream, Some(&pool), CaptureMode::Global)
        .unwrap();
    let inside = Storage::new_on(&rt, capture_stream, MIB).unwrap();
    let p = inside.mutable_data_ptr_on(capture_stream).unwrap();
    // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
    unsafe {
        host.enqueue_host(
            capture_stream,
            [HostRange::write(p, 16)],
            |m: &mut HostKernelMemory<1>| m.write(0, 0, &[5; 16]),
        )
    }
    .unwrap();
    let graph = capture.end().unwrap();
    let _scope = rt.use_mem_pool(&pool, 0).unwrap();
    for round in 0..4u64 {
        let src = filled_on(&rt, a, MIB, round);
        let event = rt.driver().event_create(0, Default::default()).unwrap();
        rt.driver().event_record(event, a).unwrap();
        rt.driver().stream_wait_event(b, event).unwrap();
        let dst = Storage::new_on(&rt, b, MIB).unwrap();
        let d = dst.mutable_data_ptr_on(b).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            rt.driver()
                .copy_device_to_device(b, d, src.unordered_data_ptr(), MIB)
        }
        .unwrap();
        src.record_stream(b).unwrap();
        let freed = src.unordered_data_ptr();
        drop(src);
        // `b`'s copy is done (waited for behind the sanitizer's back, as the allocator's own
        // event polls are): the next allocation on `a` reuses the block, and writes it.
        Driver::stream_synchronize(&*host, b).unwrap();
        let next = filled_on(&rt, a, MIB, 100 + round);
        assert_eq!(next.unordered_data_ptr(), freed, "the block was reused");
        rt.driver().stream_synchronize(b).unwrap();
        rt.driver().stream_synchronize(a).unwrap();
        assert_eq!(dst.count_pattern_mismatches(round).unwrap(), 0);
        assert_eq!(next.count_pattern_mismatches(100 + round).unwrap(), 0);
        rt.driver().event_destroy(event).unwrap();
        no_reports(&rt);
    }
    graph.replay(capture_stream).unwrap();
    rt.driver().stream_synchronize(capture_stream).unwrap();
    no_reports(&rt);
}

// Found by review (each failed before its fix).

/// The storage's own `record_stream(t)` survives a steal: its later free still waits for `t`
/// (the steal waited for `t` but used to clear the record: 1,044,536 bytes of the next tenant
/// overwritten).
fn record_survives_steal(rt: &Arc<Runtime>, host: &cudalloc::backend::HostDriver) -> (bool, u64) {
    let (s, t) = two_streams(rt);
    let x = filled_on(rt, s, MIB, 1);
    rt.driver().stream_synchronize(s).unwrap();
    let c = x.lazy_clone().unwrap();
    x.record_stream(t).unwrap();
    drop(c);
    let addr = x.mutable_data_ptr_on(t).unwrap(); // the steal
    rt.driver().stream_synchronize(t).unwrap();
    let gate = host.gate_stream(t).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(t, addr, MIB, 2) }.unwrap(); // pending on t
    drop(x); // waits for t
    let y = Storage::new_on(rt, s, MIB).unwrap();
    let reused = y.unordered_data_ptr() == addr;
    let yp = y.mutable_data_ptr_on(s).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(s, yp, MIB, 3) }.unwrap();
    rt.driver().stream_synchronize(s).unwrap();
    drop(gate);
    rt.driver().stream_synchronize(t).unwrap();
    (reused, y.count_pattern_mismatches(3).unwrap())
}

#[test]
fn a_steal_keeps_the_storages_own_record_stream() {
    let host = Arc::new(host_driver());
    let rt = runtime(host.clone());
    assert_eq!(record_survives_steal(&rt, &host), (false, 0));
    let (rt, host) = reporting_runtime();
    assert_eq!(record_survives_steal(&rt, &host), (false, 0));
    no_reports(&rt);
}

/// A host driver (sanitized when the run asks), its runtime, two streams `s` and `o`, a storage
/// `x` filled with seed 1 on `s`, and a lazy clone of it made while `o` was current.
fn source_and_clone_made_on_another_stream() -> (
    Arc<cudalloc::backend::HostDriver>,
    Arc<Runtime>,
    StreamId,
    StreamId,
    Storage,
    Storage,
) {
    let host = Arc::new(host_driver());
    let rt = runtime(sanitized(host.clone()));
    let (s, o) = two_streams(&rt);
    let x = filled_on(&rt, s, MIB, 1);
    rt.driver().stream_synchronize(s).unwrap();
    let c = {
        let _on = rt.set_current_stream(o).unwrap();
        x.lazy_clone().unwrap()
    };
    (host, rt, s, o, x, c)
}

/// A clone read on the block's own stream `s`, dropped; `s` then begins a capture; the steal on
/// `t` still waits for the read `s` queued before its capture (the capture's tail event).
#[test]
fn a_steal_waits_for_a_read_queued_before_the_readers_capture() {
    let (host, rt, s, t, x, c) = source_and_clone_made_on_another_stream();
    let dst = Storage::new_on(&rt, s, MIB).unwrap();
    let d = dst.mutable_data_ptr_on(s).unwrap();
    let gate = host.gate_stream(s).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        rt.driver()
            .copy_device_to_device(s, d, c.unordered_data_ptr(), MIB)
    }
    .unwrap();
    drop(c);
    let capture = rt.begin_capture(s, None, CaptureMode::Relaxed).unwrap();
    let addr = x.mutable_data_ptr_on(t).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(t, addr, MIB, 2) }.unwrap();
    assert!(
        !rt.driver().stream_query(t).unwrap(),
        "t waits for s's read"
    );
    drop(gate);
    rt.driver().stream_synchronize(t).unwrap();
    capture.end().unwrap();
    rt.driver().stream_synchronize(s).unwrap();
    assert_eq!(dst.count_pattern_mismatches(1).unwrap(), 0);
    assert_eq!(x.count_pattern_mismatches(2).unwrap(), 0);
}

/// An eager first write while the stream current at lazy-clone time is being captured: the
/// writer waits for that stream's eager work (the tail), and does not join the capture (it used
/// to, and the capture failed: "joined the capture but the origin never waited").
#[test]
fn an_eager_steal_does_not_join_the_capture_of_the_clone_stream() {
    let (_host, rt, s, cs, x, c) = source_and_clone_made_on_another_stream();
    drop(c);
    let capture = rt.begin_capture(cs, None, CaptureMode::Relaxed).unwrap();
    let addr = x.mutable_data_ptr_on(s).unwrap();
    assert!(!rt
        .driver()
        .graphs()
        .stream_capture_status(s)
        .unwrap()
        .is_capturing());
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(s, addr, MIB, 2) }.unwrap();
    capture.end().unwrap();
    rt.driver().stream_synchronize(s).unwrap();
    assert_eq!(x.count_pattern_mismatches(2).unwrap(), 0);
}

/// A steal inside capture A while the block's stream is in capture B: both captures stay valid
/// (a wait across two captures used to invalidate both).
#[test]
fn a_steal_inside_one_capture_leaves_another_capture_valid() {
    let (_host, rt, s, t, x, c) = source_and_clone_made_on_another_stream();
    drop(c);
    let b = rt.begin_capture(s, None, CaptureMode::Relaxed).unwrap();
    let a = rt.begin_capture(t, None, CaptureMode::Relaxed).unwrap();
    x.mutable_data_ptr_on(t).unwrap();
    a.end().unwrap();
    b.end().unwrap();
    assert_eq!(x.count_pattern_mismatches(1).unwrap(), 0);
}

/// Launches of a graph without nodes are ordered too (the second one, on `b`, used to run at
/// once: `b`'s copy read the buffer before `a`'s fill).
#[test]
fn launches_of_an_empty_graph_are_ordered_too() {
    let host = Arc::new(host_driver());
    for rt in [runtime(host.clone()), reporting_runtime().0] {
        let host = rt.driver().as_host().unwrap();
        let (a, b) = two_streams(&rt);
        let cs = rt.create_stream(0).unwrap();
        let graph = rt
            .begin_capture(cs, None, CaptureMode::Global)
            .unwrap()
            .end()
            .unwrap();
        assert_eq!(graph.node_count(), 0);
        let buf = Storage::new_on(&rt, a, MIB).unwrap();
        let p = buf.mutable_data_ptr_on(a).unwrap();
        let gate = host.gate_stream(a).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().kernels().fill_pattern(a, p, MIB, 4) }.unwrap();
        graph.replay(a).unwrap();
        graph.replay(b).unwrap(); // after the launch on a, hence after the fill
        let dst = Storage::new_on(&rt, b, MIB).unwrap();
        let d = dst.mutable_data_ptr_on(b).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { rt.driver().copy_device_to_device(b, d, p, MIB) }.unwrap();
        buf.record_stream(b).unwrap();
        assert!(!rt.driver().stream_query(b).unwrap(), "b waits for a");
        drop(gate);
        rt.driver().stream_synchronize(b).unwrap();
        assert_eq!(dst.count_pattern_mismatches(4).unwrap(), 0);
        if rt.sanitizer().is_some() {
            no_reports(&rt);
        }
    }
}

/// A reporting runtime, a pool, and a capture into it on stream `cs` that allocated a block at
/// `p` and wrote it; the block's storage is dropped (freed into the pool the capture holds).
fn a_capture_writing_a_block_of_its_pool() -> (
    Arc<Runtime>,
    Arc<cudalloc::backend::HostDriver>,
    cudalloc::pool::MemPool,
    StreamId,
    cudalloc::graph::Capture,
    cudalloc::DeviceAddr,
) {
    let (rt, host) = reporting_runtime();
    let pool = rt.mem_pool(Default::default()).unwrap();
    let cs = rt.create_stream(0).unwrap();
    let capture = rt
        .begin_capture(cs, Some(&pool), CaptureMode::Global)
        .unwrap();
    let inside = Storage::new_on(&rt, cs, MIB).unwrap();
    let p = inside.mutable_data_ptr_on(cs).unwrap();
    // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
    unsafe {
        host.enqueue_host(
            cs,
            [HostRange::write(p, MIB)],
            |m: &mut HostKernelMemory<1>| m.write(0, 0, &[5; 64]),
        )
    }
    .unwrap();
    drop(inside);
    (rt, host, pool, cs, capture, p)
}

/// Bytes a graph writes, freed into its pool and handed out to an eager allocation there: a
/// replay writes into the other owner's memory. Reported even when the replay is ordered after
/// the eager write (it used to go unseen: 1,044,463 bytes overwritten, no report).
#[test]
fn a_replay_into_bytes_its_pool_handed_out_since_is_reported() {
    let (rt, _host, pool, cs, capture, p) = a_capture_writing_a_block_of_its_pool();
    let graph = capture.end().unwrap(); // it still writes the freed bytes at every replay
    graph.replay(cs).unwrap();
    rt.driver().stream_synchronize(cs).unwrap();
    let y = {
        let _scope = rt.use_mem_pool(&pool, 0).unwrap();
        Storage::new_on(&rt, cs, MIB).unwrap()
    };
    assert_eq!(
        y.unordered_data_ptr(),
        p,
        "the pool handed the graph's bytes out"
    );
    let yp = y.mutable_data_ptr_on(cs).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(cs, yp, MIB, 7) }.unwrap();
    let err = graph.replay(cs).unwrap_err();
    assert_eq!(err.kind(), cudalloc::ErrorKind::StreamRace, "{err}");
    let reports = rt.sanitizer().unwrap().take_reports();
    assert_eq!(reports.len(), 1, "{reports:#?}");
    assert!(
        reports[0]
            .to_string()
            .contains("pool freed and handed out since"),
        "{}",
        reports[0]
    );
    drop(y);
}

/// Found by a second review: an eager allocation that took a graph's freed bytes is an ordinary
/// input of a graph captured after it — that graph's replays are not reported.
#[test]
fn a_graph_captured_after_the_reuse_may_write_the_new_allocation() {
    let (rt, host, pool, cs, capture, _p) = a_capture_writing_a_block_of_its_pool();
    let _first = capture.end().unwrap();
    let y = {
        let _scope = rt.use_mem_pool(&pool, 0).unwrap();
        Storage::new_on(&rt, cs, MIB).unwrap()
    };
    let yp = y.mutable_data_ptr_on(cs).unwrap();
    rt.driver().stream_synchronize(cs).unwrap();
    let cs2 = rt.create_stream(0).unwrap();
    wait_for(&rt, cs2, cs);
    let capture = rt.begin_capture(cs2, None, CaptureMode::Global).unwrap();
    // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
    unsafe {
        host.enqueue_host(
            cs2,
            [HostRange::write(yp, 64)],
            |m: &mut HostKernelMemory<1>| m.write(0, 0, &[9; 64]),
        )
    }
    .unwrap();
    let second = capture.end().unwrap();
    second.replay(cs2).unwrap();
    rt.driver().stream_synchronize(cs2).unwrap();
    no_reports(&rt);
    let mut head = [0u8; 64];
    y.copy_to_host(
        y.runtime().current_stream(y.device()).unwrap(),
        0,
        &mut head,
    )
    .unwrap();
    assert_eq!(head, [9; 64]);
}

/// Found by a second review: a stream captured through the driver alone (no allocator capture)
/// read a dropped clone; the steal on another stream must not wait on it (the wait would join
/// that capture, which then failed at its end): the last reference copies instead.
#[test]
fn a_steal_does_not_join_a_capture_begun_through_the_driver() {
    let host = Arc::new(host_driver());
    let rt = runtime(sanitized(host.clone()));
    let (s, u) = two_streams(&rt);
    let x = filled_on(&rt, s, MIB, 1);
    rt.driver().stream_synchronize(s).unwrap();
    let c = x.lazy_clone().unwrap();
    c.record_stream(u).unwrap();
    drop(c);
    rt.driver()
        .graphs()
        .stream_begin_capture(u, CaptureMode::Relaxed)
        .unwrap();
    let addr = x.mutable_data_ptr_on(s).unwrap();
    assert!(!rt
        .driver()
        .graphs()
        .stream_capture_status(s)
        .unwrap()
        .is_capturing());
    let graph = rt.driver().graphs().stream_end_capture(u).unwrap();
    rt.driver().graphs().graph_destroy(graph).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().kernels().fill_pattern(s, addr, MIB, 2) }.unwrap();
    rt.driver().stream_synchronize(s).unwrap();
    assert_eq!(x.count_pattern_mismatches(2).unwrap(), 0);
}
