//! Stream capture and graphs (the contract: `src/driver/capture.rs`): work on a capturing stream
//! is recorded, not run; a graph replays it in order on any stream, as often as asked; the capture
//! modes' prohibitions; forks and joins through events; a launch whose memory is gone is an error,
//! never a fault (host backend). On the host backend, and on the CUDA backend in a CUDA run — the
//! contract double in CI, where every prohibited call a test makes on purpose is announced to the
//! double and must be flagged by it (`prohibited`), and a GPU in `scripts/gpu-check.sh`. The
//! wording of errors is checked on the host backend only (CUDA words its own).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use cudalloc::{
    backend::CaptureStatus, backend::Driver, backend::EventFlags, backend::HostDriver,
    backend::HostRange, backend::SanitizedDriver, backend::SimDriver, graph::CaptureMode,
    sanitizer::SanitizeOptions, DeviceAddr, ErrorKind, StreamId,
};

fn driver() -> Arc<dyn Driver> {
    common::test_driver()
}

/// Whether the run is on the host backend (errors worded by cudalloc, host-only facilities).
fn on_host() -> bool {
    !common::cuda_suite()
}

/// `text` says each of `words` (on the host backend: CUDA words its errors its own way).
fn says(text: &str, words: &[&str]) {
    if on_host() {
        for w in words {
            assert!(text.contains(w), "{w:?} not in {text:?}");
        }
    }
}

/// Runs `call`, which must fail with a capture error; on the contract double it commits
/// `violations` prohibited driver calls on this thread, announced first and asserted flagged.
fn prohibited<T: std::fmt::Debug>(
    violations: u64,
    call: impl FnOnce() -> cudalloc::Result<T>,
) -> String {
    let on_double = common::expect_double_violations(violations);
    let text = is_capture_error(call());
    if on_double {
        assert_eq!(
            common::double_expected_left(),
            Some(0),
            "the double did not flag the prohibited call: {text}"
        );
    }
    text
}

fn host(d: &Arc<dyn Driver>) -> &HostDriver {
    d.as_host().unwrap()
}

fn bytes(d: &Arc<dyn Driver>, s: StreamId, at: DeviceAddr, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_host(s, &mut out, at) }.unwrap();
    out
}

fn is_capture_error(r: cudalloc::Result<impl std::fmt::Debug>) -> String {
    let err = r.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamCapture, "{err}");
    err.to_string()
}

#[test]
fn captured_work_is_recorded_not_run_and_replays_in_order_every_launch() {
    let d = driver();
    let (s, other) = (d.stream_create(0).unwrap(), d.stream_create(0).unwrap());
    let a = d.malloc(0, 1 << 16).unwrap();
    let b = d.malloc(0, 1 << 16).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(other, a, 0, 1 << 16) }.unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(other, b, 0, 1 << 16) }.unwrap();
    d.stream_synchronize(other).unwrap();
    assert_eq!(
        d.graphs().stream_capture_status(s).unwrap(),
        CaptureStatus::None
    );
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Global)
        .unwrap();
    let status = d.graphs().stream_capture_status(s).unwrap();
    assert!(matches!(status, CaptureStatus::Active { .. }), "{status:?}");
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, a, 1 << 16, 7) }.unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(s, b, a, 1 << 16) }.unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, a, 0x11, 16) }.unwrap();
    let graph = d.graphs().stream_end_capture(s).unwrap();
    assert_eq!(
        d.graphs().stream_capture_status(s).unwrap(),
        CaptureStatus::None
    );
    assert_eq!(d.graphs().graph_node_count(graph).unwrap(), 3);
    // Nothing ran.
    assert!(bytes(&d, other, a, 1 << 16).iter().all(|&x| x == 0));
    assert!(bytes(&d, other, b, 1 << 16).iter().all(|&x| x == 0));
    let exec = d.graphs().graph_instantiate(graph).unwrap();
    d.graphs().graph_destroy(graph).unwrap();
    for round in 0..3 {
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.memset(other, b, 0xff, 1 << 16) }.unwrap();
        d.stream_synchronize(other).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.graphs().graph_launch(exec, other) }.unwrap();
        // In order: the copy saw the fill, the memset came after the copy.
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(other, b, 1 << 16, 7) }.unwrap(),
            0,
            "round {round}"
        );
        let head = bytes(&d, other, a, 16);
        assert!(head.iter().all(|&x| x == 0x11), "round {round}: {head:?}");
    }
    d.graphs().graph_exec_destroy(exec).unwrap();
    assert!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.graphs().graph_launch(exec, other) }.is_err(),
        "a destroyed exec"
    );
    d.free(a).unwrap();
    d.free(b).unwrap();
}

