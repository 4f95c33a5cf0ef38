//! Where graphs and pools meet the rest: a pool's memory shared with another process (supported:
//! the consumer keeps it, the pool gives it back only after the consumer let go), sharing and
//! receiving refused while the stream is being captured (the event would be a point of the
//! capture, not a real record), a lazy clone's first write inside a capture (the copy becomes part
//! of the graph), and graphs and captures dropped in a forked child (the parent's stay intact).
//! Children are this test binary re-executed (or forked); the backend is the run's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use cudalloc::{
    backend::CaptureStatus, graph::CaptureMode, ipc::IpcHandle, pool::MemPoolId,
    pool::MemPoolOptions, DeviceAddr, ErrorKind, Runtime, Storage,
};

const CHILD: &str = "graphs_meet_child";
const MIB: u64 = 1 << 20;

/// One test at a time in this binary: two of them fork.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn runtime() -> Arc<Runtime> {
    let (driver, cap) = sized_driver(256 * MIB);
    Arc::new(
        Runtime::builder()
            .config(test_config(&cap))
            .check_invariants(true)
            .build(sanitized(driver))
            .unwrap(),
    )
}

/// The pool of the segment holding `addr`, if any.
fn pool_of(rt: &Runtime, addr: DeviceAddr) -> Option<MemPoolId> {
    rt.snapshot()
        .segments
        .iter()
        .find(|s| {
            s.blocks
                .iter()
                .any(|b| b.addr <= addr.0 && addr.0 < b.addr + b.size)
        })
        .map(|s| s.segment_pool_id)
}

fn reserved(rt: &Runtime) -> i64 {
    rt.memory_stats(0).unwrap().reserved_bytes.all.current
}

/// A storage of a private pool, shared with a child: the child reads and writes it; the
/// producer drops the storage and the pool while the child still holds it — the memory stays
/// in limbo, never handed out again; once the child let go, collecting gives it back and the
/// pool's segment is released.
#[test]
fn a_pools_memory_shared_with_another_process_stays_until_the_consumer_lets_go() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let rt = runtime();
    let pool = rt.mem_pool(MemPoolOptions::default()).unwrap();
    let shared = {
        let _in_pool = rt.use_mem_pool(&pool, 0).unwrap();
        Storage::new(&rt, 0, 4 * MIB).unwrap()
    };
    assert_eq!(pool_of(&rt, shared.unordered_data_ptr()), Some(pool.id()));
    shared.fill_pattern(3).unwrap();
    let handle = hex(&shared.share_ipc().unwrap().into_bytes());
    let mut child = ChildProcess::spawn(CHILD, "read_write_hold", test_backend());
    child.send(&handle);
    assert_eq!(child.recv(), "mismatches=0");
    assert_eq!(child.recv(), "wrote 8");
    assert_eq!(
        shared.count_pattern_mismatches(8).unwrap(),
        0,
        "the consumer's write"
    );
    let addr = shared.unordered_data_ptr();
    drop(shared);
    drop(pool);
    assert_eq!(rt.ipc_limbo().0, 1, "the consumer holds it: limbo");
    rt.ipc_collect();
    for _ in 0..4 {
        let eager = Storage::new(&rt, 0, 4 * MIB).unwrap();
        assert_ne!(
            eager.unordered_data_ptr(),
            addr,
            "memory a consumer holds was handed out"
        );
    }
    child.send("release");
    assert_eq!(child.recv(), "released");
    child.finish();
    rt.ipc_collect();
    assert_eq!(rt.ipc_limbo(), (0, 0));
    rt.empty_cache();
    assert_eq!(reserved(&rt), 0, "the pool's segment went back");
}

/// Sharing and receiving on a capturing stream are refused before any driver call, so the
/// capture stays valid and ends with its graph; once it ended, a storage allocated inside it is
/// shared and a handle from another process is received.
#[test]
fn sharing_and_receiving_on_a_capturing_stream_are_refused_clearly() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let rt = runtime();
    let mut child = ChildProcess::spawn(CHILD, "produce", test_backend());
    let handles = child.recv();
    let (refused, accepted) = handles.split_once(' ').unwrap();
    let s = rt.create_stream(0).unwrap();
    let _on = rt.set_current_stream(s).unwrap();
    let before = Storage::new(&rt, 0, MIB).unwrap();
    before.fill_pattern(1).unwrap();
    let capture = rt.begin_capture(s, None, CaptureMode::Global).unwrap();
    let inside = Storage::new(&rt, 0, MIB).unwrap();
    inside.fill_pattern(2).unwrap();
    let err = before.share_ipc().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamCapture, "{err}");
    assert!(err.to_string().contains("being captured"), "{err}");
    // A refused receipt gives its count back (a handle is used once).
    let err = Storage::from_ipc(&rt, IpcHandle::from_bytes(&unhex(refused)).unwrap()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamCapture, "{err}");
    assert!(err.to_string().contains("being captured"), "{err}");
    assert!(matches!(
        rt.driver().graphs().stream_capture_status(s).unwrap(),
        CaptureStatus::Active { .. }
    ));
    let graph = capture.end().unwrap();
    graph.replay(s).unwrap();
    let handle = inside.share_ipc().unwrap();
    assert!(Storage::from_ipc(&rt, handle).unwrap().is_alias_of(&inside));
    assert_eq!(inside.count_pattern_mismatches(2).unwrap(), 0);
    let received =
        Storage::from_ipc(&rt, IpcHandle::from_bytes(&unhex(accepted)).unwrap()).unwrap();
    assert_eq!(received.count_pattern_mismatches(6).unwrap(), 0);
    drop(received);
    child.send("stop");
    child.finish();
    drop((graph, inside, before));
}

