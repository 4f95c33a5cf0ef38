//! Allocation, free, address queries, copies and memset.
//!
//! Copies follow the documented behaviour: from pageable memory `cuMemcpyHtoDAsync` stages the
//! host bytes before returning (the caller may reuse its buffer), from page-locked memory
//! (`host.rs`) it reads them when the stream reaches the copy, which must find them still locked;
//! the device write happens in stream order; `cuMemcpyDtoHAsync` writes the host buffer when the stream reaches it — so a caller
//! that reads the buffer without synchronizing reads stale bytes, as it may on a GPU.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{api, put};
use crate::capture::Maker;
use crate::codes::{self, CuResult};
use crate::kernels::Work;
use crate::memory::{Allocation, Backing, Origin};
use crate::region::{Header, Region};
use crate::report::{Entry, Fail};
use crate::state::double;

/// Magic of a device allocation's region.
pub(crate) const SEGMENT_MAGIC: [u8; 8] = *b"CUDBLSEG";

/// `cuMemGetInfo_v2` for the current context's device.
///
/// # Safety
/// `free` and `total` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    api(Entry::cuMemGetInfo_v2, || {
        let d = double()?;
        let device = &d.devices[d.current()?.device];
        let used = device.used.load(Ordering::Acquire);
        // SAFETY: caller's out-pointers.
        unsafe {
            put(free, device.total.saturating_sub(used) as usize, "free")?;
            put(total, device.total as usize, "total")
        }
    })
}

/// `cuMemAlloc_v2`.
///
/// # Safety
/// `dptr` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytesize: usize) -> CuResult {
    api(Entry::cuMemAlloc_v2, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemAlloc_v2")?;
        let ctx = d.current()?;
        if dptr.is_null() || bytesize == 0 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemAlloc of {bytesize} bytes into {dptr:?}"),
            ));
        }
        let size = bytesize as u64;
        let device = &d.devices[ctx.device];
        device
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(size).filter(|&u| u <= device.total)
            })
            .map_err(|used| {
                Fail::outcome(
                    codes::OUT_OF_MEMORY,
                    format!("{size} bytes requested, {used} of {} in use", device.total),
                )
            })?;
        let made = d.memory.place(ctx.device, size).and_then(|base| {
            let id = d.memory.fresh_id();
            let region = Region::create(Header {
                magic: SEGMENT_MAGIC,
                pid: d.pid,
                device: ctx.device as u32,
                id,
                size,
            })?;
            Ok(Arc::new(Allocation {
                base,
                size,
                device: ctx.device,
                ctx: ctx.handle,
                origin: Origin::Owned { id },
                backing: Backing::Region(region),
                released: false.into(),
            }))
        });
        let allocation = made.inspect_err(|_| {
            device.used.fetch_sub(size, Ordering::AcqRel);
        })?;
        let base = allocation.base;
        d.memory.insert(allocation);
        // SAFETY: checked non-null above; the caller's out-pointer.
        unsafe { dptr.write(base) };
        Ok(())
    })
}

/// `cuMemFree_v2`: synchronizes the allocation's context first (as `cudaFree` does).
#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CuResult {
    api(Entry::cuMemFree_v2, || {
        let d = double()?;
        d.current()?;
        if dptr == 0 {
            return Ok(());
        }
        let (allocation, _) = d.memory.resolve(dptr, 0)?;
        d.captures.check_context(allocation.ctx, "cuMemFree_v2")?;
        for s in d.devices[allocation.device].context.all_streams() {
            let _ = s.synchronize();
        }
        let removed = d.memory.remove(dptr, |a| match a.origin {
            Origin::Owned { .. } => Ok(()),
            Origin::Reserved => Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemFree of {dptr:#x}, a cuMemAddressReserve range: free it with cuMemAddressFree"),
            )),
            Origin::Opened { .. } => Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemFree of {dptr:#x}, opened from another process: close it with cuIpcCloseMemHandle"),
            )),
        })?;
        d.devices[removed.device]
            .used
            .fetch_sub(removed.size, Ordering::AcqRel);
        Ok(())
    })
}

/// `cuMemGetAddressRange_v2` (either out-pointer may be null).
///
/// # Safety
/// Non-null `pbase` / `psize` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    pbase: *mut u64,
    psize: *mut usize,
    dptr: u64,
) -> CuResult {
    api(Entry::cuMemGetAddressRange_v2, || {
        let (a, _) = double()?.memory.resolve(dptr, 0)?;
        // SAFETY: caller's out-pointers, each checked for null.
        unsafe {
            if !pbase.is_null() {
                pbase.write(a.base);
            }
            if !psize.is_null() {
                psize.write(a.size as usize);
            }
        }
        Ok(())
    })
}

