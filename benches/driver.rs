//! Host-backend driver costs, the floor under everything the allocator will do on a miss:
//! segment malloc+free (shared-memory object create/map/unlink), an event round trip through a
//! stream worker, and a 64 MiB device-to-device copy against a plain `memcpy` of the same size in the
//! same group (the baseline the COW copy-materialize target is measured against).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use cudalloc::backend::capability::Kernels;
use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use cudalloc::{backend::Driver, backend::EventFlags, backend::HostDriver};

fn driver() -> HostDriver {
    HostDriver::builder()
        .memory_per_device(1 << 30)
        .poison_on_free(false)
        .build()
        .unwrap()
}

fn segments(c: &mut Criterion) {
    let d = driver();
    let mut g = c.benchmark_group("segment_malloc_free");
    for size in [2u64 << 20, 20 << 20] {
        g.bench_with_input(BenchmarkId::new("host", size), &size, |b, &size| {
            b.iter(|| d.free(d.malloc(0, size).unwrap()).unwrap())
        });
    }
    g.finish();
}

fn events(c: &mut Criterion) {
    let d = driver();
    let s = d.stream_create(0).unwrap();
    let e = d
        .event_create(0, EventFlags { interprocess: true })
        .unwrap();
    let mut g = c.benchmark_group("event_round_trip");
    g.bench_function("host record+synchronize", |b| {
        b.iter(|| {
            d.event_record(e, s).unwrap();
            d.event_synchronize(e).unwrap();
        })
    });
    g.bench_function("host record+query (no wait)", |b| {
        b.iter(|| {
            d.event_record(e, s).unwrap();
            black_box(d.event_query(e).unwrap())
        })
    });
    g.finish();
    d.stream_synchronize(s).unwrap();
}

fn copies(c: &mut Criterion) {
    const LEN: u64 = 64 << 20;
    let d = driver();
    let s = d.stream_create(0).unwrap();
    let (src, dst) = (d.malloc(0, LEN).unwrap(), d.malloc(0, LEN).unwrap());
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe { d.fill_pattern(s, src, LEN, 1) }.unwrap();
    d.stream_synchronize(s).unwrap();
    let host_src = vec![1u8; LEN as usize];
    let mut host_dst = vec![0u8; LEN as usize];
    let mut g = c.benchmark_group("copy_64MiB");
    g.throughput(Throughput::Bytes(LEN));
    g.bench_function(BenchmarkId::new("host-driver d2d", LEN), |b| {
        b.iter(|| {
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe { d.copy_device_to_device(s, dst, src, LEN) }.unwrap();
            d.stream_synchronize(s).unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("memcpy", LEN), |b| {
        b.iter(|| {
            host_dst.copy_from_slice(black_box(&host_src));
            black_box(&host_dst);
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = segments, events, copies
}
criterion_main!(benches);
