//! Helpers shared by the benchmarks.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use cudalloc::{CudaDriver, Driver, HostDriver, Runtime};

/// The driver the benchmarks run on: a host driver of `capacity` bytes that does not poison freed
/// segments (memory is only committed when touched; the benchmarks measure the allocator, not
/// memset), or the CUDA driver when `CUDALLOC_BENCH_BACKEND=cuda` (used by `scripts/gpu-check.sh`).
pub fn bench_driver(capacity: u64) -> Arc<dyn Driver> {
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
pub fn host_allocator(capacity: u64) -> Arc<Runtime> {
    Arc::new(Runtime::new(bench_driver(capacity), Default::default()).unwrap())
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