/// `cuMemcpyHtoDAsync_v2`.
///
/// # Safety
/// `src` must be valid for `count` bytes of reads.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    count: usize,
    stream: *mut c_void,
) -> CuResult {
    api(Entry::cuMemcpyHtoDAsync_v2, || {
        let d = double()?;
        let s = d.stream(stream)?;
        d.require_current(&s, "cuMemcpyHtoDAsync")?;
        let (a, offset) = d.memory.resolve(dst, count as u64)?;
        if count == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(Fail::violation(codes::INVALID_VALUE, "null host source"));
        }
        let host = src as usize;
        if let Some(locked) = d.host.containing(host, count) {
            // Page-locked: read when the stream reaches the copy, as a GPU's DMA does.
            return d.enqueue(
                &s,
                Entry::cuMemcpyHtoDAsync_v2,
                vec![(dst, count as u64)],
                || {
                    let (a, locked) = (Arc::clone(&a), Arc::clone(&locked));
                    Box::new(move || {
                        a.check_live("cuMemcpyHtoDAsync")?;
                        check_locked(&locked, "cuMemcpyHtoDAsync")?;
                        // SAFETY: the source is page-locked memory still locked (checked); the
                        // destination is inside the live allocation.
                        unsafe {
                            std::ptr::copy_nonoverlapping(host as *const u8, a.at(offset), count)
                        };
                        Ok(())
                    })
                },
            );
        }
        // SAFETY: the caller's buffer holds `count` readable bytes; staged now (pageable).
        let staged = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), count) }.to_vec();
        d.enqueue(
            &s,
            Entry::cuMemcpyHtoDAsync_v2,
            vec![(dst, count as u64)],
            || {
                Box::new(move || {
                    a.check_live("cuMemcpyHtoDAsync")?;
                    // SAFETY: `[offset, offset + count)` is inside the live allocation.
                    unsafe { std::ptr::copy_nonoverlapping(staged.as_ptr(), a.at(offset), count) };
                    Ok(())
                })
            },
        )
    })
}

/// `cuMemcpyDtoHAsync_v2`.
///
/// # Safety
/// `dst` must stay valid for `count` bytes of writes until the stream reaches the copy.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    count: usize,
    stream: *mut c_void,
) -> CuResult {
    api(Entry::cuMemcpyDtoHAsync_v2, || {
        let d = double()?;
        let s = d.stream(stream)?;
        d.require_current(&s, "cuMemcpyDtoHAsync")?;
        let (a, offset) = d.memory.resolve(src, count as u64)?;
        if count == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                "null host destination",
            ));
        }
        let host = dst as usize;
        let locked = d.host.containing(host, count);
        d.enqueue(
            &s,
            Entry::cuMemcpyDtoHAsync_v2,
            vec![(src, count as u64)],
            || {
                let locked = locked.clone();
                Box::new(move || {
                    a.check_live("cuMemcpyDtoHAsync")?;
                    if let Some(locked) = &locked {
                        check_locked(locked, "cuMemcpyDtoHAsync")?;
                    }
                    // SAFETY: the source is inside the live allocation; the caller keeps `dst` valid
                    // until the stream reaches this copy (the async copy contract).
                    unsafe { std::ptr::copy_nonoverlapping(a.at(offset), host as *mut u8, count) };
                    Ok(())
                })
            },
        )
    })
}

/// `cuMemcpyDtoDAsync_v2` (overlapping ranges are a violation, as for `memcpy`).
#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: u64,
    src: u64,
    count: usize,
    stream: *mut c_void,
) -> CuResult {
    api(Entry::cuMemcpyDtoDAsync_v2, || {
        let d = double()?;
        let s = d.stream(stream)?;
        d.require_current(&s, "cuMemcpyDtoDAsync")?;
        let n = count as u64;
        // Checked now (a bad range is the call's violation), resolved again by every build.
        d.memory.resolve(dst, n)?;
        d.memory.resolve(src, n)?;
        if n > 0 && dst < src.saturating_add(n) && src < dst.saturating_add(n) {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("overlapping copy of {n} bytes from {src:#x} to {dst:#x}"),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        // Resolved again whenever the work is built (a replay of a capture: memory unmapped or
        // freed since is a violation of that launch, never a fault of the process).
        let make: Maker = Arc::new(move || {
            let memory = &double()?.memory;
            let (to, to_offset) = memory.resolve(dst, n)?;
            let (from, from_offset) = memory.resolve(src, n)?;
            Ok(Box::new(move || {
                to.check_live("cuMemcpyDtoDAsync (destination)")?;
                from.check_live("cuMemcpyDtoDAsync (source)")?;
                // SAFETY: both ranges are inside live allocations; `copy` tolerates the same
                // mapping appearing twice (overlap was refused above).
                unsafe { std::ptr::copy(from.at(from_offset), to.at(to_offset), count) };
                Ok(())
            }) as Work)
        });
        d.enqueue_node(
            &s,
            Entry::cuMemcpyDtoDAsync_v2,
            vec![(dst, n), (src, n)],
            make,
        )
    })
}

/// `cuMemsetD8Async`.
#[no_mangle]
pub extern "C" fn cuMemsetD8Async(
    dst: u64,
    value: u8,
    count: usize,
    stream: *mut c_void,
) -> CuResult {
    api(Entry::cuMemsetD8Async, || {
        let d = double()?;
        let s = d.stream(stream)?;
        d.require_current(&s, "cuMemsetD8Async")?;
        d.memory.resolve(dst, count as u64)?;
        if count == 0 {
            return Ok(());
        }
        // Resolved again whenever the work is built (see cuMemcpyDtoDAsync_v2).
        let make: Maker = Arc::new(move || {
            let (a, offset) = double()?.memory.resolve(dst, count as u64)?;
            Ok(Box::new(move || {
                a.check_live("cuMemsetD8Async")?;
                // SAFETY: the range is inside the live allocation.
                unsafe { std::ptr::write_bytes(a.at(offset), value, count) };
                Ok(())
            }) as Work)
        });
        d.enqueue_node(&s, Entry::cuMemsetD8Async, vec![(dst, count as u64)], make)
    })
}

/// A queued copy's page-locked host range must still be locked when the stream reaches it.
fn check_locked(locked: &crate::host::Locked, call: &str) -> crate::report::Checked<()> {
    if locked.live.load(Ordering::Acquire) {
        Ok(())
    } else {
        Err(Fail::violation(
            codes::INVALID_VALUE,
            format!("{call} ran after its page-locked host memory was freed or unregistered"),
        ))
    }
}
