//! Sleep and wake by tag (issue 26), side by side in one run, on 1 GiB of tagged memory of the
//! host backend (16 storages of 64 MiB):
//!
//! * `sleep+wake discard`: `Runtime::sleep(&[], &["weights"])` then `wake_up` — every page
//!   unmapped, released, created and mapped again, no copy (run first: it leaves the bytes
//!   undefined, and they are written again after it);
//! * `sleep+wake offload`: `Runtime::sleep(&["weights"], &[])` then `wake_up` — the same, with
//!   the bytes copied to pinned host memory and back;
//! * `two plain copies`: the same bytes copied device → pinned and pinned → device with the
//!   driver's async copies into pinned buffers made beforehand (the floor an offload cannot
//!   beat), each copy's stream synchronized;
//! * `copy out, free, allocate, copy in`: what a program does without sleep — the same bytes of 16
//!   storages of the default pool copied to pinned buffers, the storages dropped and the cache
//!   emptied (the memory back to the driver), 16 storages allocated afresh and the bytes copied
//!   back: the same copies plus the same physical-memory work as a sleep and a wake, without
//!   keeping the addresses.
//!
//! It also prints the device's free memory before, during and after a sleep. With
//! `CUDALLOC_BENCH_BACKEND=cuda` it runs on the CUDA backend (`scripts/gpu-check.sh` on a GPU).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use cudalloc::{
    backend::Driver, backend::HostDriver, pinned::PinnedBuffer, DeviceAddr, Runtime, Storage,
};

const MIB: u64 = 1 << 20;
const STORAGES: u64 = 16;
const EACH: u64 = 64 * MIB;

fn on_cuda() -> bool {
    std::env::var("CUDALLOC_BENCH_BACKEND").is_ok_and(|b| b == "cuda")
}

fn runtime() -> Arc<Runtime> {
    let driver: Arc<dyn Driver> = if on_cuda() {
        Arc::new(cudalloc::backend::CudaDriver::new().unwrap())
    } else {
        Arc::new(
            HostDriver::builder()
                .devices(1)
                .memory_per_device(3 << 30)
                .poison_on_free(false)
                .build()
                .unwrap(),
        )
    };
    Arc::new(Runtime::new(driver, Default::default()).unwrap())
}

/// `STORAGES` storages of `EACH` bytes of the default pool, each with its pattern.
fn plain_storages(rt: &Arc<Runtime>) -> Vec<Storage> {
    (0..STORAGES)
        .map(|i| {
            let s = Storage::new(rt, 0, EACH).unwrap();
            s.fill_pattern(i).unwrap();
            s
        })
        .collect()
}

fn free(rt: &Runtime) -> u64 {
    rt.driver().mem_info(0).unwrap().free
}

fn sleep_wake(c: &mut Criterion) {
    let rt = runtime();
    let weights: Vec<Storage> = {
        let _in = rt.use_tag("weights", 0).unwrap();
        (0..STORAGES)
            .map(|i| {
                let s = Storage::new(&rt, 0, EACH).unwrap();
                s.fill_pattern(i).unwrap();
                s
            })
            .collect()
    };
    let before = free(&rt);
    rt.sleep(&["weights"], &[]).unwrap();
    let during = free(&rt);
    rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
    let after = free(&rt);
    let tagged = STORAGES * EACH;
    eprintln!(
        "device free memory: before {} MiB, asleep {} MiB (+{} MiB = {:.2} % of the {} MiB tagged), after {} MiB",
        before / MIB,
        during / MIB,
        (during - before) / MIB,
        (during - before) as f64 * 100.0 / tagged as f64,
        tagged / MIB,
        after / MIB
    );

    let stream = rt.current_stream(0).unwrap();
    let driver = rt.driver().clone();
    let mut buffers: Vec<PinnedBuffer> = (0..STORAGES).map(|_| rt.pinned(EACH).unwrap()).collect();
    let mut g = c.benchmark_group("sleep_wake_1GiB");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(if on_cuda() { 10 } else { 30 }))
        .throughput(Throughput::Bytes(tagged));
    g.bench_function("sleep+wake discard", |b| {
        b.iter(|| {
            rt.sleep(&[], &["weights"]).unwrap();
            rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
        })
    });
    // Discarding left the bytes undefined: the offload and the copies start from the pattern.
    for (i, s) in weights.iter().enumerate() {
        s.fill_pattern(i as u64).unwrap();
    }
    g.bench_function("sleep+wake offload", |b| {
        b.iter(|| {
            rt.sleep(&["weights"], &[]).unwrap();
            rt.wake_up(&[], cudalloc::WakeOptions::default()).unwrap();
        })
    });
    g.bench_function("two plain copies", |b| {
        b.iter(|| {
            for (s, buf) in weights.iter().zip(buffers.iter_mut()) {
                let src: DeviceAddr = s.unordered_data_ptr();
                // SAFETY: the copy writes the buffer's EACH bytes; the buffer is not borrowed
                // and the stream is synchronized before it is touched again.
                unsafe {
                    buf.enqueue_write(stream, 0..EACH, |dst, n| {
                        driver.pinned().copy_device_to_pinned(stream, dst, src, n)
                    })
                    .unwrap();
                }
            }
            driver.stream_synchronize(stream).unwrap();
            for (s, buf) in weights.iter().zip(buffers.iter()) {
                let dst = s.unordered_data_ptr();
                // SAFETY: the copy reads the buffer's EACH bytes, written above and waited for.
                unsafe {
                    buf.enqueue_read(stream, 0..EACH, |src, n| {
                        driver.pinned().copy_pinned_to_device(stream, dst, src, n)
                    })
                    .unwrap();
                }
            }
            driver.stream_synchronize(stream).unwrap();
        })
    });
    let mut plain = plain_storages(&rt);
    g.bench_function("copy out, free, allocate, copy in", |b| {
        b.iter(|| {
            for (s, buf) in plain.iter().zip(buffers.iter_mut()) {
                s.copy_to_pinned(stream, 0, buf, 0, EACH).unwrap();
            }
            driver.stream_synchronize(stream).unwrap();
            plain.clear();
            rt.empty_cache();
            plain = (0..STORAGES)
                .map(|_| Storage::new(&rt, 0, EACH).unwrap())
                .collect();
            for (s, buf) in plain.iter().zip(buffers.iter()) {
                s.copy_from_pinned(stream, 0, buf, 0, EACH).unwrap();
            }
            driver.stream_synchronize(stream).unwrap();
        })
    });
    g.finish();
    for (i, s) in plain.iter().enumerate() {
        assert_eq!(s.count_pattern_mismatches(i as u64).unwrap(), 0);
    }
    for (i, s) in weights.iter().enumerate() {
        assert_eq!(s.count_pattern_mismatches(i as u64).unwrap(), 0);
    }
}

criterion_group!(benches, sleep_wake);
criterion_main!(benches);
