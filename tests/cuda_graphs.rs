//! CUDA graphs through the allocator on the host backend (and on the CUDA backend in a CUDA run:
//! the contract double in CI, a GPU in `scripts/gpu-check.sh`): ports of PyTorch's `test_cuda.py`
//! graph tests (same names) and where graphs meet pools, frees with stream uses, out of memory and
//! eager work. The allocator's own rules under test: a capture allocates from its graph's
//! private pool; nothing outside that pool is ever handed its memory while the graph lives; no
//! event is recorded or queried on a capturing stream; replays write the same addresses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use cudalloc::{
    backend::CaptureStatus, backend::Driver, backend::EventFlags, graph::CaptureMode,
    pool::MemPoolId, AllocatorConfig, DataPtr, DeviceAddr, ErrorKind, Runtime, StreamId,
};

const MIB: u64 = 1 << 20;

fn setup() -> (Arc<dyn Driver>, Runtime) {
    setup_with("")
}

/// The host backend with 256 MiB, or in a CUDA run (the double, a GPU) the CUDA backend capped
/// at 256 MiB; expandable segments in CI's second pass (`CUDALLOC_TEST_EXPANDABLE=1`).
fn setup_with(conf: &str) -> (Arc<dyn Driver>, Runtime) {
    let (driver, cap) = common::sized_driver(256 * MIB);
    let driver = common::sanitized(driver);
    let a = Runtime::builder()
        .config(common::test_config(&common::join_conf(conf, &cap)))
        .check_invariants(true)
        .build(Arc::clone(&driver))
        .unwrap();
    (driver, a)
}

fn bytes(d: &Arc<dyn Driver>, s: StreamId, p: &DataPtr, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_host(s, &mut out, p.ptr()) }.unwrap();
    out
}

fn reserved(a: &Runtime) -> i64 {
    a.memory_stats(0).unwrap().reserved_bytes.all.current
}

/// Whether `addr` lies in a segment of pool `pool`.
fn in_pool(a: &Runtime, pool: MemPoolId, addr: DeviceAddr) -> bool {
    // By the segments' blocks: an expandable segment's mapped pages need not be contiguous.
    a.snapshot().segments.iter().any(|s| {
        s.segment_pool_id == pool
            && s.blocks
                .iter()
                .any(|b| b.addr <= addr.0 && addr.0 < b.addr + b.size)
    })
}

#[test]
fn test_graph_capture_simple() {
    let (d, a) = setup();
    let s = a.create_stream(0).unwrap();
    let input = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, input.ptr(), MIB, 3) }.unwrap();
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let pool = capture.pool().id();
    assert!(
        !pool.is_user_created() && !pool.is_default(),
        "a graph's own pool: {pool}"
    );
    let output = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(s, output.ptr(), input.ptr(), MIB) }.unwrap();
    let graph = capture.end().unwrap();
    assert_eq!(graph.node_count(), 1);
    assert!(in_pool(&a, pool, output.ptr()));
    assert!(in_pool(&a, MemPoolId::DEFAULT, input.ptr()));
    // The copy did not run at capture; each replay runs it.
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, output.ptr(), 0, MIB) }.unwrap();
    graph.replay(s).unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            d.kernels()
                .count_pattern_mismatches(s, output.ptr(), MIB, 3)
        }
        .unwrap(),
        0
    );
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, input.ptr(), MIB, 4) }.unwrap();
    graph.replay(s).unwrap();
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            d.kernels()
                .count_pattern_mismatches(s, output.ptr(), MIB, 4)
        }
        .unwrap(),
        0
    );
    a.check_invariants().unwrap();
}

