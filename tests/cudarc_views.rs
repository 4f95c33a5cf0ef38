//! Storages as cudarc kernel arguments (feature `cudarc`): a tensor library's own context and
//! stream, a kernel it loads and launches through cudarc on a view of a cudalloc storage, and the
//! view's stream recorded for the storage. Runs on the CUDA backend (a GPU, or the contract double
//! in `scripts/cuda-double.sh`); on a machine without CUDA the launch tests print their skip line.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudalloc::cudarc::nvrtc;
use cudalloc::{backend::CudaDriver, ErrorKind, Runtime, Storage};

const MIB: u64 = 1 << 20;

/// The library's context and stream, and a runtime over the CUDA backend — or `None` (skip line).
fn library(
    test: &str,
) -> Option<(
    Arc<CudaContext>,
    Arc<cudalloc::cudarc::driver::CudaStream>,
    Arc<Runtime>,
)> {
    let driver = match CudaDriver::new() {
        Ok(d) => d,
        Err(err) => {
            println!("{test}: skipped: no CUDA driver ({err})");
            return None;
        }
    };
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let runtime = Arc::new(Runtime::builder().build(Arc::new(driver)).unwrap());
    Some((ctx, stream, runtime))
}

/// Waits for the library's stream through cudalloc's driver: what the stream sanitizer sees
/// (cudarc's own `CudaStream::synchronize` is invisible to it; see `driver::sanitizer`).
fn synchronize(runtime: &Runtime, stream: &cudalloc::cudarc::driver::CudaStream) {
    // SAFETY: `stream` is a live stream of device 0's primary context.
    let id = unsafe { runtime.import_stream(0, stream.cu_stream() as usize as u64) }.unwrap();
    runtime.driver().stream_synchronize(id).unwrap();
}

fn kernel(
    ctx: &Arc<CudaContext>,
    file: &str,
    name: &str,
) -> cudalloc::cudarc::driver::CudaFunction {
    let source = cudalloc::internals::kernels::SOURCES
        .iter()
        .find(|(f, _)| *f == file)
        .unwrap()
        .1;
    let ptx = nvrtc::compile_ptx(source).unwrap();
    ctx.load_module(ptx).unwrap().load_function(name).unwrap()
}

#[test]
fn a_kernel_launched_through_cudarc_on_a_view_writes_the_storage() {
    let Some((ctx, stream, runtime)) = library("a_kernel_launched_through_cudarc_on_a_view") else {
        return;
    };
    let fill = kernel(&ctx, "pattern.cu", "cudalloc_fill_pattern");
    let s = Storage::new(&runtime, 0, 4 * MIB).unwrap();
    let n = (4 * MIB) as usize;
    let mut view = s.view_mut::<u8>(0..n, &stream).unwrap();
    let (len, seed) = (n as u64, 7u64);
    let mut launch = stream.launch_builder(&fill);
    launch.arg(&mut view).arg(&len).arg(&seed);
    // SAFETY: the kernel takes (u8*, u64, u64) and writes `len` bytes of the view.
    unsafe { launch.launch(LaunchConfig::for_num_elems(256 * 64)) }.unwrap();
    synchronize(&runtime, &stream);
    drop(view);
    assert_eq!(s.count_pattern_mismatches(7).unwrap(), 0);
    // A read view of the second MiB as u64s: the kernel's argument is its first element.
    let view = s.view::<u64>(131_072..262_144, &stream).unwrap();
    assert_eq!(cudalloc::cudarc::driver::DeviceSlice::len(&view), 131_072);
}

#[test]
fn a_view_mut_of_a_lazy_clone_writes_a_private_copy() {
    let Some((ctx, stream, runtime)) = library("a_view_mut_of_a_lazy_clone") else {
        return;
    };
    let fill = kernel(&ctx, "pattern.cu", "cudalloc_fill_pattern");
    let original = Storage::new(&runtime, 0, MIB).unwrap();
    original.fill_pattern(1).unwrap();
    let clone = original.lazy_clone().unwrap();
    let mut view = clone.view_mut::<u8>(0..MIB as usize, &stream).unwrap();
    let (len, seed) = (MIB, 2u64);
    let mut launch = stream.launch_builder(&fill);
    launch.arg(&mut view).arg(&len).arg(&seed);
    // SAFETY: as above.
    unsafe { launch.launch(LaunchConfig::for_num_elems(1024)) }.unwrap();
    synchronize(&runtime, &stream);
    drop(view);
    assert_eq!(clone.count_pattern_mismatches(2).unwrap(), 0);
    assert_eq!(
        original.count_pattern_mismatches(1).unwrap(),
        0,
        "the original is untouched"
    );
}

