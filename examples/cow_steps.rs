//! The copy-on-write steps in a loop, for counting instructions under callgrind (run at two loop
//! lengths and take the difference per iteration, so set-up cancels; `scripts/pair-instructions.sh`
//! does it for the cached pair):
//!
//! * `clone` — `lazy_clone` of a storage that is already copy-on-write, and the clone's drop;
//! * `prepare` — a fresh storage made copy-on-write by a lazy clone that is dropped at once, then
//!   the storage dropped (what `steal` does around the steal);
//! * `steal` — the same with the steal in between: the last reference's first write takes the
//!   memory back (`mutable_data_ptr`), no copy.
//!
//! ```text
//! cargo run --release --no-default-features --example cow_steps -- steal 10000
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use cudalloc::Storage;

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().expect("clone, prepare or steal");
    let n: usize = args
        .next()
        .map_or(10_000, |a| a.parse().expect("iterations"));
    let driver = Arc::new(
        cudalloc::backend::HostDriver::builder()
            .devices(1)
            .memory_per_device(1 << 30)
            .build()
            .expect("host driver"),
    );
    let runtime = Arc::new(cudalloc::Runtime::builder().build(driver).expect("runtime"));
    let cow = Storage::new(&runtime, 0, 4096).expect("storage");
    let _keep = cow.lazy_clone().expect("lazy clone");
    for _ in 0..n {
        match mode.as_str() {
            "clone" => drop(std::hint::black_box(cow.lazy_clone().expect("lazy clone"))),
            "prepare" | "steal" => {
                let fresh = Storage::new(&runtime, 0, 4096).expect("storage");
                drop(fresh.lazy_clone().expect("lazy clone"));
                if mode == "steal" {
                    std::hint::black_box(fresh.unordered_mutable_data_ptr().expect("steal"));
                }
                drop(fresh);
            }
            other => panic!("unknown mode {other}"),
        }
    }
}