/// A lazy clone whose first write happens inside a capture: the copy that materializes it is
/// recorded into the graph (from the graph's pool), so a replay copies the source's bytes of that
/// moment and then writes; the source is never written.
#[test]
fn a_lazy_clones_first_write_inside_a_capture_is_part_of_the_graph() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let rt = runtime();
    let s = rt.create_stream(0).unwrap();
    let _on = rt.set_current_stream(s).unwrap();
    let src = Storage::new(&rt, 0, MIB).unwrap();
    src.fill_pattern(3).unwrap();
    let capture = rt.begin_capture(s, None, CaptureMode::Global).unwrap();
    let pool = capture.pool().id();
    let clone = src.lazy_clone().unwrap();
    // A write of the first 4 KiB only: the rest must be the copy of the source.
    let head = clone.unordered_mutable_data_ptr().unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().memset(s, head, 0xAB, 4096) }.unwrap();
    let graph = capture.end().unwrap();
    assert!(!clone.is_cow(), "the first write materialized it");
    assert_eq!(
        pool_of(&rt, clone.unordered_data_ptr()),
        Some(pool),
        "from the graph's pool"
    );
    for round in 0..3u64 {
        src.fill_pattern(10 + round).unwrap();
        graph.replay(s).unwrap();
        let mut bytes = vec![0u8; MIB as usize];
        clone
            .copy_to_host(
                clone.runtime().current_stream(clone.device()).unwrap(),
                0,
                &mut bytes,
            )
            .unwrap();
        let mut expected = vec![0u8; MIB as usize];
        src.copy_to_host(
            src.runtime().current_stream(src.device()).unwrap(),
            0,
            &mut expected,
        )
        .unwrap();
        assert!(bytes[..4096].iter().all(|&b| b == 0xAB), "round {round}");
        assert_eq!(
            bytes[4096..],
            expected[4096..],
            "round {round}: the source's bytes"
        );
        assert_eq!(src.count_pattern_mismatches(10 + round).unwrap(), 0);
    }
    drop((graph, clone, src));
    rt.empty_cache();
    assert_eq!(reserved(&rt), 0);
}

/// A graph and a capture dropped in a forked child touch nothing of the parent's: the child's
/// drops see another process and release nothing; the parent's capture ends and its graphs replay.
#[test]
fn graphs_and_captures_dropped_in_a_forked_child_leave_the_parents_intact() {
    if !common::forked::alone(
        "graphs_and_captures_dropped_in_a_forked_child_leave_the_parents_intact",
    ) {
        return; // it forks: run alone, in a re-executed test binary
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    if cuda_suite() {
        println!("forking a CUDA process is undefined: the host backend's case only");
        return;
    }
    let rt = runtime();
    let s = rt.create_stream(0).unwrap();
    let _on = rt.set_current_stream(s).unwrap();
    let capture = rt.begin_capture(s, None, CaptureMode::Global).unwrap();
    let out = Storage::new(&rt, 0, MIB).unwrap();
    out.fill_pattern(4).unwrap();
    let graph = capture.end().unwrap();
    let open = rt
        .begin_capture(s, Some(graph.pool()), CaptureMode::Global)
        .unwrap();
    let verdict = common::forked::in_forked_child(|| {
        // SAFETY: the forked child has its own copy of the parent's memory; these bitwise copies
        // are dropped once, in the child only, and the child `_exit`s without dropping the
        // originals (the parent keeps and drops its own).
        let (g, c) = unsafe { (std::ptr::read(&graph), std::ptr::read(&open)) };
        drop(c);
        drop(g);
        Ok(())
    });
    assert_eq!(verdict, Ok(()));
    assert!(rt
        .driver()
        .graphs()
        .stream_capture_status(s)
        .unwrap()
        .is_capturing());
    let second = open.end().unwrap();
    out.fill_pattern(1).unwrap();
    graph.replay(s).unwrap();
    assert_eq!(out.count_pattern_mismatches(4).unwrap(), 0);
    drop((second, graph, out));
    rt.empty_cache();
    assert_eq!(reserved(&rt), 0);
}

#[test]
#[ignore = "child process entry: run by the tests of this file"]
fn graphs_meet_child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut parent = ParentLink::new();
    let rt = Arc::new(Runtime::builder().build(child_test_driver()).unwrap());
    match role.as_str() {
        "read_write_hold" => {
            let s = Storage::from_ipc(&rt, IpcHandle::from_bytes(&unhex(&parent.recv())).unwrap())
                .unwrap();
            parent.send(&format!(
                "mismatches={}",
                s.count_pattern_mismatches(3).unwrap()
            ));
            s.fill_pattern(8).unwrap();
            rt.driver()
                .stream_synchronize(rt.default_stream(0).unwrap())
                .unwrap();
            parent.send("wrote 8");
            assert_eq!(parent.recv(), "release");
            drop(s);
            parent.send("released");
        }
        "produce" => {
            let s = Storage::new(&rt, 0, MIB).unwrap();
            s.fill_pattern(6).unwrap();
            rt.driver()
                .stream_synchronize(rt.default_stream(0).unwrap())
                .unwrap();
            let (first, second) = (s.share_ipc().unwrap(), s.share_ipc().unwrap());
            parent.send(&format!(
                "{} {}",
                hex(&first.into_bytes()),
                hex(&second.into_bytes())
            ));
            assert_eq!(parent.recv(), "stop");
        }
        other => panic!("unknown role {other}"),
    }
}

