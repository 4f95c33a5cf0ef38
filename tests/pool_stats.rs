//! Memory pools' statistics (`alloc/engine/pool_peaks.rs`): a pool's own peaks — the highest its
//! sums over every stream it is used on reached — that reset without touching the device's; what
//! pools and graphs reserve as one cheap figure; the pinned host allocator's statistics under
//! PyTorch's key names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::backend::Driver;
use cudalloc::graph::CaptureMode;
use cudalloc::Runtime;

const MIB: u64 = 1 << 20;

fn setup() -> (Arc<dyn Driver>, Runtime) {
    let driver = test_driver();
    let a = Runtime::builder()
        .config(test_config(""))
        .check_invariants(true)
        .build(Arc::clone(&driver))
        .unwrap();
    (driver, a)
}

#[test]
fn mem_pool_peak_reset() {
    let _device = device_shared();
    let (_d, a) = setup();
    let s = a.create_stream(0).unwrap();
    let pool = a.mem_pool(Default::default()).unwrap();
    let allocated = || {
        pool.memory_stats(0)
            .map(|st| st.allocated_bytes.all)
            .unwrap()
    };
    let mut held: Vec<_> = {
        let _scope = a.use_mem_pool(&pool, 0).unwrap();
        (0..3).map(|_| a.allocate_on(s, MIB).unwrap()).collect()
    };
    held.truncate(1);
    let st = allocated();
    assert_eq!((st.current, st.peak), (MIB as i64, 3 * MIB as i64));
    // An allocation outside the pool moves the device's figures, not the pool's.
    let outside = a.allocate_on(s, 8 * MIB).unwrap();
    assert_eq!(allocated().peak, 3 * MIB as i64);
    let device_peak = a.memory_stats(0).unwrap().allocated_bytes.all.peak;

    pool.reset_peak_stats(0).unwrap();
    let st = allocated();
    assert_eq!(
        (st.current, st.peak),
        (MIB as i64, MIB as i64),
        "reset to the current"
    );
    assert_eq!(
        a.memory_stats(0).unwrap().allocated_bytes.all.peak,
        device_peak,
        "the device's peak is not the pool's to reset"
    );
    {
        let _scope = a.use_mem_pool(&pool, 0).unwrap();
        held.push(a.allocate_on(s, MIB).unwrap());
    }
    assert_eq!(allocated().peak, 2 * MIB as i64);
    drop((held, outside));
    assert_eq!(allocated().current, 0);
    assert_eq!(allocated().peak, 2 * MIB as i64);
}

#[test]
fn a_pool_peak_is_the_peak_of_its_sum_over_streams() {
    let _device = device_shared();
    let (_d, a) = setup();
    let (s1, s2) = (a.create_stream(0).unwrap(), a.create_stream(0).unwrap());
    let pool = a.mem_pool(Default::default()).unwrap();
    let _scope = a.use_mem_pool(&pool, 0).unwrap();
    let x = a.allocate_on(s1, 2 * MIB).unwrap();
    let y = a.allocate_on(s2, 3 * MIB).unwrap();
    drop(x);
    let z = a.allocate_on(s1, MIB).unwrap();
    let st = pool.memory_stats(0).unwrap();
    // Each stream alone peaked at 2 and 3 MiB; together at 5 MiB (never 6).
    assert_eq!(st.allocated_bytes.all.current, 4 * MIB as i64);
    assert_eq!(st.allocated_bytes.all.peak, 5 * MIB as i64);
    assert_eq!(st.allocation.all.peak, 2);
    assert_eq!(st.reserved_bytes.all.peak, st.reserved_bytes.all.current);
    drop((y, z));
    a.check_invariants().unwrap();
}

#[test]
fn pools_reserved_counts_pools_and_the_graphs_that_hold_them() {
    let _device = device_shared();
    let (_d, a) = setup();
    let s = a.create_stream(0).unwrap();
    assert_eq!(a.pools_reserved(0).unwrap().pools, 0);
    let pool = a.mem_pool(Default::default()).unwrap();
    let in_pool = {
        let _scope = a.use_mem_pool(&pool, 0).unwrap();
        a.allocate_on(s, 3 * MIB).unwrap()
    };
    let outside = a.allocate_on(s, 5 * MIB).unwrap();
    let reserved = a.pools_reserved(0).unwrap();
    let pool_reserved = pool.memory_stats(0).unwrap().reserved_bytes.all.current as u64;
    assert_eq!((reserved.pools, reserved.graphs), (pool_reserved, 0));
    assert!(pool_reserved >= 3 * MIB);

    if a.driver().graphs().stream_capture_status(s).is_ok() && graphs_supported(&a) {
        let capture = a.begin_capture(s, None, CaptureMode::Global).unwrap();
        let graph_pool = capture.pool().clone();
        let out = a.allocate_on(s, 2 * MIB).unwrap();
        let graph = capture.end().unwrap();
        let held = graph_pool
            .memory_stats(0)
            .unwrap()
            .reserved_bytes
            .all
            .current as u64;
        let reserved = a.pools_reserved(0).unwrap();
        assert_eq!(reserved.pools, pool_reserved + held);
        assert_eq!(reserved.graphs, held, "the graph holds its capture's pool");
        drop((out, graph, graph_pool));
    }
    drop((in_pool, pool, outside));
    a.empty_cache();
    assert_eq!(a.pools_reserved(0).unwrap(), Default::default());
}

/// Whether the backend captures graphs (the host backend and the CUDA double do).
fn graphs_supported(a: &Runtime) -> bool {
    let s = a.create_stream(0).unwrap();
    match a.begin_capture(s, None, CaptureMode::Global) {
        Ok(capture) => {
            drop(capture.end().unwrap());
            true
        }
        Err(err) => {
            println!("pools_reserved_counts_pools_and_the_graphs_that_hold_them: graph part skipped: {err}");
            false
        }
    }
}

#[test]
fn pinned_statistics_use_pytorchs_key_names() {
    let _device = device_shared();
    let (_d, a) = setup();
    let buffer = a.pinned(4096).unwrap();
    let keys: Vec<String> = a.pinned_allocator().stats().to_map().into_keys().collect();
    // PyTorch's `torch.cuda.host_memory_stats()` keys (HostStats; the field names pytorch#169560
    // documents: allocations / allocated_bytes are the pool, active_* what is handed out).
    let mut expected = Vec::new();
    for stat in [
        "active_bytes",
        "active_requests",
        "allocated_bytes",
        "allocations",
    ] {
        for kind in ["allocated", "current", "freed", "peak"] {
            expected.push(format!("{stat}.{kind}"));
        }
    }
    for timing in ["host_alloc_time", "host_free_time"] {
        for kind in ["avg", "count", "max", "min", "total"] {
            expected.push(format!("{timing}.{kind}"));
        }
    }
    expected.push("num_host_alloc".into());
    expected.push("num_host_free".into());
    expected.sort();
    assert_eq!(keys, expected);
    drop(buffer);
}
