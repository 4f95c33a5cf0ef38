//! Snapshots in PyTorch's pickled layout: checked by `scripts/check_snapshot.py` (the invariants
//! `torch.cuda._memory_viz` asserts; and `_memory_viz` itself where torch is installed), read back
//! here; the out-of-memory dump of `oom_snapshot_path`; and a corrupt snapshot the checker refuses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use common::*;
use cudalloc::{backend::Driver, backend::HostDriver, AllocatorConfig, Runtime};
use cudalloc::{stats::HistoryMode, stats::HistoryOptions};
use serde_pickle::{HashableValue as H, Value as V};

fn checker() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check_snapshot.py")
}

/// Runs the checker on `file`: `Some(passed)`, or `None` (printed) when there is no python3.
fn check(test: &str, file: &Path) -> Option<bool> {
    match Command::new("python3").arg(checker()).arg(file).output() {
        Ok(out) => {
            print!("{}", String::from_utf8_lossy(&out.stdout));
            Some(out.status.success())
        }
        Err(err) => {
            println!("{test}: the Python check is skipped: no python3 ({err})");
            None
        }
    }
}

fn temp_file(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cudalloc-{}-{name}", std::process::id()))
}

fn get<'a>(v: &'a V, key: &str) -> &'a V {
    match v {
        V::Dict(d) => &d[&H::String(key.into())],
        other => panic!("not a dict: {other:?}"),
    }
}

fn list(v: &V) -> &Vec<V> {
    match v {
        V::List(l) => l,
        other => panic!("not a list: {other:?}"),
    }
}

/// A workload with every block state, two streams, both pools, an out-of-memory and stacks; the
/// gate holds a stream so one block stays pending (open it before dropping the allocator).
fn busy_allocator(
    conf: &str,
) -> (
    Runtime,
    cudalloc::internals::StreamGate,
    Vec<cudalloc::DataPtr>,
) {
    let host = Arc::new(
        HostDriver::builder()
            .devices(2)
            .memory_per_device(64 << 20)
            .build()
            .unwrap(),
    );
    let driver: Arc<dyn Driver> = host.clone();
    let a = Runtime::new(driver, AllocatorConfig::parse(conf).unwrap()).unwrap();
    a.record_memory_history(HistoryOptions::new(HistoryMode::All, 10_000).with_stacks(true));
    let side = a.create_stream(0).unwrap();
    let mut held = Vec::new();
    for i in 0..12u64 {
        held.push(a.allocate(0, 1000 + i * 70_000).unwrap());
        held.push(a.allocate_on(side, 3 << 20).unwrap());
    }
    held.push(a.allocate(1, 5 << 20).unwrap());
    held.drain(..6);
    assert!(
        a.allocate(0, 60 << 20).is_err(),
        "an out-of-memory in the trace"
    );
    // A block waiting for another stream's work: active_pending_free.
    let other = a.create_stream(0).unwrap();
    let gate = host.gate_stream(other).unwrap();
    let waiting = a.allocate(0, 4096).unwrap();
    a.record_stream(&waiting, other).unwrap();
    drop(waiting);
    (a, gate, held)
}

#[test]
fn a_snapshot_has_pytorchs_layout_and_passes_the_memory_viz_checks() {
    for conf in ["", "expandable_segments:True"] {
        let (a, gate, held) = busy_allocator(conf);
        let snap = a.snapshot();
        drop(gate);
        drop(held);
        let bytes = snap.to_pytorch_pickle(&a.config()).unwrap();
        let file = temp_file("snapshot.pickle");
        std::fs::write(&file, &bytes).unwrap();
        if let Some(passed) = check("a_snapshot_has_pytorchs_layout", &file) {
            assert!(passed, "{conf:?}: the checker refused the snapshot");
        }
        std::fs::remove_file(&file).unwrap();
        // Read back: the same segments, per-device traces, PyTorch's names.
        let v = serde_pickle::value_from_slice(&bytes, Default::default()).unwrap();
        let segments = list(get(&v, "segments"));
        assert_eq!(segments.len(), snap.segments.len());
        let traces = list(get(&v, "device_traces"));
        assert_eq!(traces.len(), 2, "one list per device");
        let states: Vec<&V> = segments
            .iter()
            .flat_map(|s| list(get(s, "blocks")))
            .map(|b| get(b, "state"))
            .collect();
        for state in ["active_allocated", "active_pending_free", "inactive"] {
            assert!(
                states.contains(&&V::String(state.into())),
                "{conf:?}: no {state} block"
            );
        }
        let oom = list(&traces[0])
            .iter()
            .find(|e| get(e, "action") == &V::String("oom".into()))
            .expect("an oom entry");
        assert!(matches!(get(oom, "device_free"), V::I64(_)));
        let framed = segments
            .iter()
            .flat_map(|s| list(get(s, "blocks")))
            .filter(|b| !list(get(b, "frames")).is_empty())
            .count();
        assert!(framed > 0, "live blocks carry their allocation's stack");
    }
}

