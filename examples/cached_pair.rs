//! The cached pair in a loop, for counting instructions (`scripts/pair-instructions.sh` runs it
//! under callgrind at two loop lengths and prints the difference per pair, so set-up cancels).
//!
//! ```text
//! cargo run --release --no-default-features --example cached_pair -- 10000 512 [config]
//! ```
//!
//! The optional third argument is a `CUDALLOC_CONF` string (`thread_cache_mb:64` counts the pair
//! with a thread front cache).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

fn main() {
    let mut args = std::env::args().skip(1);
    let pairs: usize = args.next().map_or(10_000, |a| a.parse().expect("pairs"));
    let size: u64 = args
        .next()
        .map_or(512, |a| a.parse().expect("size in bytes"));
    let driver = Arc::new(
        cudalloc::backend::HostDriver::builder()
            .devices(1)
            .memory_per_device(1 << 30)
            .build()
            .expect("host driver"),
    );
    let config =
        cudalloc::AllocatorConfig::parse(&args.next().unwrap_or_default()).expect("config");
    let runtime = cudalloc::Runtime::builder()
        .config(config)
        .build(driver)
        .expect("runtime");
    let stream = runtime.default_stream(0).expect("default stream");
    for _ in 0..pairs {
        let data = runtime.allocate_on(stream, size).expect("allocation");
        std::hint::black_box(&data);
        drop(data);
    }
}
