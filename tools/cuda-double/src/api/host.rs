//! Page-locked host memory: `cuMemHostAlloc`, `cuMemFreeHost`, `cuMemHostRegister_v2`,
//! `cuMemHostUnregister` (the table is `host.rs`). Each needs a current context and is
//! forbidden while a global-mode capture runs, as memory allocation is.

use std::ffi::c_void;

use super::{api, put};
use crate::codes::{self, CuResult};
use crate::report::{Entry, Fail};
use crate::state::double;

/// Flags `cuMemHostAlloc` knows: PORTABLE, DEVICEMAP, WRITECOMBINED.
const HOST_ALLOC_FLAGS: u32 = 0x1 | 0x2 | 0x4;
/// Flags `cuMemHostRegister` knows: PORTABLE, DEVICEMAP, IOMEMORY, READ_ONLY.
const HOST_REGISTER_FLAGS: u32 = 0x1 | 0x2 | 0x4 | 0x8;

/// `cuMemHostAlloc`.
///
/// # Safety
/// `pp` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytesize: usize,
    flags: u32,
) -> CuResult {
    api(Entry::cuMemHostAlloc, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemHostAlloc")?;
        d.current()?;
        if bytesize == 0 || flags & !HOST_ALLOC_FLAGS != 0 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemHostAlloc of {bytesize} bytes with flags {flags:#x}"),
            ));
        }
        let ptr = d.host.alloc(bytesize)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(pp, ptr as *mut c_void, "pp") }
    })
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `p` must come from `cuMemHostAlloc` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CuResult {
    api(Entry::cuMemFreeHost, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemFreeHost")?;
        d.current()?;
        d.host.free(p as usize)
    })
}

/// `cuMemHostRegister_v2`.
///
/// # Safety
/// `p` must be `bytesize` bytes of the caller's memory, live until unregistered.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister_v2(
    p: *mut c_void,
    bytesize: usize,
    flags: u32,
) -> CuResult {
    api(Entry::cuMemHostRegister_v2, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemHostRegister")?;
        d.current()?;
        if p.is_null() || bytesize == 0 || flags & !HOST_REGISTER_FLAGS != 0 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemHostRegister of {bytesize} bytes at {p:?} with flags {flags:#x}"),
            ));
        }
        d.host.register(p as usize, bytesize)
    })
}

/// `cuMemHostUnregister`.
///
/// # Safety
/// `p` must be the base of a registration.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CuResult {
    api(Entry::cuMemHostUnregister, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemHostUnregister")?;
        d.current()?;
        d.host.unregister(p as usize)
    })
}
