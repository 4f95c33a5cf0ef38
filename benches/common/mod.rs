//! Helpers shared by the benchmarks.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudalloc::{backend::CudaDriver, backend::Driver, backend::HostDriver, Runtime, StreamId};

/// The driver the benchmarks run on: a host driver of `capacity` bytes that does not poison freed
/// segments (memory is only committed when touched; the benchmarks measure the allocator, not
/// memset), or the CUDA driver when `CUDALLOC_BENCH_BACKEND=cuda` (used by `scripts/gpu-check.sh`).
pub(crate) fn bench_driver(capacity: u64) -> Arc<dyn Driver> {
    if std::env::var("CUDALLOC_BENCH_BACKEND").as_deref() == Ok("cuda") {
        return Arc::new(CudaDriver::new().unwrap());
    }
    let driver = HostDriver::builder()
        .memory_per_device(capacity)
        .poison_on_free(false)
        .build()
        .unwrap();
    Arc::new(driver)
}

/// A caching allocator over [`bench_driver`].
pub(crate) fn pinned_allocator(capacity: u64) -> Arc<Runtime> {
    Arc::new(Runtime::new(bench_driver(capacity), Default::default()).unwrap())
}

/// Time for one thread per entry of `streams` (on that stream) to do `pairs` cached 4 KiB pairs
/// each: from the first thread's start to the last one's end, as the threads saw them. The main
/// thread may not even be scheduled while two workers hold both cores of a small machine, so it
/// cannot time them; and the threads start on a spinning line, because a sleeping barrier wakes
/// them milliseconds apart there, which a 30 ms run would count as lost scaling.
pub(crate) fn time_threads(a: &Arc<Runtime>, streams: &[StreamId], pairs: u64) -> Duration {
    let arrived = Arc::new(AtomicUsize::new(0));
    let n = streams.len();
    let handles: Vec<_> = streams
        .iter()
        .map(|&s| {
            let (a, arrived) = (a.clone(), arrived.clone());
            std::thread::spawn(move || {
                drop(a.allocate_on(s, 4096).unwrap()); // warm this thread's path
                arrived.fetch_add(1, Ordering::SeqCst);
                while arrived.load(Ordering::SeqCst) < n {
                    std::hint::spin_loop();
                }
                let start = Instant::now();
                for _ in 0..pairs {
                    std::hint::black_box(a.allocate_on(s, 4096).unwrap());
                }
                (start, Instant::now())
            })
        })
        .collect();
    let spans: Vec<(Instant, Instant)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let first = spans.iter().map(|s| s.0).min().unwrap();
    let last = spans.iter().map(|s| s.1).max().unwrap();
    last - first
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of `hex`'s text (the peer of a benchmark's child process).
pub(crate) fn unhex(text: &str) -> Vec<u8> {
    (0..text.len() / 2)
        .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// One step of the RMM trace: `Some(size)` to allocate, `None` to free the live allocation at
/// `victim % live`.
pub(crate) fn rmm_trace(max: u64, n: usize) -> Vec<(Option<u64>, u64)> {
    let mut out = Vec::with_capacity(n);
    let mut live_bytes = Vec::new();
    let mut total = 0u64;
    for i in 0..n as u64 {
        let r = cudalloc::internals::pattern::word(0x5EED, i);
        let size = 1 + cudalloc::internals::pattern::word(0xB17E, i) % max;
        let allocate = (r % 100) < 73 || live_bytes.is_empty();
        if allocate && total + size <= 1 << 30 {
            live_bytes.push(size);
            total += size;
            out.push((Some(size), 0));
        } else if !live_bytes.is_empty() {
            let victim = cudalloc::internals::pattern::word(0xF4EE, i);
            let idx = (victim % live_bytes.len() as u64) as usize;
            total -= live_bytes.swap_remove(idx);
            out.push((None, victim));
        }
    }
    out
}