#[test]
fn test_graph_capture_oom() {
    let (d, a) = setup();
    let s = a.create_stream(0).unwrap();
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let err = a.allocate_on(s, 1 << 30).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    assert!(err.to_string().contains("stream capture"), "{err}");
    drop(capture);
    // The capture is over: the stream runs work, allocation works.
    assert_eq!(
        d.graphs().stream_capture_status(s).unwrap(),
        CaptureStatus::None
    );
    let p = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(s, p.ptr(), 1, MIB) }.unwrap();
    assert!(bytes(&d, s, &p, MIB).iter().all(|&b| b == 1));
}

/// Graphs captured one after the other, with a pool of their own each or sharing the first's:
/// sharing lets a later capture reuse what an earlier one freed, so it reserves less; every
/// graph replays correctly in capture order either way.
fn successive(graphs: usize) {
    let mut reserved_by = Vec::new();
    for share in [false, true] {
        let (d, a) = setup();
        let s = a.create_stream(0).unwrap();
        let input = a.allocate_on(s, 4 * MIB).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(s, input.ptr(), 4 * MIB, 9) }.unwrap();
        d.stream_synchronize(s).unwrap();
        let before = reserved(&a);
        let mut made = Vec::new();
        let mut outputs = Vec::new();
        for g in 0..graphs {
            let pool = if share {
                made.first()
                    .map(|g: &cudalloc::graph::Graph| g.pool().clone())
            } else {
                None
            };
            let capture = a
                .begin_capture(s, pool.as_ref(), CaptureMode::Global)
                .unwrap();
            // A temporary freed inside the capture, and an output kept.
            let tmp = a.allocate_on(s, 4 * MIB).unwrap();
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.copy_device_to_device(s, tmp.ptr(), input.ptr(), 4 * MIB) }.unwrap();
            let out = a.allocate_on(s, 4 * MIB).unwrap();
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.copy_device_to_device(s, out.ptr(), tmp.ptr(), 4 * MIB) }.unwrap();
            drop(tmp);
            made.push(capture.end().unwrap());
            outputs.push(out);
            assert_eq!(made[g].node_count(), 2);
        }
        for (g, out) in made.iter().zip(&outputs) {
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.memset(s, out.ptr(), 0, 4 * MIB) }.unwrap();
            g.replay(s).unwrap();
            assert_eq!(
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe {
                    d.kernels()
                        .count_pattern_mismatches(s, out.ptr(), 4 * MIB, 9)
                }
                .unwrap(),
                0
            );
        }
        reserved_by.push(reserved(&a) - before);
        a.check_invariants().unwrap();
    }
    assert!(
        reserved_by[1] < reserved_by[0],
        "a shared pool reserves less: {reserved_by:?}"
    );
}

#[test]
fn test_graph_two_successive() {
    successive(2);
}

#[test]
fn test_graph_three_successive() {
    successive(3);
}

#[test]
fn test_graph_concurrent_replay() {
    let (d, a) = setup();
    let (s1, s2) = (a.create_stream(0).unwrap(), a.create_stream(0).unwrap());
    let mut graphs = Vec::new();
    for (s, seed) in [(s1, 1u64), (s2, 2)] {
        let capture = a.begin_capture(s, None, CaptureMode::ThreadLocal).unwrap();
        let out = a.allocate_on(s, 2 * MIB).unwrap();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().fill_pattern(s, out.ptr(), 2 * MIB, seed) }.unwrap();
        graphs.push((capture.end().unwrap(), out, s, seed));
    }
    // Separate pools: the outputs never overlap, so replays on two streams at once cannot
    // write each other's memory.
    let (p, q) = (graphs[0].1.ptr().0, graphs[1].1.ptr().0);
    assert!(p + 2 * MIB <= q || q + 2 * MIB <= p);
    for _ in 0..10 {
        for (g, _, s, _) in &graphs {
            g.replay(*s).unwrap();
        }
    }
    for (_, out, s, seed) in &graphs {
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                d.kernels()
                    .count_pattern_mismatches(*s, out.ptr(), 2 * MIB, *seed)
            }
            .unwrap(),
            0
        );
    }
}

