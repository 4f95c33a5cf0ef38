//! IPC benchmarks.
//! * `limbo_drain/<in limbo>` — the cost of one consumer release plus the drain that frees it,
//!   with 100 vs 100,000 other storages waiting in limbo. PyTorch scans its whole limbo on every
//!   collect; ours reads only the release ring, so the two should cost the same (target: within 2×).
//!   The consumer's release is the in-process path of a handle dropped unopened (give back the count,
//!   push the slot into the ring) — exactly the file operations a remote consumer performs.
//! * `share_encode_decode` — share a storage, encode the handle, decode it (file cached), drop it.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use cudalloc::{CachingAllocator, HostDriver, IpcHandle, Storage};

fn allocator() -> Arc<CachingAllocator> {
    let driver = Arc::new(
        HostDriver::builder()
            .memory_per_device(2 << 30)
            .poison_on_free(false)
            .build()
            .unwrap(),
    );
    Arc::new(CachingAllocator::new(driver, Default::default()).unwrap())
}

/// A storage in limbo whose only count is held by the returned (decoded, unopened) handle.
fn in_limbo(a: &Arc<CachingAllocator>) -> IpcHandle {
    let s = Storage::new(a, 0, 512).unwrap();
    let bytes = s.share_ipc().unwrap().into_bytes();
    let handle = IpcHandle::from_bytes(&bytes).unwrap();
    drop(s);
    handle
}

fn limbo_drain(c: &mut Criterion) {
    let mut g = c.benchmark_group("limbo_drain");
    for n in [100usize, 100_000] {
        let a = allocator();
        let background: Vec<IpcHandle> = (0..n).map(|_| in_limbo(&a)).collect();
        assert_eq!(a.ipc_limbo().0, n);
        g.bench_function(BenchmarkId::new("release+drain", n), |b| {
            b.iter_batched(
                || in_limbo(&a),
                |handle| {
                    drop(handle);
                    let freed = a.ipc_drain();
                    assert_eq!(freed.storages, 1);
                },
                BatchSize::SmallInput,
            )
        });
        g.bench_function(BenchmarkId::new("collect (full scan)", n), |b| {
            b.iter_batched(
                || in_limbo(&a),
                |handle| {
                    drop(handle);
                    assert_eq!(a.ipc_collect_stats().storages, 1);
                },
                BatchSize::SmallInput,
            )
        });
        drop(background);
        a.ipc_collect();
    }
    g.finish();
}

fn share_round_trip(c: &mut Criterion) {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    c.bench_function("share_encode_decode", |b| {
        b.iter(|| {
            let bytes = s.share_ipc().unwrap().into_bytes();
            drop(IpcHandle::from_bytes(&bytes).unwrap());
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2)).sample_size(20);
    targets = limbo_drain, share_round_trip
}
criterion_main!(benches);
