//! The double's capture rules (`src/capture.rs`), each broken once on purpose and recorded as a
//! violation with CUDA's code, beside the legitimate uses that must stay clean: work recorded not
//! run, replays in order, forks joined back, modes, the legacy stream, violations announced by a
//! test (`cuda_double_expect_violations`). One sequential scenario in its own process (the driver
//! state is process-wide).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::undocumented_unsafe_blocks
)]

mod common;

use std::ffi::c_void;
use std::ptr::null_mut;

use common::{clean, violates};
use cuda_double::api::device::*;
use cuda_double::api::graph::*;
use cuda_double::api::memory::*;
use cuda_double::api::module::*;
use cuda_double::api::stream::*;
use cuda_double::api::vm::*;
use cuda_double::api::{cuda_double_expect_violations, cuda_double_expected_left};
use cuda_double::codes;
use cuda_double::report::report;

fn read(ptr: u64, len: usize, stream: *mut c_void) -> Vec<u8> {
    let mut host = vec![0u8; len];
    clean(
        unsafe { cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), ptr, len, stream) },
        codes::SUCCESS,
    );
    clean(cuStreamSynchronize(stream), codes::SUCCESS);
    host
}

const PTX: &str = ".version 8.8\n.target sm_52\n.address_size 64\n\
    .visible .entry cudalloc_sleep(\n.param .u64 n\n)\n{ ret; }\n\0";

fn event() -> *mut c_void {
    let mut e = null_mut();
    clean(unsafe { cuEventCreate(&mut e, 2) }, codes::SUCCESS);
    e
}