#[test]
fn test_graph_memory_stats_and_use_result_after_destroy_graph() {
    let (d, a) = setup();
    let s = a.create_stream(0).unwrap();
    let baseline = a.memory_stats(0).unwrap();
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let pool = capture.pool().clone();
    let kept = a.allocate_on(s, 3 * MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, kept.ptr(), 3 * MIB, 5) }.unwrap();
    drop(a.allocate_on(s, 6 * MIB).unwrap());
    let graph = capture.end().unwrap();
    let during = a.memory_stats(0).unwrap();
    assert_eq!(
        during.allocated_bytes.all.current - baseline.allocated_bytes.all.current,
        (3 * MIB) as i64
    );
    assert!(during.reserved_bytes.all.current > baseline.reserved_bytes.all.current);
    assert_eq!(
        pool.memory_stats(0).unwrap().allocated_bytes.all.current,
        (3 * MIB) as i64
    );
    graph.replay(s).unwrap();
    // The graph and its pool go; the result stays usable.
    drop(graph);
    drop(pool);
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            d.kernels()
                .count_pattern_mismatches(s, kept.ptr(), 3 * MIB, 5)
        }
        .unwrap(),
        0
    );
    a.empty_cache();
    let after = a.memory_stats(0).unwrap();
    assert_eq!(
        after.allocated_bytes.all.current - baseline.allocated_bytes.all.current,
        (3 * MIB) as i64
    );
    drop(kept);
    a.empty_cache();
    let end = a.memory_stats(0).unwrap();
    assert_eq!(
        end.allocated_bytes.all.current,
        baseline.allocated_bytes.all.current
    );
    assert_eq!(
        end.reserved_bytes.all.current,
        baseline.reserved_bytes.all.current
    );
    a.check_invariants().unwrap();
}

#[test]
fn test_graph_record_stream() {
    let (d, a) = setup();
    let (s, side) = (a.create_stream(0).unwrap(), a.create_stream(0).unwrap());
    let (fork, join) = (
        d.event_create(0, EventFlags::default()).unwrap(),
        d.event_create(0, EventFlags::default()).unwrap(),
    );
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let pool = capture.pool().id();
    let used = a.allocate_on(s, MIB).unwrap();
    d.event_record(fork, s).unwrap();
    d.stream_wait_event(side, fork).unwrap();
    // The forked stream allocates from the capture's pool too.
    let on_side = a.allocate_on(side, MIB).unwrap();
    assert!(in_pool(&a, pool, on_side.ptr()));
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(side, used.ptr(), 7, MIB) }.unwrap();
    a.record_stream(&used, side).unwrap();
    let used_at = used.ptr();
    // Freed with a use on the side stream: no event may be recorded now, so the block waits.
    drop(used);
    let again = a.allocate_on(s, MIB).unwrap();
    assert_ne!(
        again.ptr(),
        used_at,
        "a block pending on another stream is not reused"
    );
    d.event_record(join, side).unwrap();
    d.stream_wait_event(s, join).unwrap();
    drop(on_side);
    let graph = capture.end().unwrap();
    graph.replay(s).unwrap();
    d.stream_synchronize(s).unwrap();
    a.check_invariants().unwrap();
    drop(again);
    drop(graph);
    for e in [fork, join] {
        d.event_destroy(e).unwrap();
    }
}

