//! Module loading and kernel launches (see `module.rs` and `kernels.rs`).

use std::ffi::{c_char, c_uint, c_void, CStr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::api;
use super::stream::put_handle;
use crate::codes::{self, CuResult};
use crate::module::{parse_ptx, Function, Module};
use crate::report::{Entry, Fail};
use crate::state::{double, Object};

/// `cuModuleLoadData`: PTX text only (a cubin or fatbin is reported as unsupported).
///
/// # Safety
/// `image` must point at a NUL-terminated PTX image; `module` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(
    module: *mut *mut c_void,
    image: *const c_void,
) -> CuResult {
    api(Entry::cuModuleLoadData, || {
        let d = double()?;
        let ctx = d.current()?;
        if image.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null image"));
        }
        // SAFETY: PTX images are NUL-terminated (their documented form); cubin and fatbin
        // images have a NUL within their first 16 header bytes, so reading up to the first NUL
        // stays inside any valid image.
        let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) };
        let head = text.to_bytes();
        if head.starts_with(b"\x7fELF") || head.starts_with(&[0x50, 0xed, 0x55, 0xba]) {
            return Err(Fail::violation(
                codes::NOT_SUPPORTED,
                "the double loads PTX text only, not cubin or fatbin images",
            ));
        }
        let text = text
            .to_str()
            .map_err(|_| Fail::violation(codes::INVALID_PTX, "PTX is not UTF-8"))?;
        let entries = parse_ptx(text)?;
        let handle = d.insert(|handle| {
            Object::Module(Arc::new(Module {
                handle,
                ctx: ctx.handle,
                entries,
            }))
        });
        // SAFETY: caller's out-pointer.
        unsafe { put_handle(module, handle, "module") }
    })
}

/// `cuModuleGetFunction`: `CUDA_ERROR_NOT_FOUND` for a name the module lacks.
///
/// # Safety
/// `name` must be NUL-terminated; `hfunc` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    hfunc: *mut *mut c_void,
    hmod: *mut c_void,
    name: *const c_char,
) -> CuResult {
    api(Entry::cuModuleGetFunction, || {
        let d = double()?;
        let m = d.module(hmod)?;
        if name.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null name"));
        }
        // SAFETY: the caller passes a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        let Some(sig) = m.entries.iter().find(|e| e.name == name) else {
            return Err(Fail::outcome(
                codes::NOT_FOUND,
                format!("no kernel {name} in module"),
            ));
        };
        let ctx = d.context(crate::state::as_ptr(m.ctx))?;
        let epoch = ctx.epoch.load(Ordering::Acquire);
        let handle = d.insert(|h| {
            Object::Function(Arc::new(Function::new(
                h,
                m.ctx,
                epoch,
                m.handle,
                sig.clone(),
            )))
        });
        // SAFETY: caller's out-pointer.
        unsafe { put_handle(hfunc, handle, "hfunc") }
    })
}

/// `cuModuleUnload`: its functions become invalid.
#[no_mangle]
pub extern "C" fn cuModuleUnload(hmod: *mut c_void) -> CuResult {
    api(Entry::cuModuleUnload, || {
        let d = double()?;
        let m = d.module(hmod)?;
        d.destroy(m.handle, crate::state::Kind::Module);
        Ok(())
    })
}

/// Checks a launch configuration against the documented limits of current GPUs.
fn check_config(grid: [c_uint; 3], block: [c_uint; 3], shared: c_uint) -> Result<(), Fail> {
    let bad = |what: String| Err(Fail::violation(codes::INVALID_VALUE, what));
    if grid.contains(&0) || block.contains(&0) {
        return bad(format!("zero dimension in grid {grid:?} / block {block:?}"));
    }
    if grid[0] > i32::MAX as u32 || grid[1] > 65535 || grid[2] > 65535 {
        return bad(format!("grid {grid:?} exceeds (2^31-1, 65535, 65535)"));
    }
    let threads = u64::from(block[0]) * u64::from(block[1]) * u64::from(block[2]);
    if block[0] > 1024 || block[1] > 1024 || block[2] > 64 || threads > 1024 {
        return bad(format!("block {block:?} exceeds 1024 threads"));
    }
    if shared > 48 * 1024 {
        return bad(format!(
            "{shared} bytes of dynamic shared memory exceed 48 KiB"
        ));
    }
    Ok(())
}

/// `cuLaunchKernel`: reads exactly the parameters the PTX declares and queues the native work.
///
/// # Safety
/// `kernel_params` must point at one valid pointer per kernel parameter, each to a value of the
/// parameter's size.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: *mut c_void,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult {
    api(Entry::cuLaunchKernel, || {
        let d = double()?;
        let function = d.function(f)?;
        let s = d.stream(stream)?;
        d.require_current(&s, "cuLaunchKernel")?;
        if function.ctx != s.ctx {
            return Err(Fail::violation(
                codes::INVALID_HANDLE,
                format!(
                    "kernel {} of another context launched on a stream of device {}",
                    function.sig.name, s.device
                ),
            ));
        }
        check_config(
            [grid_x, grid_y, grid_z],
            [block_x, block_y, block_z],
            shared_mem_bytes,
        )?;
        if !extra.is_null() {
            return Err(Fail::violation(
                codes::NOT_SUPPORTED,
                "launch parameters through `extra` (the double reads kernelParams)",
            ));
        }
        let sig = &function.sig;
        if kernel_params.is_null() && !sig.params.is_empty() {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!(
                    "kernel {} takes {} parameters; kernelParams is null",
                    sig.name,
                    sig.params.len()
                ),
            ));
        }
        let Some(native) = function.native else {
            return Err(Fail::violation(
                codes::NOT_SUPPORTED,
                format!(
                    "the double has no native implementation of kernel {}",
                    sig.name
                ),
            ));
        };
        if native.params != sig.params.as_slice() {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!(
                    "kernel {}: the PTX declares parameters of {:?} bytes, the native \
                     implementation expects {:?}",
                    sig.name, sig.params, native.params
                ),
            ));
        }
        let mut args = Vec::with_capacity(sig.params.len());
        for (i, &size) in sig.params.iter().enumerate() {
            // SAFETY: the caller passes one pointer per declared parameter.
            let p = unsafe { *kernel_params.add(i) };
            if p.is_null() {
                return Err(Fail::violation(
                    codes::INVALID_VALUE,
                    format!("kernelParams[{i}] of {} is null", sig.name),
                ));
            }
            let mut word = [0u8; 8];
            // SAFETY: `p` points at a value of `size` <= 8 bytes (signature checked above).
            unsafe {
                std::ptr::copy_nonoverlapping(p.cast::<u8>(), word.as_mut_ptr(), size.min(8))
            };
            args.push(u64::from_le_bytes(word));
        }
        // Built now (pointers resolved at the launch), and again for every replay of a capture.
        let ranges = (native.ranges)(&args);
        let build = native.build;
        let make: crate::capture::Maker = Arc::new(move || build(&double()?.memory, &args));
        d.enqueue_node(&s, Entry::cuLaunchKernel, ranges, make)
    })
}