#[test]
fn capture_rules_are_enforced_and_legitimate_captures_are_clean() {
    std::env::set_var("CUDA_DOUBLE_MEMORY", (64u64 << 20).to_string());
    unsafe {
        clean(cuInit(0), codes::SUCCESS);
        let mut ctx = null_mut();
        clean(cuDevicePrimaryCtxRetain(&mut ctx, 0), codes::SUCCESS);
        clean(cuCtxSetCurrent(ctx), codes::SUCCESS);
        let ctx_u = ctx as usize;
        let (mut s, mut t, mut blocking) = (null_mut(), null_mut(), null_mut());
        clean(cuStreamCreate(&mut s, 1), codes::SUCCESS);
        clean(cuStreamCreate(&mut t, 1), codes::SUCCESS);
        clean(cuStreamCreate(&mut blocking, 0), codes::SUCCESS);
        let mut buf = 0u64;
        clean(cuMemAlloc_v2(&mut buf, 1 << 20), codes::SUCCESS);
        clean(cuMemsetD8Async(buf, 0, 1 << 20, s), codes::SUCCESS);

        // Recorded, not run; replayed in order at every launch.
        clean(cuStreamBeginCapture_v2(s, 0), codes::SUCCESS);
        let (mut status, mut id) = (0u32, 0u64);
        clean(
            cuStreamGetCaptureInfo_v2(s, &mut status, &mut id, null_mut(), null_mut(), null_mut()),
            codes::SUCCESS,
        );
        assert_eq!((status, id > 0), (1, true));
        clean(cuMemsetD8Async(buf, 7, 4096, s), codes::SUCCESS);
        clean(
            cuMemcpyDtoDAsync_v2(buf + 8192, buf, 4096, s),
            codes::SUCCESS,
        );
        clean(cuMemsetD8Async(buf, 9, 16, s), codes::SUCCESS);
        let mut graph = null_mut();
        clean(cuStreamEndCapture(s, &mut graph), codes::SUCCESS);
        assert!(
            read(buf, 4096, s).iter().all(|&b| b == 0),
            "captured work ran"
        );
        let mut nodes = 0usize;
        clean(
            cuGraphGetNodes(graph, null_mut(), &mut nodes),
            codes::SUCCESS,
        );
        assert_eq!(nodes, 3);
        let mut exec = null_mut();
        clean(
            cuGraphInstantiateWithFlags(&mut exec, graph, 0),
            codes::SUCCESS,
        );
        for _ in 0..3 {
            clean(cuMemsetD8Async(buf + 8192, 1, 4096, t), codes::SUCCESS);
            clean(cuStreamSynchronize(t), codes::SUCCESS);
            clean(cuGraphLaunch(exec, t), codes::SUCCESS);
            let after = read(buf, 12288, t);
            assert!(after[..16].iter().all(|&b| b == 9));
            assert!(after[16..4096].iter().all(|&b| b == 7));
            assert!(
                after[8192..8192 + 16].iter().all(|&b| b == 7),
                "copy ran before the last memset"
            );
        }
        clean(cuGraphDestroy(graph), codes::SUCCESS);
        clean(cuGraphLaunch(exec, t), codes::SUCCESS);
        violates(
            cuGraphDestroy(graph),
            codes::INVALID_HANDLE,
            "already destroyed",
        );

        // Prohibited calls: violations, the capture invalidated, its end an outcome.
        clean(cuStreamBeginCapture_v2(s, 0), codes::SUCCESS);
        violates(
            cuMemAlloc_v2(&mut buf, 4096),
            codes::STREAM_CAPTURE_UNSUPPORTED,
            "prohibited on this thread",
        );
        clean(cuStreamIsCapturing(s, &mut status), codes::SUCCESS);
        assert_eq!(status, 2, "invalidated");
        clean(
            cuMemsetD8Async(buf, 1, 16, s),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
        clean(
            cuStreamEndCapture(s, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
        clean(cuStreamIsCapturing(s, &mut status), codes::SUCCESS);
        assert_eq!(status, 0);

        // Relaxed on this thread: allocation allowed; blocking on the capture never is.
        clean(cuStreamBeginCapture_v2(s, 0), codes::SUCCESS);
        let mut mode = 2u32;
        clean(cuThreadExchangeStreamCaptureMode(&mut mode), codes::SUCCESS);
        assert_eq!(mode, 0);
        let mut extra = 0u64;
        clean(cuMemAlloc_v2(&mut extra, 4096), codes::SUCCESS);
        violates(
            cuStreamSynchronize(s),
            codes::STREAM_CAPTURE_UNSUPPORTED,
            "on a stream that is being captured",
        );
        clean(cuThreadExchangeStreamCaptureMode(&mut mode), codes::SUCCESS);
        clean(
            cuStreamEndCapture(s, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );

        // A global capture prohibits other threads too; a thread-local one does not.
        clean(cuStreamBeginCapture_v2(s, 0), codes::SUCCESS);
        let other = std::thread::spawn(move || {
            clean(cuCtxSetCurrent(ctx_u as *mut c_void), codes::SUCCESS);
            let mut p = 0u64;
            let code = cuMemAlloc_v2(&mut p, 4096);
            (code, report().take_recent().len())
        })
        .join()
        .unwrap();
        assert_eq!(other, (codes::STREAM_CAPTURE_UNSUPPORTED, 1));
        clean(
            cuStreamEndCapture(s, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
        clean(cuStreamBeginCapture_v2(s, 1), codes::SUCCESS);
        let other = std::thread::spawn(move || {
            clean(cuCtxSetCurrent(ctx_u as *mut c_void), codes::SUCCESS);
            let mut p = 0u64;
            let code = cuMemAlloc_v2(&mut p, 4096);
            (code, report().take_recent().len(), p)
        })
        .join()
        .unwrap();
        assert_eq!((other.0, other.1), (codes::SUCCESS, 0));
        clean(cuStreamEndCapture(s, &mut graph), codes::SUCCESS);

        // Fork and join: a stream that joined must be waited for again before the end.
        let (fork, join) = (event(), event());
        clean(cuStreamBeginCapture_v2(s, 1), codes::SUCCESS);
        clean(cuEventRecord(fork, s), codes::SUCCESS);
        clean(cuStreamWaitEvent(t, fork, 0), codes::SUCCESS);
        clean(cuMemsetD8Async(buf, 3, 16, t), codes::SUCCESS);
        violates(
            cuEventQuery(fork),
            codes::STREAM_CAPTURE_UNSUPPORTED,
            "on an event recorded inside a capture",
        );
        clean(
            cuStreamEndCapture(s, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
        clean(cuStreamBeginCapture_v2(s, 1), codes::SUCCESS);
        clean(cuEventRecord(fork, s), codes::SUCCESS);
        clean(cuStreamWaitEvent(t, fork, 0), codes::SUCCESS);
        clean(cuMemsetD8Async(buf, 3, 16, t), codes::SUCCESS);
        violates(
            cuStreamEndCapture(t, &mut graph),
            codes::STREAM_CAPTURE_UNMATCHED,
            "not its origin",
        );
        // As an H200 did: that invalidated the capture, which goes on until its origin ends it.
        clean(cuEventRecord(join, t), codes::STREAM_CAPTURE_INVALIDATED);
        clean(
            cuStreamEndCapture(s, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
        clean(cuStreamBeginCapture_v2(s, 1), codes::SUCCESS);
        clean(cuEventRecord(fork, s), codes::SUCCESS);
        clean(cuStreamWaitEvent(t, fork, 0), codes::SUCCESS);
        clean(cuMemsetD8Async(buf, 3, 16, t), codes::SUCCESS);
        violates(
            cuStreamEndCapture(s, &mut graph),
            codes::STREAM_CAPTURE_UNJOINED,
            "never waited",
        );

        // Isolation: a capture cannot wait on work outside it.
        let outside = event();
        clean(cuEventRecord(outside, t), codes::SUCCESS);
        clean(cuStreamBeginCapture_v2(s, 1), codes::SUCCESS);
        violates(
            cuStreamWaitEvent(s, outside, 0),
            codes::STREAM_CAPTURE_ISOLATION,
            "outside the capture",
        );
        clean(
            cuStreamEndCapture(s, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );

        // The thread that began a capture ends it (unless relaxed).
        clean(cuStreamBeginCapture_v2(s, 1), codes::SUCCESS);
        let s_addr = s as usize;
        let ended = std::thread::spawn(move || {
            clean(cuCtxSetCurrent(ctx_u as *mut c_void), codes::SUCCESS);
            let mut g = null_mut();
            let code = cuStreamEndCapture(s_addr as *mut c_void, &mut g);
            (code, report().take_recent().len())
        })
        .join()
        .unwrap();
        assert_eq!(ended, (codes::STREAM_CAPTURE_WRONG_THREAD, 1));
        // As an H200 did: the wrong thread's end ended the capture, without a graph.
        violates(
            cuStreamEndCapture(s, &mut graph),
            codes::ILLEGAL_STATE,
            "not being captured",
        );

        // A graph launch cannot be captured; instantiating is unsafe during a global capture.
        let mut inner = null_mut();
        clean(cuStreamBeginCapture_v2(s, 1), codes::SUCCESS);
        clean(cuMemsetD8Async(buf, 4, 16, s), codes::SUCCESS);
        let mut captured = null_mut();
        clean(cuStreamEndCapture(s, &mut captured), codes::SUCCESS);
        clean(
            cuGraphInstantiateWithFlags(&mut inner, captured, 0),
            codes::SUCCESS,
        );
        clean(cuStreamBeginCapture_v2(t, 0), codes::SUCCESS);
        violates(
            cuGraphLaunch(inner, t),
            codes::STREAM_CAPTURE_UNSUPPORTED,
            "cannot be captured",
        );
        clean(
            cuStreamEndCapture(t, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
        clean(cuStreamBeginCapture_v2(t, 0), codes::SUCCESS);
        let mut again = null_mut();
        violates(
            cuGraphInstantiateWithFlags(&mut again, captured, 0),
            codes::STREAM_CAPTURE_UNSUPPORTED,
            "prohibited",
        );
        clean(
            cuStreamEndCapture(t, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
        clean(cuGraphExecDestroy(inner), codes::SUCCESS);
        clean(cuGraphDestroy(captured), codes::SUCCESS);

        // Pageable copies cannot be captured; the legacy stream cannot touch a blocking capture.
        clean(cuStreamBeginCapture_v2(blocking, 1), codes::SUCCESS);
        let mut host = [0u8; 16];
        violates(
            cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), buf, 16, blocking),
            codes::STREAM_CAPTURE_UNSUPPORTED,
            "cannot be captured",
        );
        clean(
            cuStreamEndCapture(blocking, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
        clean(cuStreamBeginCapture_v2(blocking, 1), codes::SUCCESS);
        violates(
            cuMemsetD8Async(buf, 0, 16, null_mut()),
            codes::STREAM_CAPTURE_IMPLICIT,
            "legacy stream",
        );
        violates(
            cuMemFree_v2(extra),
            codes::STREAM_CAPTURE_UNSUPPORTED,
            "synchronizes a context",
        );
        clean(
            cuStreamEndCapture(blocking, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
        clean(cuMemFree_v2(extra), codes::SUCCESS);

        // A replay over memory freed since the capture faults the launch stream.
        let mut doomed = 0u64;
        clean(cuMemAlloc_v2(&mut doomed, 4096), codes::SUCCESS);
        clean(cuStreamBeginCapture_v2(s, 1), codes::SUCCESS);
        clean(cuMemsetD8Async(doomed, 5, 4096, s), codes::SUCCESS);
        clean(cuStreamEndCapture(s, &mut graph), codes::SUCCESS);
        clean(
            cuGraphInstantiateWithFlags(&mut exec, graph, 0),
            codes::SUCCESS,
        );
        clean(cuMemFree_v2(doomed), codes::SUCCESS);
        // The launch builds the work again and finds the memory gone: a violation of the
        // launch, before anything runs.
        violates(
            cuGraphLaunch(exec, t),
            codes::INVALID_VALUE,
            "use after free",
        );
        clean(cuStreamSynchronize(t), codes::SUCCESS);

        // Found by review: a replay of a memset captured over virtual memory that was unmapped
        // since wrote a PROT_NONE page (SIGSEGV of the whole process); the work is now resolved
        // again at each launch: a violation of that launch.
        let prop = cuda_double::vm::AllocationProp {
            type_: 1,
            requested_handle_types: 1,
            location: cuda_double::vm::MemLocation { type_: 1, id: 0 },
            win32_handle_meta_data: null_mut(),
            alloc_flags: [0; 8],
        };
        let mut g = 0usize;
        clean(
            cuMemGetAllocationGranularity(&mut g, &prop, 0),
            codes::SUCCESS,
        );
        let (mut chunk, mut base) = (0u64, 0u64);
        clean(cuMemCreate(&mut chunk, g, &prop, 0), codes::SUCCESS);
        clean(cuMemAddressReserve(&mut base, g, 0, 0, 0), codes::SUCCESS);
        clean(cuMemMap(base, g, 0, chunk, 0), codes::SUCCESS);
        let access = cuda_double::vm::AccessDesc {
            location: cuda_double::vm::MemLocation { type_: 1, id: 0 },
            flags: 3,
        };
        clean(cuMemSetAccess(base, g, &access, 1), codes::SUCCESS);
        clean(cuStreamBeginCapture_v2(s, 2), codes::SUCCESS);
        clean(cuMemsetD8Async(base, 7, 64, s), codes::SUCCESS);
        clean(cuStreamEndCapture(s, &mut graph), codes::SUCCESS);
        clean(
            cuGraphInstantiateWithFlags(&mut exec, graph, 0),
            codes::SUCCESS,
        );
        clean(cuMemUnmap(base, g), codes::SUCCESS);
        violates(cuGraphLaunch(exec, s), codes::ILLEGAL_ADDRESS, "not mapped");
        clean(cuStreamSynchronize(s), codes::SUCCESS);
        clean(cuMemAddressFree(base, g), codes::SUCCESS);
        clean(cuMemRelease(chunk), codes::SUCCESS);

        // Found by review: launches of one instantiated graph on two streams ran at once; CUDA
        // runs them one at a time, in launch order. The first launch's stream is busy (a sleep
        // kernel) when the second is made: the second, and the memset behind it on its stream,
        // run after the first, so the memset's value is what stays (the sleep only makes the old
        // overlap likely; in every interleaving the ordered double passes).
        let mut module = null_mut();
        clean(
            cuModuleLoadData(&mut module, PTX.as_ptr().cast()),
            codes::SUCCESS,
        );
        let mut sleeper = null_mut();
        clean(
            cuModuleGetFunction(&mut sleeper, module, c"cudalloc_sleep".as_ptr()),
            codes::SUCCESS,
        );
        clean(cuStreamBeginCapture_v2(s, 1), codes::SUCCESS);
        clean(cuMemsetD8Async(buf, 1, 4096, s), codes::SUCCESS);
        clean(cuStreamEndCapture(s, &mut graph), codes::SUCCESS);
        clean(
            cuGraphInstantiateWithFlags(&mut exec, graph, 0),
            codes::SUCCESS,
        );
        let mut nanos = 200_000_000u64;
        let mut sleep_args = [(&mut nanos as *mut u64).cast::<c_void>()];
        clean(
            cuLaunchKernel(
                sleeper,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                s,
                sleep_args.as_mut_ptr(),
                null_mut(),
            ),
            codes::SUCCESS,
        );
        clean(cuGraphLaunch(exec, s), codes::SUCCESS);
        clean(cuGraphLaunch(exec, t), codes::SUCCESS);
        clean(cuMemsetD8Async(buf, 2, 4096, t), codes::SUCCESS);
        clean(cuStreamSynchronize(s), codes::SUCCESS);
        assert!(
            read(buf, 4096, t).iter().all(|&b| b == 2),
            "the second launch overtook the first"
        );

        // Found by review: destroying a stream that takes part in a capture left a capture no one
        // could end, whose prohibitions outlived it. Now a violation, and the capture is gone.
        let mut doomed_stream = null_mut();
        clean(cuStreamCreate(&mut doomed_stream, 1), codes::SUCCESS);
        clean(cuStreamBeginCapture_v2(doomed_stream, 0), codes::SUCCESS);
        violates(
            cuStreamDestroy_v2(doomed_stream),
            codes::STREAM_CAPTURE_UNSUPPORTED,
            "taking part in capture",
        );
        let mut after = 0u64;
        clean(cuMemAlloc_v2(&mut after, 4096), codes::SUCCESS);
        clean(cuMemFree_v2(after), codes::SUCCESS);

        // Found by review: the legacy stream's capture status while a blocking stream captures is
        // CUDA's STREAM_CAPTURE_IMPLICIT (an outcome), not "not capturing".
        clean(cuStreamBeginCapture_v2(blocking, 2), codes::SUCCESS);
        clean(
            cuStreamIsCapturing(null_mut(), &mut status),
            codes::STREAM_CAPTURE_IMPLICIT,
        );
        clean(cuStreamEndCapture(blocking, &mut graph), codes::SUCCESS);
        clean(cuStreamIsCapturing(null_mut(), &mut status), codes::SUCCESS);

        // Announced violations go to expected.log, not the count, and are consumed one by one.
        let before = report().violations();
        cuda_double_expect_violations(1);
        clean(cuStreamBeginCapture_v2(s, 0), codes::SUCCESS);
        let mut p = 0u64;
        let code = cuMemAlloc_v2(&mut p, 4096);
        assert_eq!(code, codes::STREAM_CAPTURE_UNSUPPORTED);
        assert_eq!(cuda_double_expected_left(), 0);
        assert_eq!(report().violations(), before);
        assert!(report().take_recent().is_empty());
        clean(
            cuStreamEndCapture(s, &mut graph),
            codes::STREAM_CAPTURE_INVALIDATED,
        );
    }
}