/// Zero bytes of a live graph's memory go to allocations outside its pool: eager allocations of
/// every size the capture used (its freed temporaries included) land elsewhere.
#[test]
fn eager_allocations_never_get_a_live_graphs_memory() {
    let (d, a) = setup();
    let s = a.create_stream(0).unwrap();
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let pool = capture.pool().id();
    let sizes = [512, 64 << 10, MIB, 3 * MIB, 12 * MIB];
    let kept: Vec<DataPtr> = sizes
        .iter()
        .map(|&n| {
            let tmp = a.allocate_on(s, n).unwrap();
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.memset(s, tmp.ptr(), 1, n) }.unwrap();
            drop(tmp);
            a.allocate_on(s, n / 2 + 1).unwrap()
        })
        .collect();
    let graph = capture.end().unwrap();
    for &n in &sizes {
        for stream in [s, a.default_stream(0).unwrap()] {
            let p = a.allocate_on(stream, n).unwrap();
            assert!(
                !in_pool(&a, pool, p.ptr()),
                "an eager {n}-byte block in the graph's pool"
            );
        }
    }
    a.empty_cache();
    assert!(
        a.snapshot()
            .segments
            .iter()
            .any(|seg| seg.segment_pool_id == pool),
        "empty_cache leaves a live graph's pool alone"
    );
    drop(kept);
    drop(graph);
    a.empty_cache();
    assert_eq!(reserved(&a), 0);
}

/// Capturing through the allocator where the stream cannot capture (a backend without graphs)
/// is a clear error that leaves the allocator as it was.
#[test]
fn a_capture_on_a_backend_without_graphs_is_a_clear_error() {
    let driver: Arc<dyn Driver> = Arc::new(cudalloc::backend::SimDriver::new(1, 64 << 20).unwrap());
    let a = Runtime::new(driver, AllocatorConfig::default()).unwrap();
    let s = a.default_stream(0).unwrap();
    let err = a.begin_capture(s, None, CaptureMode::Global).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamCapture, "{err}");
    let p = a.allocate_on(s, MIB).unwrap();
    drop(p);
    a.empty_cache();
    assert_eq!(reserved(&a), 0);
}

/// Under the sanitizer a replay is checked like eager work: the capture's own temporaries (freed
/// inside it, kept by the graph's pool) are no use after free, while an unordered write to the
/// graph's output from another stream is a race.
#[test]
fn the_sanitizer_checks_replays_without_false_reports() {
    let (driver, cap) = common::sized_driver(256 * MIB);
    let a = Runtime::builder()
        .config(cudalloc::AllocatorConfig::parse(&cap).unwrap())
        .sanitize(cudalloc::sanitizer::Sanitize::On(
            cudalloc::sanitizer::SanitizeOptions::report(),
        ))
        .build(driver)
        .unwrap();
    let d = Arc::clone(a.driver());
    let san = a.sanitizer().unwrap();
    let (s, t) = (a.create_stream(0).unwrap(), a.create_stream(0).unwrap());
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let tmp = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, tmp.ptr(), MIB, 1) }.unwrap();
    let out = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(s, out.ptr(), tmp.ptr(), MIB) }.unwrap();
    drop(tmp);
    let graph = capture.end().unwrap();
    for _ in 0..3 {
        graph.replay(s).unwrap();
    }
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.kernels().count_pattern_mismatches(s, out.ptr(), MIB, 1) }.unwrap(),
        0
    );
    let reports: Vec<String> = san.take_reports().iter().map(|r| r.to_string()).collect();
    assert!(reports.is_empty(), "{reports:#?}");
    // Another stream writes the output with no order to the next replay: a race.
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.memset(t, out.ptr(), 0, MIB) }.unwrap();
    let _ = graph.replay(s);
    assert!(
        !san.take_reports().is_empty(),
        "the unordered replay was not reported"
    );
}

/// Graphs meet thread front caches (`thread_cache_mb`): a block this thread's cache holds for the
/// default pool is never what a capture on the same stream is handed; the capture's allocation
/// comes from the graph's pool, and the cached block still serves eager work afterwards.
#[test]
fn a_capture_never_takes_a_block_from_the_threads_front_cache() {
    let (_, a) = setup_with("thread_cache_mb:64");
    let s = a.create_stream(0).unwrap();
    let _on = a.set_current_stream(s).unwrap();
    let cached = a.allocate(0, MIB).unwrap().ptr();
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let pool = capture.pool().id();
    let inside = a.allocate(0, MIB).unwrap();
    assert_ne!(
        inside.ptr(),
        cached,
        "the capture got the front cache's block"
    );
    assert!(in_pool(&a, pool, inside.ptr()));
    let graph = capture.end().unwrap();
    let eager = a.allocate(0, MIB).unwrap();
    assert!(in_pool(&a, MemPoolId::DEFAULT, eager.ptr()));
    assert_eq!(
        eager.ptr(),
        cached,
        "the cached block serves eager work again"
    );
    drop((inside, eager, graph));
    a.check_invariants().unwrap();
}