#[test]
fn a_storage_freed_while_its_view_stream_is_busy_is_not_reused_until_that_work_is_done() {
    let Some((ctx, stream, runtime)) = library("a_storage_freed_while_its_view_stream_is_busy")
    else {
        return;
    };
    let sleep = kernel(&ctx, "sleep.cu", "cudalloc_sleep");
    let s = Storage::new(&runtime, 0, 4 * MIB).unwrap();
    let addr = s.unordered_data_ptr();
    let view = s.view::<u8>(0..(4 * MIB) as usize, &stream).unwrap();
    let nanos = 300_000_000u64;
    let mut launch = stream.launch_builder(&sleep);
    launch.arg(&nanos);
    // SAFETY: the sleep kernel takes one u64.
    unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
    drop(view);
    drop(s);
    // Without the view's stream recorded, this would be the same block at once.
    let again = Storage::new(&runtime, 0, 4 * MIB).unwrap();
    assert_ne!(
        again.unordered_data_ptr(),
        addr,
        "memory still in use by the library's stream was reused"
    );
    synchronize(&runtime, &stream);
}

#[test]
fn views_check_bounds_alignment_and_backend() {
    let host = Arc::new(Runtime::builder().build(Arc::new(host_driver())).unwrap());
    let on_host = Storage::new(&host, 0, MIB).unwrap();
    if let Some((_, stream, runtime)) = library("views_check_bounds_alignment_and_backend") {
        let err = on_host.view::<u8>(0..16, &stream).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.to_string().contains("CUDA backend"), "{err}");
        let s = Storage::new(&runtime, 0, MIB).unwrap();
        for err in [
            s.view::<u32>(0..(MIB as usize / 4 + 1), &stream)
                .unwrap_err(),
            #[allow(clippy::reversed_empty_ranges)]
            s.view::<u8>(8..4, &stream).unwrap_err(),
        ] {
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        }
        let offset = Storage::new(&runtime, 0, MIB).unwrap();
        assert!(offset.view::<u64>(0..8, &stream).is_ok());
    }
}

#[test]
fn a_view_of_expandable_memory_spans_its_pages() {
    let Some((ctx, stream, _)) = library("a_view_of_expandable_memory_spans_its_pages") else {
        return;
    };
    let runtime = Arc::new(
        Runtime::builder()
            .config(cudalloc::AllocatorConfig::parse("expandable_segments:True").unwrap())
            .build(Arc::new(CudaDriver::new().unwrap()))
            .unwrap(),
    );
    let fill = kernel(&ctx, "pattern.cu", "cudalloc_fill_pattern");
    // 1 MiB first, so the 5 MiB storage starts inside a page and crosses three page boundaries.
    let _before = Storage::new(&runtime, 0, MIB).unwrap();
    let s = Storage::new(&runtime, 0, 5 * MIB).unwrap();
    let n = (5 * MIB) as usize;
    let mut view = s.view_mut::<u8>(0..n, &stream).unwrap();
    let (len, seed) = (n as u64, 11u64);
    let mut launch = stream.launch_builder(&fill);
    launch.arg(&mut view).arg(&len).arg(&seed);
    // SAFETY: the kernel takes (u8*, u64, u64) and writes `len` bytes of the view.
    unsafe { launch.launch(LaunchConfig::for_num_elems(256 * 64)) }.unwrap();
    synchronize(&runtime, &stream);
    drop(view);
    assert_eq!(s.count_pattern_mismatches(11).unwrap(), 0);
}