#[test]
fn host_kernels_and_sleeps_are_captured_and_rerun() {
    if !on_host() {
        println!("host kernels are the host backend's: skipped on the CUDA backend");
        return;
    }
    let d = driver();
    let s = d.stream_create(0).unwrap();
    let a = d.malloc(0, 4096).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, a, 0, 4096) }.unwrap();
    d.stream_synchronize(s).unwrap();
    d.graphs()
        .stream_begin_capture(s, CaptureMode::ThreadLocal)
        .unwrap();
    d.kernels().sleep(s, 10).unwrap();
    // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
    unsafe {
        host(&d).enqueue_host(s, [HostRange::write(a, 4096)], |m| {
            let mut v = vec![0u8; 4096];
            m.read(0, 0, &mut v)?;
            v.iter_mut().for_each(|x| *x += 1);
            m.write(0, 0, &v)
        })
    }
    .unwrap();
    let graph = d.graphs().stream_end_capture(s).unwrap();
    assert_eq!(d.graphs().graph_node_count(graph).unwrap(), 2);
    assert!(bytes(&d, s, a, 4096).iter().all(|&x| x == 0));
    let exec = d.graphs().graph_instantiate(graph).unwrap();
    for _ in 0..5 {
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.graphs().graph_launch(exec, s) }.unwrap();
    }
    assert!(bytes(&d, s, a, 4096).iter().all(|&x| x == 5));
    d.free(a).unwrap();
}

#[test]
fn global_mode_prohibits_unsafe_calls_on_every_thread_and_invalidates_the_capture() {
    let d = driver();
    let s = d.stream_create(0).unwrap();
    let a = d.malloc(0, 4096).unwrap();
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Global)
        .unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, a, 1, 4096) }.unwrap();
    // Another thread (mode Global by default) may not malloc either.
    let d2 = Arc::clone(&d);
    let text = std::thread::spawn(move || prohibited(1, || d2.malloc(0, 4096)))
        .join()
        .unwrap();
    says(&text, &["malloc"]);
    assert!(matches!(
        d.graphs().stream_capture_status(s).unwrap(),
        CaptureStatus::Invalidated { .. }
    ));
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    says(
        &is_capture_error(unsafe { d.memset(s, a, 2, 16) }),
        &["invalidated"],
    );
    let text = is_capture_error(d.graphs().stream_end_capture(s));
    says(&text, &["invalidated", "malloc"]);
    // The capture ended: the stream runs work again, and malloc works.
    assert_eq!(
        d.graphs().stream_capture_status(s).unwrap(),
        CaptureStatus::None
    );
    let b = d.malloc(0, 4096).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, a, 3, 4096) }.unwrap();
    assert!(bytes(&d, s, a, 4096).iter().all(|&x| x == 3));
    d.free(a).unwrap();
    d.free(b).unwrap();
}

#[test]
fn thread_local_and_relaxed_modes_prohibit_less() {
    let d = driver();
    let s = d.stream_create(0).unwrap();
    // Thread-local: other threads may malloc; the capturing thread may not.
    d.graphs()
        .stream_begin_capture(s, CaptureMode::ThreadLocal)
        .unwrap();
    let d2 = Arc::clone(&d);
    let p = std::thread::spawn(move || d2.malloc(0, 4096).unwrap())
        .join()
        .unwrap();
    says(&prohibited(1, || d.malloc(0, 4096)), &["malloc"]);
    assert!(
        d.graphs().stream_end_capture(s).is_err(),
        "invalidated by the malloc"
    );
    // Relaxed: nobody is prohibited, and the capture ends with its graph.
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Relaxed)
        .unwrap();
    let q = d.malloc(0, 4096).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, q, 9, 4096) }.unwrap();
    d.graphs().stream_end_capture(s).unwrap();
    // A Global capture, and the capturing thread relaxing its own mode around a malloc — what a
    // caching allocator does for a graph's pool.
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Global)
        .unwrap();
    let before = d.graphs().exchange_capture_mode(CaptureMode::Relaxed);
    assert_eq!(before, CaptureMode::Global);
    let r = d.malloc(0, 4096).unwrap();
    assert_eq!(
        d.graphs().exchange_capture_mode(before),
        CaptureMode::Relaxed
    );
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, r, 1, 4096) }.unwrap();
    let graph = d.graphs().stream_end_capture(s).unwrap();
    assert_eq!(d.graphs().graph_node_count(graph).unwrap(), 1);
    for p in [p, q, r] {
        d.free(p).unwrap();
    }
}