/// A capture begun and ended by someone else (a library's own capture API; here the driver's
/// calls directly) and routed with `route_capture`: allocations inside come from the routed
/// pool, a free inside waits for the end, finishing is refused while the capture runs, the pool
/// keeps the graph's memory out of eager hands, and a stream that is not capturing is refused.
#[test]
fn a_capture_begun_by_someone_else_is_routed_to_a_pool() {
    let (d, a) = setup();
    let s = a.create_stream(0).unwrap();
    let err = a.route_capture(s, None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamCapture, "{err}");
    d.graphs()
        .stream_begin_capture(s, CaptureMode::ThreadLocal)
        .unwrap();
    let mut route = a.route_capture(s, None).unwrap();
    let pool = route.pool().id();
    let tmp = a.allocate_on(s, MIB).unwrap();
    let out = a.allocate_on(s, MIB).unwrap();
    assert!(in_pool(&a, pool, tmp.ptr()) && in_pool(&a, pool, out.ptr()));
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, tmp.ptr(), MIB, 4) }.unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(s, out.ptr(), tmp.ptr(), MIB) }.unwrap();
    drop(tmp);
    let err = route.finish().unwrap_err();
    assert!(err.to_string().contains("still being captured"), "{err}");
    let graph = d.graphs().stream_end_capture(s).unwrap();
    let kept = route.finish().unwrap();
    assert!(route.finish().is_err(), "finished twice");
    let exec = d.graphs().graph_instantiate(graph).unwrap();
    for _ in 0..3 {
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.memset(s, out.ptr(), 0, MIB) }.unwrap();
        let eager = a.allocate_on(s, MIB).unwrap();
        assert!(
            !in_pool(&a, pool, eager.ptr()),
            "eager work got the graph's memory"
        );
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.graphs().graph_launch(exec, s) }.unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(s, out.ptr(), MIB, 4) }.unwrap(),
            0
        );
    }
    d.graphs().graph_exec_destroy(exec).unwrap();
    d.graphs().graph_destroy(graph).unwrap();
    drop((out, kept, route));
    a.empty_cache();
    assert_eq!(
        reserved(&a),
        0,
        "the pool went back once its holders were gone"
    );
}

/// A graph outliving its allocator: it keeps its pool — and the driver — so it still replays
/// into its output, and once graph and output are gone every byte is back with the driver.
#[test]
fn a_graph_outliving_its_allocator_still_replays_and_gives_its_memory_back() {
    let _alone = common::device_alone();
    let (d, a) = setup();
    let before = common::free_baseline(&d);
    let s = a.create_stream(0).unwrap();
    let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
    let tmp = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.kernels().fill_pattern(s, tmp.ptr(), MIB, 8) }.unwrap();
    let out = a.allocate_on(s, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.copy_device_to_device(s, out.ptr(), tmp.ptr(), MIB) }.unwrap();
    drop(tmp);
    let graph = capture.end().unwrap();
    drop(a);
    for _ in 0..2 {
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { d.memset(s, out.ptr(), 0, MIB) }.unwrap();
        graph.replay(s).unwrap();
        assert_eq!(
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.kernels().count_pattern_mismatches(s, out.ptr(), MIB, 8) }.unwrap(),
            0
        );
    }
    drop(out);
    drop(graph);
    d.stream_synchronize(s).unwrap();
    assert_eq!(
        d.mem_info(0).unwrap().free,
        before,
        "every segment went back once graph and output were gone"
    );
}
