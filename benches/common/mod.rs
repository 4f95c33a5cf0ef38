//! Helpers shared by the benchmarks.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use cudalloc::{CachingAllocator, HostDriver};

/// A caching allocator over a host driver of `capacity` bytes that does not poison freed segments
/// (memory is only committed when touched; the benchmarks measure the allocator, not memset).
pub fn host_allocator(capacity: u64) -> Arc<CachingAllocator> {
    let driver = HostDriver::builder()
        .memory_per_device(capacity)
        .poison_on_free(false)
        .build()
        .unwrap();
    Arc::new(CachingAllocator::new(Arc::new(driver), Default::default()).unwrap())
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