/// Found by review: a lazy clone made on the default stream and first written inside a capture
/// on another stream made the capturing stream wait on an event recorded outside the capture
/// (CUDA's capture isolation): the capture was invalidated. The clone's stream is now waited
/// for on the host (the thread's capture mode relaxed), and the copy is the graph's.
#[test]
fn a_clone_made_on_another_stream_is_first_written_inside_a_capture() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let rt = runtime();
    let src = Storage::new(&rt, 0, MIB).unwrap();
    src.fill_pattern(3).unwrap();
    let clone = src.lazy_clone().unwrap(); // on the default stream
    let s = rt.create_stream(0).unwrap();
    let _on = rt.set_current_stream(s).unwrap();
    let capture = rt.begin_capture(s, None, CaptureMode::Global).unwrap();
    let write = clone.unordered_mutable_data_ptr();
    let graph = capture.end();
    assert!(write.is_ok(), "first write: {:?}", write.err());
    let graph = graph.unwrap();
    graph.replay(s).unwrap();
    assert_eq!(clone.count_pattern_mismatches(3).unwrap(), 0);
    drop((graph, clone, src));
}

/// Found by review: the last holder of a lazy clone's data, written inside a capture after a
/// clone had copied eagerly, stole the data and made the capturing stream wait on that copier's
/// event (recorded outside the capture), falling back to a host wait a global capture forbids:
/// the write returned Ok, and only the end failed. The copiers are now waited for on the host,
/// relaxed.
#[test]
fn a_steal_inside_a_capture_after_an_eager_copy_keeps_the_capture() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let rt = runtime();
    let s = rt.create_stream(0).unwrap();
    let _on = rt.set_current_stream(s).unwrap();
    let src = Storage::new(&rt, 0, MIB).unwrap();
    src.fill_pattern(3).unwrap();
    let clone = src.lazy_clone().unwrap();
    clone.unordered_mutable_data_ptr().unwrap(); // an eager copy, with its copier event
    let capture = rt.begin_capture(s, None, CaptureMode::Global).unwrap();
    let at = src.unordered_data_ptr();
    let write = src.unordered_mutable_data_ptr(); // the last holder: steals
    assert_eq!(write.as_ref().ok(), Some(&at), "stolen in place");
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { rt.driver().memset(s, at, 0x5A, 4096) }.unwrap();
    let graph = capture.end().unwrap();
    graph.replay(s).unwrap();
    let mut head = vec![0u8; 4096];
    src.copy_to_host(
        src.runtime().current_stream(src.device()).unwrap(),
        0,
        &mut head,
    )
    .unwrap();
    assert!(head.iter().all(|&b| b == 0x5A));
    assert_eq!(
        clone.count_pattern_mismatches(3).unwrap(),
        0,
        "the copy kept the old bytes"
    );
    drop((graph, clone, src));
}

/// Found by review: with a capture under way on another stream, sharing a lazy clone (which
/// synchronizes) on a stream that was not capturing invalidated the capture. Sharing is refused
/// while any capture of the runtime runs; the capture ends with its graph.
#[test]
fn sharing_while_another_stream_captures_is_refused_and_the_capture_survives() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let rt = runtime();
    let src = Storage::new(&rt, 0, MIB).unwrap();
    src.fill_pattern(1).unwrap();
    let clone = src.lazy_clone().unwrap();
    let s = rt.create_stream(0).unwrap();
    let capture = rt.begin_capture(s, None, CaptureMode::Global).unwrap();
    let err = clone.share_ipc().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamCapture, "{err}");
    assert!(err.to_string().contains("under way"), "{err}");
    let graph = capture.end().unwrap();
    let handle = clone.share_ipc().unwrap();
    drop((handle, graph, clone, src));
}