#[test]
fn importing_one_raw_stream_twice_gives_one_stream_id() {
    let Some((_ctx, stream, runtime)) = library("importing_one_raw_stream_twice") else {
        return;
    };
    let raw = stream.cu_stream() as usize as u64;
    // SAFETY: `stream` is a live stream of device 0's primary context, kept alive below.
    let (a, b) = unsafe {
        (
            runtime.import_stream(0, raw).unwrap(),
            runtime.import_stream(0, raw).unwrap(),
        )
    };
    assert_eq!(
        a, b,
        "one raw stream, one id (one shard, one sanitizer clock)"
    );
    // The legacy stream imported by its raw handle (null) is the driver's default stream.
    // SAFETY: the null stream is always valid.
    let legacy = unsafe { runtime.import_stream(0, 0) }.unwrap();
    assert_eq!(legacy, runtime.driver().default_stream(0).unwrap());
    drop(stream);
}

#[test]
fn device_ptr_on_another_stream_orders_it_after_the_views_stream() {
    let Some((ctx, stream, _)) = library("device_ptr_on_another_stream") else {
        return;
    };
    use cudalloc::cudarc::driver::DevicePtr;
    let runtime = Arc::new(
        Runtime::builder()
            .sanitize(cudalloc::sanitizer::Sanitize::On(
                cudalloc::sanitizer::SanitizeOptions::default(),
            ))
            .build(Arc::new(CudaDriver::new().unwrap()))
            .unwrap(),
    );
    let fill = kernel(&ctx, "pattern.cu", "cudalloc_fill_pattern");
    let other = ctx.new_stream().unwrap();
    let s = Storage::new(&runtime, 0, MIB).unwrap();
    let n = MIB as usize;
    let mut view = s.view_mut::<u8>(0..n, &stream).unwrap();
    let (len, seed) = (MIB, 11u64);
    let mut launch = stream.launch_builder(&fill);
    launch.arg(&mut view).arg(&len).arg(&seed);
    // SAFETY: the kernel takes (u8*, u64, u64) and writes `len` bytes of the view.
    unsafe { launch.launch(LaunchConfig::for_num_elems(1024)) }.unwrap();
    drop(view);
    // A read on `other` through device_ptr: `other` waits for the view's stream first.
    let view = s.view::<u8>(0..n, &stream).unwrap();
    let (ptr, _sync) = view.device_ptr(&other);
    // SAFETY: `other` is live and kept alive until the end of the test.
    let other_id = unsafe { runtime.import_stream(0, other.cu_stream() as usize as u64) }.unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    let bad = unsafe {
        runtime.driver().kernels().count_pattern_mismatches(
            other_id,
            cudalloc::DeviceAddr(ptr),
            MIB,
            seed,
        )
    }
    .unwrap();
    assert_eq!(bad, 0, "the read on the other stream saw the fill");
    let reports = runtime.sanitizer().unwrap().take_reports();
    assert!(reports.is_empty(), "{reports:#?}");
}

/// A library captures its own stream with cudarc (`CudaStream::begin_capture`, `end_capture`,
/// `CudaGraph`) and tells the allocator (`route_capture`): a storage allocated inside the capture
/// comes from the graph's private pool, a kernel launched through cudarc on a view of it is
/// captured, and every replay rewrites it at the same address — also after eager work reused
/// none of the pool's memory.
#[test]
fn a_cudarc_graph_captures_a_kernel_on_a_storage_allocated_inside_it() {
    use cudalloc::cudarc::driver::sys;
    let Some((ctx, stream, runtime)) = library("a_cudarc_graph_captures_a_kernel") else {
        return;
    };
    let fill = kernel(&ctx, "pattern.cu", "cudalloc_fill_pattern");
    // SAFETY: a live stream of device 0's primary context.
    let id = unsafe { runtime.import_stream(0, stream.cu_stream() as usize as u64) }.unwrap();
    // The storages' own work (fill, count) on the library's stream, in order with its replays.
    let _on = runtime.set_current_stream(id).unwrap();
    let n = MIB as usize;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let mut route = runtime.route_capture(id, None).unwrap();
    let out = Storage::new_on(&runtime, id, MIB).unwrap();
    {
        let mut view = out.view_mut::<u8>(0..n, &stream).unwrap();
        let (len, seed) = (n as u64, 5u64);
        let mut launch = stream.launch_builder(&fill);
        launch.arg(&mut view).arg(&len).arg(&seed);
        // SAFETY: the kernel takes (u8*, u64, u64) and writes `len` bytes of the view.
        unsafe { launch.launch(LaunchConfig::for_num_elems(256 * 64)) }.unwrap();
    }
    let err = route.finish().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamCapture, "{err}");
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    let pool = route.finish().unwrap();
    let in_pool = |p: &Storage| {
        runtime.snapshot().segments.iter().any(|s| {
            s.segment_pool_id == pool.pool().id()
                && s.blocks.iter().any(|b| {
                    b.addr <= p.unordered_data_ptr().0 && p.unordered_data_ptr().0 < b.addr + b.size
                })
        })
    };
    assert!(in_pool(&out), "the storage came from the graph's pool");
    for round in 0..3 {
        out.fill_pattern(1).unwrap();
        let eager = Storage::new_on(&runtime, id, MIB).unwrap();
        assert!(
            !in_pool(&eager),
            "round {round}: eager work got the graph's memory"
        );
        graph.launch().unwrap();
        synchronize(&runtime, &stream);
        assert_eq!(out.count_pattern_mismatches(5).unwrap(), 0, "round {round}");
    }
    drop((graph, out, pool));
}

