//! A launch through a storage's typed view against a raw cudarc launch (issue 48): the same
//! kernel (`kernels/poison.cu`, 4 KiB), 64 launches on one cudarc stream and one synchronize per
//! iteration — on one side a `CudaSlice` cudarc allocated, on the other a view of a cudalloc
//! storage taken per launch (ordered, checked, told to the sanitizer when one runs). Needs the
//! CUDA backend (a GPU, or the contract double): prints that it was skipped otherwise.
//!
//! ```text
//! cargo bench --features cudarc --bench view_launch
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use cudalloc::backend::CudaDriver;
use cudalloc::cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudalloc::cudarc::nvrtc;
use cudalloc::{Runtime, Storage};

const LAUNCHES: usize = 64;
const BYTES: usize = 4096;

fn view_launch(c: &mut Criterion) {
    let driver = match CudaDriver::new() {
        Ok(d) => d,
        Err(err) => {
            println!("view_launch: skipped: no CUDA driver ({err})");
            return;
        }
    };
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let source = cudalloc::internals::kernels::SOURCES
        .iter()
        .find(|(f, _)| *f == "poison.cu")
        .unwrap()
        .1;
    let poison = ctx
        .load_module(nvrtc::compile_ptx(source).unwrap())
        .unwrap()
        .load_function("cudalloc_poison")
        .unwrap();
    let runtime = Arc::new(Runtime::builder().build(Arc::new(driver)).unwrap());
    let storage = Storage::new(&runtime, 0, BYTES as u64).unwrap();
    let mut raw = stream.alloc_zeros::<u8>(BYTES).unwrap();
    let len = BYTES as u64;
    let config = LaunchConfig::for_num_elems(BYTES as u32);

    let mut g = c.benchmark_group("view_launch_4KiB");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("raw cudarc (CudaSlice)", |b| {
        b.iter(|| {
            for _ in 0..LAUNCHES {
                let mut launch = stream.launch_builder(&poison);
                launch.arg(&mut raw).arg(&len);
                // SAFETY: the kernel takes (u8*, u64) and writes `len` bytes of the slice.
                unsafe { launch.launch(config) }.unwrap();
            }
            stream.synchronize().unwrap();
        })
    });
    g.bench_function("storage view (view_mut per launch)", |b| {
        b.iter(|| {
            for _ in 0..LAUNCHES {
                let mut view = storage.view_mut::<u8>(0..BYTES, &stream).unwrap();
                let mut launch = stream.launch_builder(&poison);
                launch.arg(&mut view).arg(&len);
                // SAFETY: as above, on the view's bytes.
                unsafe { launch.launch(config) }.unwrap();
            }
            stream.synchronize().unwrap();
        })
    });
    g.finish();
}

criterion_group!(benches, view_launch);
criterion_main!(benches);
