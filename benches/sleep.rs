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
//!   beat), each copy's stream synchronized.
//!
//! It also prints the device's free memory before, during and after a sleep.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use cudalloc::{DeviceAddr, Driver, HostDriver, PinnedBuffer, Runtime, Storage};

const MIB: u64 = 1 << 20;
const STORAGES: u64 = 16;
const EACH: u64 = 64 * MIB;

fn runtime() -> Arc<Runtime> {
    let driver: Arc<dyn Driver> = Arc::new(
        HostDriver::builder()
            .devices(1)
            .memory_per_device(2 << 30)
            .poison_on_free(false)
            .build()
            .unwrap(),
    );
    Arc::new(Runtime::new(driver, Default::default()).unwrap())
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
    rt.wake_up(&[]).unwrap();
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
    let mut buffers: Vec<PinnedBuffer> = (0..STORAGES)
        .map(|_| rt.pinned(EACH as usize).unwrap())
        .collect();
    let mut g = c.benchmark_group("sleep_wake_1GiB");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(30))
        .throughput(Throughput::Bytes(tagged));
    g.bench_function("sleep+wake discard", |b| {
        b.iter(|| {
            rt.sleep(&[], &["weights"]).unwrap();
            rt.wake_up(&[]).unwrap();
        })
    });
    // Discarding left the bytes undefined: the offload and the copies start from the pattern.
    for (i, s) in weights.iter().enumerate() {
        s.fill_pattern(i as u64).unwrap();
    }
    g.bench_function("sleep+wake offload", |b| {
        b.iter(|| {
            rt.sleep(&["weights"], &[]).unwrap();
            rt.wake_up(&[]).unwrap();
        })
    });
    g.bench_function("two plain copies", |b| {
        b.iter(|| {
            for (s, buf) in weights.iter().zip(buffers.iter_mut()) {
                let src: DeviceAddr = s.data_ptr();
                // SAFETY: the copy writes the buffer's EACH bytes; the buffer is not borrowed
                // and the stream is synchronized before it is touched again.
                unsafe {
                    buf.enqueue_write(stream, 0..EACH as usize, |dst, n| {
                        driver.copy_device_to_pinned(stream, dst, src, n)
                    })
                    .unwrap();
                }
            }
            driver.stream_synchronize(stream).unwrap();
            for (s, buf) in weights.iter().zip(buffers.iter()) {
                let dst = s.data_ptr();
                // SAFETY: the copy reads the buffer's EACH bytes, written above and waited for.
                unsafe {
                    buf.enqueue_read(stream, 0..EACH as usize, |src, n| {
                        driver.copy_pinned_to_device(stream, dst, src, n)
                    })
                    .unwrap();
                }
            }
            driver.stream_synchronize(stream).unwrap();
        })
    });
    g.finish();
    for (i, s) in weights.iter().enumerate() {
        assert_eq!(s.count_pattern_mismatches(i as u64).unwrap(), 0);
    }
}

criterion_group!(benches, sleep_wake);
criterion_main!(benches);
