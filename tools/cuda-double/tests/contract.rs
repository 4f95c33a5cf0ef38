//! The double's own evidence: each rule it claims to enforce is broken once on purpose and must be
//! recorded as a violation with the documented code — and legitimate outcomes (out of memory, a
//! missing kernel name, refused corrupt handle bytes) must not be. One sequential scenario: the
//! driver state is process-wide, and the first steps run before `cuInit`.
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
use cuda_double::api::ipc::*;
use cuda_double::api::memory::*;
use cuda_double::api::module::*;
use cuda_double::api::stream::*;
use cuda_double::api::vm::*;
use cuda_double::codes;

const PTX: &str = ".version 8.8\n.target sm_52\n.address_size 64\n\
    .visible .entry cudalloc_poison(\n.param .u64 p0,\n.param .u32 p1\n)\n{ ret; }\n\
    .visible .entry cudalloc_fill_pattern(\n.param .u64 a,\n.param .u64 b,\n.param .u64 c\n)\n{ ret; }\n\
    .visible .entry mystery(\n.param .u64 a\n)\n{ ret; }\n\
    .visible .entry cudalloc_sleep(\n.param .u64 n\n)\n{ ret; }\n\0";

#[test]
fn every_rule_is_enforced_and_outcomes_are_not_violations() {
    std::env::set_var("CUDA_DOUBLE_MEMORY", (64u64 << 20).to_string());
    std::env::set_var("CUDA_DOUBLE_DEVICES", "2");
    unsafe {
        let mut count = 0;
        violates(
            cuDeviceGetCount(&mut count),
            codes::NOT_INITIALIZED,
            "before cuInit",
        );
        violates(cuInit(1), codes::INVALID_VALUE, "flags must be 0");
        clean(cuInit(0), codes::SUCCESS);
        clean(cuDeviceGetCount(&mut count), codes::SUCCESS);
        assert_eq!(count, 2);
        violates(
            cuDeviceGetName(null_mut(), 8, 0),
            codes::INVALID_VALUE,
            "name buffer",
        );
        violates(
            cuDevicePrimaryCtxRelease_v2(0),
            codes::INVALID_CONTEXT,
            "released more often",
        );

        // Context-bound calls need a current context.
        let mut ptr = 0u64;
        violates(
            cuMemAlloc_v2(&mut ptr, 4096),
            codes::INVALID_CONTEXT,
            "no context is current",
        );
        let (mut ctx0, mut ctx1) = (null_mut(), null_mut());
        clean(cuDevicePrimaryCtxRetain(&mut ctx0, 0), codes::SUCCESS);
        clean(cuDevicePrimaryCtxRetain(&mut ctx1, 1), codes::SUCCESS);
        clean(cuCtxSetCurrent(ctx0), codes::SUCCESS);

        // Memory: capacity is an outcome; misuse of pointers is a violation.
        clean(cuMemAlloc_v2(&mut ptr, 1 << 30), codes::OUT_OF_MEMORY);
        violates(
            cuMemAlloc_v2(&mut ptr, 0),
            codes::INVALID_VALUE,
            "cuMemAlloc of 0",
        );
        clean(cuMemAlloc_v2(&mut ptr, 1 << 20), codes::SUCCESS);
        let mut stream: *mut c_void = null_mut();
        clean(cuStreamCreate(&mut stream, 1), codes::SUCCESS);
        violates(
            cuStreamCreate(&mut stream, 8),
            codes::INVALID_VALUE,
            "stream flags",
        );
        violates(
            cuMemsetD8Async(ptr + (1 << 20) - 8, 0, 16, stream),
            codes::INVALID_VALUE,
            "run past the end",
        );
        violates(
            cuMemcpyDtoDAsync_v2(ptr + 8, ptr, 64, stream),
            codes::INVALID_VALUE,
            "overlapping",
        );
        // Stream order: a memset then a read on the same stream sees the memset.
        clean(cuMemsetD8Async(ptr, 0xAB, 4096, stream), codes::SUCCESS);
        let mut host = vec![0u8; 4096];
        clean(
            cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), ptr, 4096, stream),
            codes::SUCCESS,
        );
        clean(cuStreamSynchronize(stream), codes::SUCCESS);
        assert!(host.iter().all(|&b| b == 0xAB));

        // Handles: wrong kind, unknown, destroyed.
        violates(
            cuStreamSynchronize(ctx0),
            codes::INVALID_HANDLE,
            "is a Context handle",
        );
        violates(
            cuStreamQuery(0xdead0 as *mut c_void),
            codes::INVALID_HANDLE,
            "not a Stream handle",
        );
        let mut doomed = null_mut();
        clean(cuStreamCreate(&mut doomed, 0), codes::SUCCESS);
        clean(cuStreamDestroy_v2(doomed), codes::SUCCESS);
        violates(
            cuStreamSynchronize(doomed),
            codes::INVALID_HANDLE,
            "already destroyed",
        );

        // Events: flags, cross-context records, export rules.
        let mut event = null_mut();
        violates(
            cuEventCreate(&mut event, 4),
            codes::INVALID_VALUE,
            "INTERPROCESS requires",
        );
        clean(cuEventCreate(&mut event, 2), codes::SUCCESS);
        let mut handle = IpcHandle { reserved: [0; 64] };
        violates(
            cuIpcGetEventHandle(&mut handle, event),
            codes::INVALID_VALUE,
            "only INTERPROCESS",
        );
        clean(cuCtxSetCurrent(ctx1), codes::SUCCESS);
        let mut other_stream = null_mut();
        clean(cuStreamCreate(&mut other_stream, 1), codes::SUCCESS);
        violates(
            cuEventRecord(event, other_stream),
            codes::INVALID_HANDLE,
            "recorded on a stream of device 1",
        );
        violates(
            cuMemsetD8Async(ptr, 0, 16, stream),
            codes::INVALID_CONTEXT,
            "while the context of device 1 is current",
        );
        clean(cuCtxSetCurrent(ctx0), codes::SUCCESS);
        clean(cuEventRecord(event, stream), codes::SUCCESS);
        clean(cuEventSynchronize(event), codes::SUCCESS);
        clean(cuEventQuery(event), codes::SUCCESS);

        // IPC: own export cannot be opened here; corrupt bytes are refused, not violations.
        clean(cuIpcGetMemHandle(&mut handle, ptr), codes::SUCCESS);
        let mut opened = 0u64;
        violates(
            cuIpcOpenMemHandle_v2(&mut opened, handle, 1),
            codes::INVALID_CONTEXT,
            "exported it",
        );
        violates(
            cuIpcOpenMemHandle_v2(&mut opened, handle, 0),
            codes::INVALID_VALUE,
            "LAZY_ENABLE_PEER_ACCESS",
        );
        let garbage = IpcHandle { reserved: [7; 64] };
        clean(
            cuIpcOpenMemHandle_v2(&mut opened, garbage, 1),
            codes::INVALID_VALUE,
        );
        violates(
            cuIpcCloseMemHandle(ptr),
            codes::INVALID_VALUE,
            "which this process allocated",
        );

        // Kernels: a missing name is an outcome; signature drift and unknown kernels are violations.
        let mut module = null_mut();
        clean(
            cuModuleLoadData(&mut module, PTX.as_ptr().cast()),
            codes::SUCCESS,
        );
        let mut f = null_mut();
        clean(
            cuModuleGetFunction(&mut f, module, c"absent".as_ptr()),
            codes::NOT_FOUND,
        );
        clean(
            cuModuleGetFunction(&mut f, module, c"cudalloc_poison".as_ptr()),
            codes::SUCCESS,
        );
        let (mut p, mut n) = (ptr, 64u64);
        let mut args = [
            (&mut p as *mut u64).cast::<c_void>(),
            (&mut n as *mut u64).cast(),
        ];
        violates(
            cuLaunchKernel(
                f,
                1,
                1,
                1,
                256,
                1,
                1,
                0,
                stream,
                args.as_mut_ptr(),
                null_mut(),
            ),
            codes::INVALID_VALUE,
            "native implementation expects",
        );
        let mut mystery = null_mut();
        clean(
            cuModuleGetFunction(&mut mystery, module, c"mystery".as_ptr()),
            codes::SUCCESS,
        );
        violates(
            cuLaunchKernel(
                mystery,
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
            codes::NOT_SUPPORTED,
            "no native implementation",
        );
        let mut fill = null_mut();
        clean(
            cuModuleGetFunction(&mut fill, module, c"cudalloc_fill_pattern".as_ptr()),
            codes::SUCCESS,
        );
        let mut seed = 5u64;
        let mut fill_args = [
            (&mut p as *mut u64).cast::<c_void>(),
            (&mut n as *mut u64).cast(),
            (&mut seed as *mut u64).cast(),
        ];
        violates(
            cuLaunchKernel(
                fill,
                1,
                1,
                1,
                2048,
                1,
                1,
                0,
                stream,
                fill_args.as_mut_ptr(),
                null_mut(),
            ),
            codes::INVALID_VALUE,
            "exceeds 1024 threads",
        );
        clean(
            cuLaunchKernel(
                fill,
                4,
                1,
                1,
                256,
                1,
                1,
                0,
                stream,
                fill_args.as_mut_ptr(),
                null_mut(),
            ),
            codes::SUCCESS,
        );
        clean(
            cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), ptr, 64, stream),
            codes::SUCCESS,
        );
        clean(cuStreamSynchronize(stream), codes::SUCCESS);
        let expected: Vec<u8> = (0..64u64)
            .map(|i| (cuda_double::kernels::pattern_word(5, i / 8) >> (8 * (i % 8))) as u8)
            .collect();
        assert_eq!(&host[..64], &expected[..]);

        // Free: once; a second free is use after free.
        clean(cuMemFree_v2(ptr), codes::SUCCESS);
        violates(cuMemFree_v2(ptr), codes::INVALID_VALUE, "use after free");
        violates(
            cuMemsetD8Async(ptr, 0, 1, stream),
            codes::INVALID_VALUE,
            "use after free",
        );

        // Virtual memory: every property field checked; unmap before free; access before use.
        let mut prop = cuda_double::vm::AllocationProp {
            type_: 1,
            requested_handle_types: 1,
            location: cuda_double::vm::MemLocation { type_: 1, id: 0 },
            win32_handle_meta_data: null_mut(),
            alloc_flags: [0; 8],
        };
        let mut granularity = 0usize;
        clean(
            cuMemGetAllocationGranularity(&mut granularity, &prop, 0),
            codes::SUCCESS,
        );
        let g = granularity;
        prop.alloc_flags[4] = 1;
        violates(
            cuMemGetAllocationGranularity(&mut granularity, &prop, 0),
            codes::INVALID_VALUE,
            "reserved bytes",
        );
        prop.alloc_flags[4] = 0;
        prop.location.id = 7;
        let mut chunk = 0u64;
        violates(
            cuMemCreate(&mut chunk, g, &prop, 0),
            codes::INVALID_VALUE,
            "not a device",
        );
        prop.location.id = 0;
        violates(
            cuMemCreate(&mut chunk, g + 1, &prop, 0),
            codes::INVALID_VALUE,
            "granularity",
        );
        clean(cuMemCreate(&mut chunk, g, &prop, 0), codes::SUCCESS);
        let mut base = 0u64;
        clean(
            cuMemAddressReserve(&mut base, 2 * g, 0, 0, 0),
            codes::SUCCESS,
        );
        clean(cuMemMap(base, g, 0, chunk, 0), codes::SUCCESS);
        violates(
            cuMemsetD8Async(base, 0, 16, stream),
            codes::ILLEGAL_ADDRESS,
            "access was not set",
        );
        let access = cuda_double::vm::AccessDesc {
            location: cuda_double::vm::MemLocation { type_: 1, id: 0 },
            flags: 3,
        };
        clean(cuMemSetAccess(base, g, &access, 1), codes::SUCCESS);
        clean(cuMemsetD8Async(base, 7, 16, stream), codes::SUCCESS);
        clean(cuStreamSynchronize(stream), codes::SUCCESS);
        violates(
            cuMemsetD8Async(base + g as u64, 0, 16, stream),
            codes::ILLEGAL_ADDRESS,
            "not mapped",
        );
        violates(
            cuMemAddressFree(base, 2 * g),
            codes::INVALID_VALUE,
            "unmap before free",
        );
        violates(
            cuMemUnmap(base, 2 * g),
            codes::INVALID_VALUE,
            "whole mapped range",
        );
        // Unmapping memory that queued work still uses: the stream is kept busy (the sleep
        // kernel, as torch.cuda._sleep) so the memset behind it is still queued at the unmap.
        let mut sleeper = null_mut();
        clean(
            cuModuleGetFunction(&mut sleeper, module, c"cudalloc_sleep".as_ptr()),
            codes::SUCCESS,
        );
        let mut nanos = 300_000_000u64;
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
                stream,
                sleep_args.as_mut_ptr(),
                null_mut(),
            ),
            codes::SUCCESS,
        );
        clean(cuMemsetD8Async(base, 1, 16, stream), codes::SUCCESS);
        violates(
            cuMemUnmap(base, g),
            codes::INVALID_VALUE,
            "queued device work uses it",
        );
        clean(cuStreamSynchronize(stream), codes::SUCCESS);
        clean(cuMemUnmap(base, g), codes::SUCCESS);
        clean(cuMemRelease(chunk), codes::SUCCESS);
        violates(
            cuMemRelease(chunk),
            codes::INVALID_VALUE,
            "already released",
        );
        clean(cuMemAddressFree(base, 2 * g), codes::SUCCESS);

        // The last release tears the context down: its streams and events are gone.
        clean(cuDevicePrimaryCtxRelease_v2(0), codes::SUCCESS);
        violates(
            cuStreamQuery(stream),
            codes::INVALID_HANDLE,
            "already destroyed",
        );
        violates(cuEventQuery(event), codes::INVALID_CONTEXT, "was released");
        clean(cuDevicePrimaryCtxRetain(&mut ctx0, 0), codes::SUCCESS);
        violates(
            cuEventQuery(event),
            codes::INVALID_HANDLE,
            "before its last release",
        );
        clean(cuDevicePrimaryCtxRelease_v2(0), codes::SUCCESS);
        clean(cuDevicePrimaryCtxRelease_v2(1), codes::SUCCESS);
    }
}
