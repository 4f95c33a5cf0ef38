//! Initialization, devices, primary contexts and the error strings.
//!
//! Note the released-context rule (`state.rs`): the last `cuDevicePrimaryCtxRelease` tears the
//! context down — its streams are destroyed, its memory freed, its events and kernels stale — so
//! a caller that keeps using them afterwards is caught.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::Ordering;

use super::{api, put};
use crate::codes::{self, CuResult};
use crate::report::{Entry, Fail};
use crate::state::{self, as_ptr, double, Kind};

/// `cuInit`.
#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CuResult {
    api(Entry::cuInit, || {
        if flags != 0 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuInit flags must be 0, got {flags}"),
            ));
        }
        state::init()
    })
}

/// `cuGetExportTable`: NVIDIA's private interface, which NVRTC asks `libcuda.so.1` for when it
/// loads; the double has no export tables and says so (NVRTC then compiles without the driver).
///
/// # Safety
/// `pp_export_table` must be valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetExportTable(
    pp_export_table: *mut *const c_void,
    _table_id: *const c_void,
) -> CuResult {
    api(Entry::cuGetExportTable, || {
        if !pp_export_table.is_null() {
            // SAFETY: non-null; the caller's out-pointer.
            unsafe { pp_export_table.write(std::ptr::null()) };
        }
        Err(Fail::outcome(
            codes::NOT_SUPPORTED,
            "the double has no private export tables",
        ))
    })
}

/// `cuGetErrorString` (usable before `cuInit`).
///
/// # Safety
/// `p_str` must be valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CuResult, p_str: *mut *const c_char) -> CuResult {
    api(Entry::cuGetErrorString, || {
        let text = codes::describe(error);
        let ptr = text.map_or(std::ptr::null(), |t| t.as_ptr().cast());
        // SAFETY: the caller passes a valid out-pointer (null is caught by `put`).
        unsafe { put(p_str, ptr, "pStr") }?;
        match text {
            Some(_) => Ok(()),
            None => Err(Fail::outcome(
                codes::INVALID_VALUE,
                format!("{error} is not a CUresult"),
            )),
        }
    })
}

/// `cuDeviceGetCount`.
///
/// # Safety
/// `count` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    api(Entry::cuDeviceGetCount, || {
        let d = double()?;
        // SAFETY: caller's out-pointer.
        unsafe { put(count, d.devices.len() as c_int, "count") }
    })
}

/// `cuDeviceGet`: the device handle is its ordinal.
///
/// # Safety
/// `device` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CuResult {
    api(Entry::cuDeviceGet, || {
        double()?.device(ordinal)?;
        // SAFETY: caller's out-pointer.
        unsafe { put(device, ordinal, "device") }
    })
}

/// `cuDeviceGetName`.
///
/// # Safety
/// `name` must be valid for `len` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CuResult {
    api(Entry::cuDeviceGetName, || {
        let device = double()?.device(dev)?;
        let capacity = usize::try_from(len).unwrap_or(0);
        if name.is_null() || capacity == 0 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("name buffer null or len {len} < 1"),
            ));
        }
        let bytes = device.name.as_bytes();
        let n = bytes.len().min(capacity - 1);
        // SAFETY: the caller's buffer holds `len` >= n + 1 bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

/// Device attributes the double models (what cudarc's context set-up and launch checks read);
/// the limits match `check_config` in `api/module.rs`. Memory pools are not supported, so
/// cudarc allocates with `cuMemAlloc`, as cudalloc does.
const ATTRIBUTES: &[(u32, c_int)] = &[
    (1, 1024),      // MAX_THREADS_PER_BLOCK
    (2, 1024),      // MAX_BLOCK_DIM_X
    (3, 1024),      // MAX_BLOCK_DIM_Y
    (4, 64),        // MAX_BLOCK_DIM_Z
    (5, i32::MAX),  // MAX_GRID_DIM_X
    (6, 65535),     // MAX_GRID_DIM_Y
    (7, 65535),     // MAX_GRID_DIM_Z
    (8, 48 * 1024), // MAX_SHARED_MEMORY_PER_BLOCK
    (10, 32),       // WARP_SIZE
    (16, 1),        // MULTIPROCESSOR_COUNT
    (41, 1),        // UNIFIED_ADDRESSING
    (75, 5),        // COMPUTE_CAPABILITY_MAJOR (the PTX NVRTC makes by default: sm_52)
    (76, 2),        // COMPUTE_CAPABILITY_MINOR
    (115, 0),       // MEMORY_POOLS_SUPPORTED
];