#[test]
fn running_out_of_memory_writes_the_snapshot_before_the_error_returns() {
    let file = temp_file("oom.pickle");
    let _ = std::fs::remove_file(&file);
    let conf = format!("oom_snapshot_path:{}", file.display());
    let a = checked_allocator(Arc::new(host_driver()), &conf);
    a.record_memory_history(cudalloc::stats::HistoryOptions::new(
        cudalloc::stats::HistoryMode::All,
        1000,
    ));
    let _held = a.allocate(0, 40 << 20).unwrap();
    assert!(!file.exists());
    let err = a.allocate(0, 40 << 20).unwrap_err();
    assert_eq!(err.kind(), cudalloc::ErrorKind::OutOfMemory);
    let bytes = std::fs::read(&file).expect("the snapshot was written");
    let v = serde_pickle::value_from_slice(&bytes, Default::default()).unwrap();
    let trace = list(&list(get(&v, "device_traces"))[0]).clone();
    assert!(trace
        .iter()
        .any(|e| get(e, "action") == &V::String("oom".into())));
    if let Some(passed) = check("running_out_of_memory_writes_the_snapshot", &file) {
        assert!(passed);
    }
    std::fs::remove_file(&file).unwrap();
}

/// PyTorch's `_dump_snapshot(path)` and its one-number helpers: a dump is the snapshot taken
/// at that moment, in PyTorch's layout, and a link planted at the path is replaced, not followed.
#[test]
fn dump_snapshot_writes_the_snapshot_of_the_moment_to_the_path() {
    let file = temp_file("dump.pickle");
    let target = temp_file("dump-target");
    std::fs::write(&target, b"keep").unwrap();
    let _ = std::fs::remove_file(&file);
    std::os::unix::fs::symlink(&target, &file).unwrap();
    let a = checked_allocator(Arc::new(host_driver()), "");
    let held = a.allocate(0, 3 << 20).unwrap();
    a.dump_snapshot(&file).unwrap();
    assert_eq!(
        std::fs::read(&target).unwrap(),
        b"keep",
        "the planted link was followed"
    );
    let bytes = std::fs::read(&file).unwrap();
    let v = serde_pickle::value_from_slice(&bytes, Default::default()).unwrap();
    let segments = list(get(&v, "segments"));
    assert_eq!(segments.len(), 1);
    assert_eq!(get(&segments[0], "total_size"), &V::I64(20 << 20)); // PyTorch: 1-10 MiB get 20 MiB
    if let Some(passed) = check("dump_snapshot", &file) {
        assert!(passed);
    }
    // The helpers are the statistics' "all" figures.
    let stats = a.memory_stats(0).unwrap();
    assert_eq!(a.memory_allocated(0).unwrap(), 3 << 20);
    assert_eq!(a.memory_reserved(0).unwrap(), 20 << 20);
    drop(held);
    assert_eq!(a.memory_allocated(0).unwrap(), 0);
    assert_eq!(a.max_memory_allocated(0).unwrap(), 3 << 20);
    assert_eq!(
        a.max_memory_reserved(0).unwrap(),
        stats.reserved_bytes.all.peak as u64
    );
    a.reset_peak_memory_stats(0).unwrap();
    assert_eq!(a.max_memory_allocated(0).unwrap(), 0);
    assert!(
        a.memory_allocated(7).is_err(),
        "a bad device is an error, not a zero"
    );
    std::fs::remove_file(&file).unwrap();
    std::fs::remove_file(&target).unwrap();
}

#[test]
fn the_checker_refuses_a_snapshot_whose_blocks_do_not_add_up() {
    let block = |address: i64, size: i64| {
        V::Dict(
            [
                ("address", V::I64(address)),
                ("size", V::I64(size)),
                ("requested_size", V::I64(size)),
                ("state", V::String("active_allocated".into())),
                ("frames", V::List(vec![])),
            ]
            .into_iter()
            .map(|(k, v)| (H::String(k.into()), v))
            .collect(),
        )
    };
    let segment = V::Dict(
        [
            ("device", V::I64(0)),
            ("address", V::I64(4096)),
            ("total_size", V::I64(2 << 20)),
            ("allocated_size", V::I64(1024)),
            ("active_size", V::I64(1024)),
            ("requested_size", V::I64(1024)),
            ("stream", V::I64(0)),
            ("segment_type", V::String("small".into())),
            ("blocks", V::List(vec![block(4096, 1024)])), // 1 KiB of a 2 MiB segment
        ]
        .into_iter()
        .map(|(k, v)| (H::String(k.into()), v))
        .collect(),
    );
    let top = V::Dict(
        [
            ("segments", V::List(vec![segment])),
            ("device_traces", V::List(vec![V::List(vec![])])),
        ]
        .into_iter()
        .map(|(k, v)| (H::String(k.into()), v))
        .collect(),
    );
    let file = temp_file("corrupt.pickle");
    std::fs::write(
        &file,
        serde_pickle::value_to_vec(&top, Default::default()).unwrap(),
    )
    .unwrap();
    if let Some(passed) = check("the_checker_refuses", &file) {
        assert!(!passed, "blocks that do not add up must be refused");
    }
    std::fs::remove_file(&file).unwrap();
}