#[test]
fn blocking_on_a_capturing_stream_or_its_events_is_an_error_in_any_mode() {
    let d = driver();
    let s = d.stream_create(0).unwrap();
    let a = d.malloc(0, 4096).unwrap();
    let e = d.event_create(0, EventFlags::default()).unwrap();
    for call in 0..5 {
        d.graphs()
            .stream_begin_capture(s, CaptureMode::Relaxed)
            .unwrap();
        d.event_record(e, s).unwrap();
        let text = match call {
            0 => prohibited(1, || d.stream_synchronize(s)),
            1 => prohibited(1, || d.stream_query(s)),
            2 => prohibited(1, || d.event_query(e)),
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            3 => prohibited(1, || unsafe { d.copy_host_to_device(s, a, &[1, 2, 3]) }),
            // The CUDA backend refuses it before any CUDA call (nothing to invalidate).
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            _ => prohibited(0, || unsafe {
                d.kernels().count_pattern_mismatches(s, a, 16, 1)
            }),
        };
        says(&text, &["capture"]);
        let end = d.graphs().stream_end_capture(s);
        if on_host() || call < 4 {
            assert!(end.is_err(), "call {call} invalidated it");
        }
    }
    d.event_destroy(e).unwrap();
    d.free(a).unwrap();
}

#[test]
fn a_forked_stream_joins_the_capture_and_must_be_joined_back() {
    let d = driver();
    let (origin, side, run) = (
        d.stream_create(0).unwrap(),
        d.stream_create(0).unwrap(),
        d.stream_create(0).unwrap(),
    );
    let a = d.malloc(0, 8192).unwrap();
    let half = DeviceAddr(a.0 + 4096);
    let (fork, join) = (
        d.event_create(0, EventFlags::default()).unwrap(),
        d.event_create(0, EventFlags::default()).unwrap(),
    );
    d.graphs()
        .stream_begin_capture(origin, CaptureMode::Global)
        .unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(origin, a, 4096, 1) }.unwrap();
    d.event_record(fork, origin).unwrap();
    d.stream_wait_event(side, fork).unwrap();
    assert!(
        d.graphs()
            .stream_capture_status(side)
            .unwrap()
            .is_capturing(),
        "joined"
    );
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(side, half, a, 4096) }.unwrap();
    d.event_record(join, side).unwrap();
    d.stream_wait_event(origin, join).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(origin, a, 0, 4096) }.unwrap();
    let graph = d.graphs().stream_end_capture(origin).unwrap();
    assert_eq!(
        d.graphs().stream_capture_status(side).unwrap(),
        CaptureStatus::None
    );
    assert_eq!(d.graphs().graph_node_count(graph).unwrap(), 3);
    let exec = d.graphs().graph_instantiate(graph).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.graphs().graph_launch(exec, run) }.unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().count_pattern_mismatches(run, half, 4096, 1) }.unwrap(),
        0
    );
    assert!(bytes(&d, run, a, 4096).iter().all(|&x| x == 0));

    // A fork never joined back: the capture cannot end with its graph.
    d.graphs()
        .stream_begin_capture(origin, CaptureMode::Global)
        .unwrap();
    d.event_record(fork, origin).unwrap();
    d.stream_wait_event(side, fork).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(side, a, 1, 16) }.unwrap();
    let text = prohibited(1, || d.graphs().stream_end_capture(origin));
    says(&text, &["never waited"]);
    assert_eq!(
        d.graphs().stream_capture_status(side).unwrap(),
        CaptureStatus::None
    );
    // Ending on a joined stream instead of the origin is refused.
    d.graphs()
        .stream_begin_capture(origin, CaptureMode::Global)
        .unwrap();
    d.event_record(fork, origin).unwrap();
    d.stream_wait_event(side, fork).unwrap();
    says(
        &prohibited(1, || d.graphs().stream_end_capture(side)),
        &["end it there"],
    );
    // As on CUDA (seen on an H200): that invalidated the capture, which goes on until the
    // origin ends it, without a graph.
    assert!(d.event_record(join, side).is_err());
    let ended = is_capture_error(d.graphs().stream_end_capture(origin));
    assert!(ended.to_lowercase().contains("invalidated"), "{ended}");
    assert_eq!(
        d.graphs().stream_capture_status(side).unwrap(),
        CaptureStatus::None
    );
    for e in [fork, join] {
        d.event_destroy(e).unwrap();
    }
    d.free(a).unwrap();
}