/// A cudarc stream adopted without `unsafe` (issue 47): the same id each time, usable at every
/// door after the library dropped its handle (cudalloc keeps it alive); cudarc's errors become
/// cudalloc's with their code, so `?` works in a library's cudarc code.
#[test]
fn a_cudarc_stream_is_adopted_without_unsafe() {
    let Some((ctx, stream, runtime)) = library("a_cudarc_stream_is_adopted_safely") else {
        return;
    };
    let id = runtime.adopt_cudarc_stream(0, &stream).unwrap();
    assert_eq!(runtime.adopt_cudarc_stream(0, &stream).unwrap(), id);
    drop(stream);
    let s = Storage::new_on(&runtime, id, MIB).unwrap();
    let p = s.mutable_data_ptr_on(id).unwrap();
    // SAFETY: test memory this test owns, ordered on `id` by the door above.
    unsafe { runtime.driver().kernels().fill_pattern(id, p, MIB, 9) }.unwrap();
    runtime.driver().stream_synchronize(id).unwrap();
    assert_eq!(s.count_pattern_mismatches(9).unwrap(), 0);
    let failing = || -> cudalloc::Result<()> {
        // A function the module does not have: cudarc's error, through `?`.
        let source = cudalloc::internals::kernels::SOURCES[0].1;
        let ptx = nvrtc::compile_ptx(source).unwrap();
        ctx.load_module(ptx)?.load_function("no_such_kernel")?;
        Ok(())
    };
    let err = failing().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Driver, "{err}");
    assert!(err.to_string().contains("CUDA_ERROR"), "{err}");
    assert!(std::error::Error::source(&err).is_some());
}

/// A view's ordering of another stream that fails is an error, not a log line: `device_ptr`
/// (cudarc's trait, which cannot fail) keeps it for the view's `ordered()`, and the host waits for
/// the view's stream instead so the launch on the other stream still follows the view's work.
/// Provoked here by a stream of another device's context, which cudalloc cannot adopt for a
/// storage of device 0 (a peer launch).
#[test]
fn a_views_ordering_failure_is_an_error() {
    let Some((_ctx, stream, runtime)) = library("a_views_ordering_failure") else {
        return;
    };
    use cudalloc::cudarc::driver::DevicePtr;
    if runtime.device_count() < 2 {
        println!("a_views_ordering_failure_is_an_error: skipped: one device");
        return;
    }
    let peer = CudaContext::new(1).unwrap();
    let other = peer.new_stream().unwrap();
    let s = Storage::new(&runtime, 0, MIB).unwrap();
    let view = s.view::<u8>(0..MIB as usize, &stream).unwrap();
    view.ordered().unwrap();
    drop(view.device_ptr(&other));
    let err = view.ordered().unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("could not order another stream") && text.contains("context"),
        "{text}"
    );
    view.ordered().expect("the failure is returned once");
}
