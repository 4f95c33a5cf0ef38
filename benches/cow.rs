//! COW benchmarks: `lazy_clone` of a COW storage (one increment), steal-materialize (last
//! reference), and copy-materialize of 64 MiB against a plain device-to-device copy of the same
//! size on the same backend and stream, in the same group.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

mod common;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use cudalloc::{Runtime, Storage};

const BIG: u64 = 64 << 20;

fn allocator() -> Arc<Runtime> {
    common::pinned_allocator(2 << 30)
}

fn lazy_clone_and_steal(c: &mut Criterion) {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let keep = s.lazy_clone().unwrap(); // s is COW from here on
    let mut g = c.benchmark_group("cow");
    g.bench_function("lazy_clone (of a COW storage)", |b| {
        b.iter(|| s.lazy_clone().unwrap())
    });
    g.bench_function("steal-materialize (last reference)", |b| {
        b.iter_batched(
            || {
                let fresh = Storage::new(&a, 0, 4096).unwrap();
                drop(fresh.lazy_clone().unwrap());
                fresh
            },
            |fresh| fresh.unordered_mutable_data_ptr().unwrap(),
            BatchSize::SmallInput,
        )
    });
    g.finish();
    drop(keep);
}

fn copy_materialize(c: &mut Criterion) {
    let a = allocator();
    let d = a.driver().clone();
    let stream = a.default_stream(0).unwrap();
    let src = Storage::new(&a, 0, BIG).unwrap();
    src.fill_pattern(1).unwrap();
    let dst = a.allocate(0, BIG).unwrap();
    let mut g = c.benchmark_group("copy_64MiB");
    g.throughput(Throughput::Bytes(BIG));
    g.sample_size(20);
    g.bench_function(BenchmarkId::new("plain d2d copy", BIG), |b| {
        b.iter(|| {
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.copy_device_to_device(stream, dst.ptr(), src.unordered_data_ptr(), BIG) }
                .unwrap();
            d.stream_synchronize(stream).unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("copy-materialize", BIG), |b| {
        b.iter_batched(
            || src.lazy_clone().unwrap(),
            |clone| {
                clone.unordered_mutable_data_ptr().unwrap();
                d.stream_synchronize(stream).unwrap();
                clone
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    targets = lazy_clone_and_steal, copy_materialize
}
criterion_main!(benches);