#[test]
fn a_capture_cannot_wait_on_work_outside_it() {
    let d = driver();
    let (s, other) = (d.stream_create(0).unwrap(), d.stream_create(0).unwrap());
    let e = d.event_create(0, EventFlags::default()).unwrap();
    d.kernels().sleep(other, 1000).unwrap();
    d.event_record(e, other).unwrap();
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Global)
        .unwrap();
    let text = prohibited(1, || d.stream_wait_event(s, e));
    says(&text, &["outside the capture"]);
    assert!(d.graphs().stream_end_capture(s).is_err());
    d.event_destroy(e).unwrap();
}

#[test]
fn a_capture_ends_on_the_thread_that_began_it_unless_relaxed() {
    let d = driver();
    let s = d.stream_create(0).unwrap();
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Global)
        .unwrap();
    let d2 = Arc::clone(&d);
    let text = std::thread::spawn(move || prohibited(1, || d2.graphs().stream_end_capture(s)))
        .join()
        .unwrap();
    says(&text, &["thread that began it"]);
    // As on CUDA (seen on an H200): the wrong thread's end ended the capture, without a graph.
    assert_eq!(
        d.graphs().stream_capture_status(s).unwrap(),
        CaptureStatus::None
    );
    assert!(is_capture_error(d.graphs().stream_end_capture(s)).contains("not being captured"));
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Relaxed)
        .unwrap();
    let d2 = Arc::clone(&d);
    std::thread::spawn(move || d2.graphs().stream_end_capture(s).unwrap())
        .join()
        .unwrap();
    // Twice on one stream is an error; so is ending a stream that is not capturing.
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Global)
        .unwrap();
    assert!(
        is_capture_error(d.graphs().stream_begin_capture(s, CaptureMode::Global))
            .contains("already")
    );
    d.graphs().stream_end_capture(s).unwrap();
    assert!(is_capture_error(d.graphs().stream_end_capture(s)).contains("not being captured"));
}

#[test]
fn a_launch_whose_memory_is_gone_is_an_error_and_runs_nothing() {
    if !on_host() {
        println!("a launch over freed memory is undefined on CUDA: the host backend's check only");
        return;
    }
    let d = driver();
    let s = d.stream_create(0).unwrap();
    let kept = d.malloc(0, 4096).unwrap();
    let freed = d.malloc(0, 4096).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, kept, 0, 4096) }.unwrap();
    d.stream_synchronize(s).unwrap();
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Global)
        .unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, kept, 5, 4096) }.unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, freed, 5, 4096) }.unwrap();
    let exec = d
        .graphs()
        .graph_instantiate(d.graphs().stream_end_capture(s).unwrap())
        .unwrap();
    d.free(freed).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let err = unsafe { d.graphs().graph_launch(exec, s) }.unwrap_err();
    assert!(err.to_string().contains("node 1"), "{err}");
    assert!(
        bytes(&d, s, kept, 4096).iter().all(|&x| x == 0),
        "not even the first node ran"
    );
    d.free(kept).unwrap();
}

