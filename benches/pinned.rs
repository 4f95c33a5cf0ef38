//! The pinned host allocator (issue 25), side by side in one run:
//!
//! * a cached pinned pair (`PinnedAllocator::allocate` + drop of the buffer, the block reused from
//!   its size class) against an uncached page-locked allocation (the driver's `host_alloc` +
//!   `host_free`: a mapping locked with `mlock` on the host backend, `cuMemHostAlloc` on CUDA)
//!   and against glibc (`malloc` + `free` of the same size);
//! * a 4 MiB host-to-device copy from pinned memory (enqueued, then the stream synchronized)
//!   against the same copy from pageable memory (staged and waited for, as CUDA does).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use cudalloc::backend::capability::PinnedHost;
use std::alloc::Layout;
use std::sync::Arc;
use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use cudalloc::{
    backend::Driver, backend::HostDriver, pinned::PinnedAllocator, pinned::PinnedOptions,
};

fn driver() -> Arc<HostDriver> {
    Arc::new(
        HostDriver::builder()
            .memory_per_device(1 << 30)
            .poison_on_free(false)
            .build()
            .unwrap(),
    )
}

fn pairs(c: &mut Criterion) {
    let d = driver();
    let alloc = PinnedAllocator::new(d.clone(), PinnedOptions::default());
    let mut g = c.benchmark_group("pinned_pair");
    for size in [4096u64, 64 << 10, 1 << 20] {
        drop(alloc.allocate(size).unwrap());
        g.bench_with_input(BenchmarkId::new("cached", size), &size, |b, &size| {
            b.iter(|| drop(black_box(alloc.allocate(size).unwrap())))
        });
        g.bench_with_input(
            BenchmarkId::new("uncached page-locked", size),
            &size,
            |b, &size| {
                b.iter(|| {
                    let ptr = d.host_alloc(size).unwrap();
                    // SAFETY: nothing references the memory just allocated.
                    let freed = unsafe { d.host_free(black_box(ptr)) };
                    freed.unwrap()
                })
            },
        );
        let layout = Layout::from_size_align(size as usize, 64).unwrap();
        g.bench_with_input(
            BenchmarkId::new("glibc malloc", size),
            &layout,
            |b, &layout| {
                b.iter(|| {
                    // SAFETY: a non-zero layout; the pointer is freed with the same layout.
                    unsafe {
                        let p = std::alloc::alloc(layout);
                        assert!(!p.is_null());
                        std::alloc::dealloc(black_box(p), layout);
                    }
                })
            },
        );
    }
    g.finish();
}

fn copies(c: &mut Criterion) {
    const LEN: u64 = 4 << 20;
    let d = driver();
    let alloc = PinnedAllocator::new(d.clone(), PinnedOptions::default());
    let s = d.stream_create(0).unwrap();
    let dst = d.malloc(0, LEN).unwrap();
    let mut pinned = alloc.allocate(LEN).unwrap();
    pinned.as_mut_slice().unwrap().fill(7);
    let pageable = vec![7u8; LEN as usize];
    let mut g = c.benchmark_group("host_to_device_4MiB");
    g.throughput(Throughput::Bytes(LEN));
    g.bench_function("from pinned (enqueued, then synchronized)", |b| {
        b.iter(|| {
            // SAFETY: nothing borrows the buffer while the copy runs (synchronized below).
            let copied = unsafe { d.copy_pinned_to_device(s, dst, pinned.addr(), LEN) };
            copied.unwrap();
            d.stream_synchronize(s).unwrap();
        })
    });
    g.bench_function("from pageable (staged, waited for)", |b| {
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        b.iter(|| unsafe { d.copy_host_to_device(s, dst, black_box(&pageable)) }.unwrap())
    });
    g.finish();
    d.free(dst).unwrap();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = pairs, copies
}
criterion_main!(benches);