/// `cuDeviceGetAttribute` for the attributes in `ATTRIBUTES`; any other is reported as
/// something the double does not model (so a new query shows up in the verdict).
///
/// # Safety
/// `pi` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(pi: *mut c_int, attrib: u32, dev: c_int) -> CuResult {
    api(Entry::cuDeviceGetAttribute, || {
        double()?.device(dev)?;
        let Some((_, value)) = ATTRIBUTES.iter().find(|(a, _)| *a == attrib) else {
            return Err(Fail::violation(
                codes::NOT_SUPPORTED,
                format!("device attribute {attrib} is not modelled by the double"),
            ));
        };
        // SAFETY: caller's out-pointer.
        unsafe { put(pi, *value, "pi") }
    })
}

/// `cuCtxGetCurrent` (null when no context is current).
///
/// # Safety
/// `pctx` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut *mut c_void) -> CuResult {
    api(Entry::cuCtxGetCurrent, || {
        let handle = double()?.current_handle();
        // SAFETY: caller's out-pointer.
        unsafe { put(pctx, as_ptr(handle), "pctx") }
    })
}

/// `cuDevicePrimaryCtxRetain`.
///
/// # Safety
/// `pctx` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut *mut c_void, dev: c_int) -> CuResult {
    api(Entry::cuDevicePrimaryCtxRetain, || {
        let ctx = &double()?.device(dev)?.context;
        // SAFETY: caller's out-pointer.
        unsafe { put(pctx, as_ptr(ctx.handle), "pctx") }?;
        *ctx.retains.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        Ok(())
    })
}

/// `cuDevicePrimaryCtxRelease_v2`: the last release tears the context down.
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CuResult {
    api(Entry::cuDevicePrimaryCtxRelease_v2, || {
        let d = double()?;
        let device = d.device(dev)?;
        let ctx = &device.context;
        // Held through the teardown: a retain racing the last release waits for it and then
        // finds a fresh context, instead of making streams and memory the teardown then takes.
        let mut retains = ctx.retains.lock().unwrap_or_else(|p| p.into_inner());
        {
            if *retains == 0 {
                return Err(Fail::violation(
                    codes::INVALID_CONTEXT,
                    format!(
                        "the primary context of device {dev} is released more often than retained"
                    ),
                ));
            }
            *retains -= 1;
            if *retains > 0 {
                return Ok(());
            }
            ctx.epoch.fetch_add(1, Ordering::AcqRel);
        }
        // Tear down: queued work finishes, then streams close and memory goes.
        let streams: Vec<_> =
            std::mem::take(&mut *ctx.streams.lock().unwrap_or_else(|p| p.into_inner()));
        for s in streams.iter().chain(ctx.legacy.get()) {
            let _ = s.synchronize();
        }
        for s in streams {
            s.close();
            d.destroy(s.handle, Kind::Stream);
        }
        for base in d.memory.of_context(ctx.handle) {
            if let Ok(a) = d.memory.remove(base, |_| Ok(())) {
                if matches!(a.origin, crate::memory::Origin::Owned { .. }) {
                    device.used.fetch_sub(a.size, Ordering::AcqRel);
                }
            }
        }
        d.memory
            .opened
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, base| d.memory.resolve(*base, 0).is_ok());
        drop(retains);
        Ok(())
    })
}

/// `cuCtxSetCurrent` (null unbinds).
#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CuResult {
    api(Entry::cuCtxSetCurrent, || {
        let d = double()?;
        if !ctx.is_null() {
            d.context(ctx)?;
        }
        d.set_current(ctx as usize);
        Ok(())
    })
}

/// `cuCtxSynchronize`: waits for every stream of the current context.
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    api(Entry::cuCtxSynchronize, || {
        let d = double()?;
        let ctx = d.current()?;
        d.captures.check_context(ctx.handle, "cuCtxSynchronize")?;
        let mut first = Ok(());
        for s in ctx.all_streams() {
            let r = s.synchronize();
            if first.is_ok() {
                first = r;
            }
        }
        first
    })
}