/// CUDA does not capture a graph launch (an H200 answered `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`
/// and invalidated the capture): every backend refuses it before the driver sees it, and the
/// capture goes on to its graph. Instantiating while another capture of this thread prohibits
/// unsafe calls is refused alike, unless the thread's mode is relaxed (as the allocator's own
/// `end` does).
#[test]
fn a_graph_launch_inside_a_capture_is_refused_and_the_capture_goes_on() {
    let d = driver();
    let (s, t) = (d.stream_create(0).unwrap(), d.stream_create(0).unwrap());
    let a = d.malloc(0, 4096).unwrap();
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Global)
        .unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, a, 4096, 3) }.unwrap();
    let inner_graph = d.graphs().stream_end_capture(s).unwrap();
    d.graphs()
        .stream_begin_capture(t, CaptureMode::Global)
        .unwrap();
    // Instantiating now is an unsafe call this thread's global capture prohibits ...
    let refused = prohibited(1, || d.graphs().graph_instantiate(inner_graph));
    says(&refused, &["graph_instantiate"]);
    // ... which invalidated it; a relaxed thread may instantiate during a capture.
    assert!(d.graphs().stream_end_capture(t).is_err());
    d.graphs()
        .stream_begin_capture(t, CaptureMode::Global)
        .unwrap();
    let before = d.graphs().exchange_capture_mode(CaptureMode::Relaxed);
    let inner = d.graphs().graph_instantiate(inner_graph).unwrap();
    d.graphs().exchange_capture_mode(before);
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(t, a, 0, 4096) }.unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let text = is_capture_error(unsafe { d.graphs().graph_launch(inner, t) });
    assert!(text.contains("cannot be launched"), "{text}");
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(t, a, 0, 4096) }.unwrap();
    let outer = d.graphs().stream_end_capture(t).unwrap();
    assert_eq!(d.graphs().graph_node_count(outer).unwrap(), 2);
    // Outside any capture both run.
    let exec = d.graphs().graph_instantiate(outer).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.graphs().graph_launch(inner, s) }.unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().count_pattern_mismatches(s, a, 4096, 3) }.unwrap(),
        0
    );
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.graphs().graph_launch(exec, s) }.unwrap();
    assert!(bytes(&d, s, a, 4096).iter().all(|&x| x == 0));
    for e in [inner, exec] {
        d.graphs().graph_exec_destroy(e).unwrap();
    }
    d.graphs().graph_destroy(inner_graph).unwrap();
    d.graphs().graph_destroy(outer).unwrap();
    d.free(a).unwrap();
}

#[test]
fn a_backend_without_capture_says_so() {
    let d: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 1 << 20).unwrap());
    let s = d.default_stream(0).unwrap();
    let text = is_capture_error(d.graphs().stream_begin_capture(s, CaptureMode::Global));
    assert!(text.contains("does not capture"), "{text}");
    assert_eq!(
        d.graphs().stream_capture_status(s).unwrap(),
        CaptureStatus::None
    );
}

/// A captured call that fails (here: a range that is not device memory) leaves the capture valid,
/// so the end returned a graph that silently lacked the work (found by a review). CUDA invalidates
/// the capture on an error of a captured call (cudaErrorStreamCaptureInvalidated).
#[test]
fn a_failed_captured_call_invalidates_the_capture() {
    let d = driver();
    let s = d.stream_create(0).unwrap();
    let a = d.malloc(0, 4096).unwrap();
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Global)
        .unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, a, 1, 4096) }.unwrap();
    // The CUDA backend refuses the range itself: CUDA never sees the call; the host backend's
    // refusal invalidates the capture, as CUDA does for a captured call that fails.
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let refused = unsafe { d.memset(s, DeviceAddr(a.0 + 4096), 2, 4096) };
    assert!(refused.is_err());
    if !on_host() {
        drop(d.graphs().stream_end_capture(s));
        println!("the CUDA backend refuses the range before CUDA sees it: nothing to invalidate");
        return;
    }
    let end = d.graphs().stream_end_capture(s);
    assert!(
        end.is_err(),
        "a capture whose call failed still gave a graph of {:?} node(s)",
        end.map(|g| d.graphs().graph_node_count(g).unwrap())
    );
}

