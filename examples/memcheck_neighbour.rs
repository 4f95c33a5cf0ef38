//! A planted bug for NVIDIA's compute-sanitizer: a kernel writes past its 512-byte tensor into the
//! next block of the same cached segment — "valid memory" to memcheck unless the allocator tells
//! it where its blocks are (`nvtx_regions:True` and `--nvtx yes`).
//!
//! ```text
//! CUDALLOC_BACKEND=cuda CUDALLOC_CONF=nvtx_regions:True \
//!   compute-sanitizer --tool memcheck --nvtx yes target/release/examples/memcheck_neighbour
//! ```
//!
//! `scripts/gpu-check.sh` runs it three ways and expects memcheck to report the write with NVTX
//! regions and not without them. On the host backend (CI) it runs as a program: the write lands
//! in the neighbour, whose first bytes it prints.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use cudalloc::backend::BackendChoice;
use cudalloc::{AllocatorConfig, Result, Runtime, Storage};

fn main() -> Result<()> {
    let driver = BackendChoice::from_env()?.open()?.driver;
    let config = AllocatorConfig::from_env()?;
    let runtime = Arc::new(
        Runtime::builder()
            .config(config.clone())
            .build(Arc::clone(&driver))?,
    );
    let stream = runtime.default_stream(0)?;
    let tensor = Storage::new_on(&runtime, stream, 512)?;
    let neighbour = Storage::new_on(&runtime, stream, 512)?;
    neighbour.copy_from_host(stream, 0, &[0u8; 512])?;
    let at = tensor.mutable_data_ptr_on(stream)?;
    let next = neighbour.data_ptr_on(stream)?;
    println!(
        "tensor at {:#x}, its neighbour at {:#x} ({} bytes from it; pass_through: {}, nvtx_regions: {})",
        at.0,
        next.0,
        next.0 as i128 - at.0 as i128,
        config.pass_through,
        config.nvtx_regions
    );
    // The bug: 1,024 bytes written from the tensor's start, 512 of them past its end.
    // SAFETY: both storages are live and ordered on `stream`; the write is the planted bug.
    if let Err(err) = unsafe { driver.kernels().poison(stream, at, 1024) } {
        // The host backend checks a launch's range against its segment: with nothing cached
        // (pass_through) the tensor is a segment of its own.
        println!("the driver refused the write: {err}");
        return Ok(());
    }
    runtime.synchronize(stream)?;
    let mut head = [0u8; 4];
    neighbour.copy_to_host(stream, 0, &mut head)?;
    runtime.synchronize(stream)?;
    println!("the neighbour's first bytes now: {head:02x?}");
    Ok(())
}
