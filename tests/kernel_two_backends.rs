//! One kernel, two backends (issue 47): a library op declared once — a host body and, with
//! feature `cudarc`, a CUDA body (`kernels/pattern.cu`'s fill, compiled with NVRTC) — launched
//! through `Runtime::launch`, the one door that orders, checks and tells the sanitizer. The same
//! tests run on the host backend (`cargo test`) and on CUDA (`CUDALLOC_BACKEND=cuda` with
//! `--features cudarc`: the contract double in `scripts/cuda-double.sh`, or a GPU).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::internals::pattern;
use cudalloc::kernel::Kernel;
use cudalloc::sanitizer::{HazardKind, Sanitize, SanitizeOptions};
use cudalloc::{AllocatorConfig, ErrorKind, Runtime, Storage};

const LEN: u64 = (1 << 20) + 13;

/// The fill op of a tensor library: every byte of the operand becomes the pattern of `seed`.
fn fill(seed: u64) -> Kernel<impl Fn(&mut [u8]) -> cudalloc::Result<()> + Send + Sync + 'static> {
    let kernel = Kernel::new("fill", move |x: &mut [u8]| {
        pattern::fill(x, seed, 0);
        Ok(())
    });
    with_cuda_body(kernel, seed)
}

#[cfg(feature = "cudarc")]
fn with_cuda_body<F>(kernel: Kernel<F>, seed: u64) -> Kernel<F> {
    use cudalloc::cudarc::driver::CudaContext;
    use cudalloc::cudarc::nvrtc;
    use cudalloc::kernel::{CudaBody, Param};
    if !cuda_suite() {
        return kernel;
    }
    let ptx = nvrtc::compile_ptx(include_str!("../kernels/pattern.cu")).unwrap();
    let module = CudaContext::new(0).unwrap().load_module(ptx).unwrap();
    let function = module.load_function("cudalloc_fill_pattern").unwrap();
    let body =
        CudaBody::new(function).params([Param::Operand(0), Param::Bytes(0), Param::U64(seed)]);
    // SAFETY: `cudalloc_fill_pattern(unsigned char *dst, unsigned long long len, unsigned long
    // long seed)` writes the `len` bytes at `dst`: the operand's.
    unsafe { kernel.with_cuda(body) }
}

#[cfg(not(feature = "cudarc"))]
fn with_cuda_body<F>(kernel: Kernel<F>, _seed: u64) -> Kernel<F> {
    assert!(
        !cuda_suite(),
        "a CUDA run of this suite needs --features cudarc (its CUDA body is a cudarc function)"
    );
    kernel
}

fn runtime(conf: &str, sanitize: Sanitize) -> Arc<Runtime> {
    Arc::new(
        Runtime::builder()
            .config(AllocatorConfig::parse(&with_test_settings(conf)).unwrap())
            .sanitize(sanitize)
            .check_invariants(true)
            .build(test_driver_unchecked())
            .unwrap(),
    )
}

#[test]
fn one_kernel_runs_on_the_host_and_on_the_cuda_double() {
    let _device = device_shared();
    let rt = runtime("", Sanitize::On(SanitizeOptions::report()));
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    for seed in 0..8u64 {
        let x = Storage::new_on(&rt, a, LEN).unwrap();
        rt.launch(a, x.writes::<u8>(), &fill(seed)).unwrap();
        // A lazy clone written by the op on another stream: the copy and the wait are the
        // door's; the source keeps its bytes.
        let c = x.lazy_clone().unwrap();
        rt.launch(b, c.writes::<u8>().elements(0..4096), &fill(seed + 100))
            .unwrap();
        rt.driver().stream_synchronize(b).unwrap();
        assert_eq!(x.count_pattern_mismatches(seed).unwrap(), 0, "seed {seed}");
        let mut head = vec![0u8; 4096];
        c.copy_to_host(b, 0, &mut head).unwrap();
        assert_eq!(pattern::count_mismatches(&head, seed + 100), 0);
    }
    let reports = rt.sanitizer().unwrap().take_reports();
    assert!(reports.is_empty(), "{reports:#?}");
}

/// The sanitizer sees the launch's operands on either backend: under `manual`, the op writing on
/// `b` what `a` still writes, with no wait, is a race naming the launch.
#[test]
fn the_sanitizer_sees_the_operands_of_a_launch() {
    let _device = device_shared();
    let rt = runtime(
        "stream_order:manual",
        Sanitize::On(SanitizeOptions::report()),
    );
    let (a, b) = (rt.create_stream(0).unwrap(), rt.create_stream(0).unwrap());
    let x = Storage::new_on(&rt, a, LEN).unwrap();
    rt.launch(a, x.writes::<u8>(), &fill(1)).unwrap();
    let err = rt.launch(b, x.writes::<u8>(), &fill(2)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
    let reports = rt.sanitizer().unwrap().take_reports();
    assert_eq!(reports.len(), 1, "{reports:#?}");
    assert_eq!(reports[0].kind, HazardKind::Race);
    rt.driver().stream_synchronize(a).unwrap();
}

/// A kernel with no body for the runtime's backend is an error naming it; the door's checks are
/// the host kernels' (here: a range past the end).
#[test]
fn the_door_refuses_before_anything_runs() {
    let _device = device_shared();
    let rt = runtime("", Sanitize::Off);
    let s = rt.create_stream(0).unwrap();
    let x = Storage::new_on(&rt, s, 64).unwrap();
    let err = rt
        .launch(s, x.writes::<u8>().elements(0..65), &fill(3))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    if cuda_suite() {
        let host_only = Kernel::new("host_only", |_: &mut [u8]| Ok(()));
        let err = rt.launch(s, x.writes::<u8>(), &host_only).unwrap_err();
        assert!(
            err.to_string().contains("host_only has no CUDA body"),
            "{err}"
        );
    }
}