/// The sanitizer wrapper forwarded an event_record on a capturing stream unchecked, but kept the
/// event's *old* real record (found by a review): a fork (a stream outside waiting on the point) then goes through the
/// sanitizer's stream_wait_event and joins the old record's clock — an ordering that never happened
/// (the host driver makes no real wait). A race on that stream after the capture is missed.
#[test]
fn a_fork_on_a_point_gives_the_sanitizer_no_false_ordering() {
    let d = SanitizedDriver::wrap(common::test_driver_unchecked(), SanitizeOptions::report());
    let san = d.sanitizer().unwrap();
    let (t, origin, u) = (
        d.stream_create(0).unwrap(),
        d.stream_create(0).unwrap(),
        d.stream_create(0).unwrap(),
    );
    let (x, y) = (d.malloc(0, 4096).unwrap(), d.malloc(0, 4096).unwrap());
    let (e, join) = (
        d.event_create(0, EventFlags::default()).unwrap(),
        d.event_create(0, EventFlags::default()).unwrap(),
    );
    // t writes x and records e for real.
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(t, x, 1, 4096) }.unwrap();
    d.event_record(e, t).unwrap();
    // e becomes a point of a capture on `origin`; `u` forks on it and is joined back.
    d.graphs()
        .stream_begin_capture(origin, CaptureMode::Relaxed)
        .unwrap();
    d.event_record(e, origin).unwrap();
    d.stream_wait_event(u, e).unwrap();
    d.event_record(join, u).unwrap();
    d.stream_wait_event(origin, join).unwrap();
    d.graphs().stream_end_capture(origin).unwrap();
    san.take_reports();
    // u never really waited for t: reading x there races with t's write.
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let _ = unsafe { d.copy_device_to_device(u, y, x, 4096) };
    let reports = san.take_reports();
    assert!(
        !reports.is_empty(),
        "u read x after no real wait for t's write, and nothing was reported"
    );
}

/// Control for the test above: the same read with no capture in between is reported.
#[test]
fn control_the_same_race_without_a_capture_is_reported() {
    let d = SanitizedDriver::wrap(common::test_driver_unchecked(), SanitizeOptions::report());
    let san = d.sanitizer().unwrap();
    let (t, u) = (d.stream_create(0).unwrap(), d.stream_create(0).unwrap());
    let (x, y) = (d.malloc(0, 4096).unwrap(), d.malloc(0, 4096).unwrap());
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(t, x, 1, 4096) }.unwrap();
    san.take_reports();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let _ = unsafe { d.copy_device_to_device(u, y, x, 4096) };
    assert!(!san.take_reports().is_empty());
}

/// Older than capture: stream_destroy took the stream out of the registry before its shutdown
/// drained the queue, so a concurrent free's synchronize_all skipped it and unmapped the segment
/// under the worker — SIGSEGV from safe code (this test killed its process). The sleeps only make
/// the old interleaving likely; in any interleaving the test passes now.
#[test]
fn a_free_during_a_stream_destroy_waits_for_that_stream() {
    let d = driver();
    let x = d.stream_create(0).unwrap();
    let a = d.malloc(0, 1 << 20).unwrap();
    d.kernels().sleep(x, 400_000).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(x, a, 7, 1 << 20) }.unwrap();
    let d2 = Arc::clone(&d);
    let destroyer = std::thread::spawn(move || d2.stream_destroy(x).unwrap());
    std::thread::sleep(Duration::from_millis(100));
    d.free(a).unwrap();
    destroyer.join().unwrap();
}

