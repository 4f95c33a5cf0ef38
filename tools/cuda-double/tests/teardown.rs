//! A retain racing the last release of a primary context: the release tears the context down
//! (waiting for queued work first); a retain arriving meanwhile must find a fresh context whose
//! streams and memory the teardown leaves alone. Found by two suites of one process, each making
//! and dropping its own driver: the teardown of one took the other's new stream and allocation,
//! and the other's next copy faulted.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::undocumented_unsafe_blocks
)]

mod common;

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::Ordering;

use common::clean;
use cuda_double::api::device::*;
use cuda_double::api::memory::*;
use cuda_double::api::module::*;
use cuda_double::api::stream::*;
use cuda_double::codes;

const PTX: &str = ".version 8.8\n.target sm_52\n.address_size 64\n\
    .visible .entry cudalloc_sleep(\n.param .u64 n\n)\n{ ret; }\n\0";

#[test]
fn a_retain_during_the_last_release_gets_a_context_the_teardown_leaves_alone() {
    std::env::set_var("CUDA_DOUBLE_MEMORY", (64u64 << 20).to_string());
    std::env::set_var("CUDA_DOUBLE_DEVICES", "1");
    unsafe {
        clean(cuInit(0), codes::SUCCESS);
        let mut ctx = null_mut();
        clean(cuDevicePrimaryCtxRetain(&mut ctx, 0), codes::SUCCESS);
        clean(cuCtxSetCurrent(ctx), codes::SUCCESS);
        let mut stream: *mut c_void = null_mut();
        clean(cuStreamCreate(&mut stream, 1), codes::SUCCESS);
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
        // Queued work the teardown waits for: the release is still tearing down while the
        // retain below runs.
        let mut nanos = 400_000_000u64;
        let mut args = [(&mut nanos as *mut u64).cast::<c_void>()];
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
                stream,
                args.as_mut_ptr(),
                null_mut(),
            ),
            codes::SUCCESS,
        );
        let context = &cuda_double::state::double()
            .unwrap()
            .device(0)
            .unwrap()
            .context;
        let epoch = context.epoch.load(Ordering::Acquire);
        let release = std::thread::spawn(|| cuDevicePrimaryCtxRelease_v2(0));
        // The release has begun its teardown once the epoch moved.
        while context.epoch.load(Ordering::Acquire) == epoch {
            std::thread::yield_now();
        }
        clean(cuDevicePrimaryCtxRetain(&mut ctx, 0), codes::SUCCESS);
        clean(cuCtxSetCurrent(ctx), codes::SUCCESS);
        let mut ptr = 0u64;
        clean(cuMemAlloc_v2(&mut ptr, 4096), codes::SUCCESS);
        let mut fresh: *mut c_void = null_mut();
        clean(cuStreamCreate(&mut fresh, 1), codes::SUCCESS);
        assert_eq!(release.join().unwrap(), codes::SUCCESS);
        // The fresh context's stream and memory outlived the teardown.
        let mut back = [0u8; 4096];
        clean(cuMemsetD8Async(ptr, 7, 4096, fresh), codes::SUCCESS);
        clean(
            cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), ptr, 4096, fresh),
            codes::SUCCESS,
        );
        clean(cuStreamSynchronize(fresh), codes::SUCCESS);
        assert!(back.iter().all(|&b| b == 7));
        clean(cuMemFree_v2(ptr), codes::SUCCESS);
        clean(cuDevicePrimaryCtxRelease_v2(0), codes::SUCCESS);
    }
}