/// Two threads capture (ThreadLocal) with forks and joins, launch and synchronize, while
/// a third (Global mode, no capture) mallocs: nothing is refused, nothing deadlocks.
#[test]
fn concurrent_thread_local_captures_with_forks_and_a_malloc_thread() {
    let d = driver();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut hs = Vec::new();
    for _ in 0..2 {
        let d = Arc::clone(&d);
        hs.push(std::thread::spawn(move || {
            let (o, side, run) = (
                d.stream_create(0).unwrap(),
                d.stream_create(0).unwrap(),
                d.stream_create(0).unwrap(),
            );
            let a = d.malloc(0, 8192).unwrap();
            let (f, j) = (
                d.event_create(0, EventFlags::default()).unwrap(),
                d.event_create(0, EventFlags::default()).unwrap(),
            );
            for i in 0..200u64 {
                d.graphs()
                    .stream_begin_capture(o, CaptureMode::ThreadLocal)
                    .unwrap();
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe { d.kernels().fill_pattern(o, a, 4096, i) }.unwrap();
                d.event_record(f, o).unwrap();
                d.stream_wait_event(side, f).unwrap();
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe { d.copy_device_to_device(side, DeviceAddr(a.0 + 4096), a, 4096) }.unwrap();
                d.event_record(j, side).unwrap();
                d.stream_wait_event(o, j).unwrap();
                let g = d.graphs().stream_end_capture(o).unwrap();
                let x = d.graphs().graph_instantiate(g).unwrap();
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe { d.graphs().graph_launch(x, run) }.unwrap();
                assert_eq!(
                    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                    unsafe {
                        d.kernels()
                            .count_pattern_mismatches(run, DeviceAddr(a.0 + 4096), 4096, i)
                    }
                    .unwrap(),
                    0
                );
                d.graphs().graph_exec_destroy(x).unwrap();
                d.graphs().graph_destroy(g).unwrap();
            }
        }));
    }
    let d3 = Arc::clone(&d);
    let stop3 = Arc::clone(&stop);
    // A free synchronizes every device (CUDA's cudaFree), which a capture forbids: the malloc
    // thread frees after the captures.
    let m = std::thread::spawn(move || {
        let mut kept = Vec::new();
        while !stop3.load(std::sync::atomic::Ordering::SeqCst) {
            kept.push(d3.malloc(0, 4096).unwrap());
        }
        kept
    });
    for h in hs {
        h.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for p in m.join().unwrap() {
        d.free(p).unwrap();
    }
}

/// The sanitizer checks a replay like eager work: a replay writing memory that another stream
/// writes with no order between them is reported; ordered through an event, it is not.
#[test]
fn the_sanitizer_checks_a_replay_like_eager_work() {
    for ordered in [false, true] {
        let d = SanitizedDriver::wrap(common::test_driver_unchecked(), SanitizeOptions::report());
        let san = d.sanitizer().unwrap();
        let (s, t) = (d.stream_create(0).unwrap(), d.stream_create(0).unwrap());
        let x = d.malloc(0, 4096).unwrap();
        d.graphs()
            .stream_begin_capture(s, CaptureMode::Global)
            .unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.memset(s, x, 1, 4096) }.unwrap();
        let exec = d
            .graphs()
            .graph_instantiate(d.graphs().stream_end_capture(s).unwrap())
            .unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.memset(t, x, 2, 4096) }.unwrap();
        if ordered {
            let e = d.event_create(0, EventFlags::default()).unwrap();
            d.event_record(e, t).unwrap();
            d.stream_wait_event(s, e).unwrap();
        }
        san.take_reports();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        let _ = unsafe { d.graphs().graph_launch(exec, s) };
        let reports = san.take_reports();
        assert_eq!(
            reports.is_empty(),
            ordered,
            "ordered {ordered}: {:?}",
            reports.iter().map(|r| r.to_string()).collect::<Vec<_>>()
        );
    }
}

/// Found by review: a free during a relaxed capture worked on the host backend but on CUDA its
/// device synchronize was refused and invalidated the capture (and the driver had already
/// dropped the segment from its table). Both backends now refuse it before doing anything: the
/// capture goes on, the segment stays live, and it is freed after the end.
#[test]
fn a_free_during_a_capture_is_refused_alike_and_leaves_the_capture_intact() {
    let _alone = common::device_alone();
    let d = driver();
    let s = d.stream_create(0).unwrap();
    let p = d.malloc(0, 1 << 20).unwrap();
    d.graphs()
        .stream_begin_capture(s, CaptureMode::Relaxed)
        .unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, p, 3, 1 << 20) }.unwrap();
    let text = is_capture_error(d.free(p));
    says(&text, &["free", "under way"]);
    assert!(matches!(
        d.graphs().stream_capture_status(s).unwrap(),
        CaptureStatus::Active { .. }
    ));
    let graph = d.graphs().stream_end_capture(s).unwrap();
    let exec = d.graphs().graph_instantiate(graph).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.graphs().graph_launch(exec, s) }.unwrap();
    assert!(bytes(&d, s, p, 16).iter().all(|&x| x == 3));
    d.graphs().graph_exec_destroy(exec).unwrap();
    d.graphs().graph_destroy(graph).unwrap();
    d.free(p).unwrap();
}
