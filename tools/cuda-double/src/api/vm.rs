//! The virtual-memory entry points (the state and the rules are in `vm.rs`).

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{api, put};
use crate::codes::{self, CuResult};
use crate::memory::{Allocation, Backing, Origin};
use crate::region::{Header, Region};
use crate::report::{Checked, Entry, Fail};
use crate::state::{double, Double};
use crate::vm::{
    check_location, check_prop, AccessDesc, AllocationProp, PhysChunk, VmRange, CHUNK_MAGIC,
    GRANULARITY, HANDLE_POSIX_FD,
};

fn granular(what: &str, size: u64) -> Checked<()> {
    if size == 0 || size % GRANULARITY != 0 {
        return Err(Fail::violation(
            codes::INVALID_VALUE,
            format!(
                "{what} of {size} bytes: a positive multiple of the granularity ({GRANULARITY})"
            ),
        ));
    }
    Ok(())
}

/// The reservation holding `[ptr, ptr + len)` and the offset of `ptr` in it.
fn reservation(d: &Double, ptr: u64, len: u64) -> Checked<(Arc<Allocation>, Arc<VmRange>, u64)> {
    let (a, offset) = d.memory.resolve_reserved(ptr, len)?;
    let vm = a.reserved().cloned().ok_or_else(|| {
        Fail::violation(
            codes::INVALID_VALUE,
            format!("{ptr:#x} is not in a range reserved with cuMemAddressReserve"),
        )
    })?;
    Ok((a, vm, offset))
}

fn chunk(d: &Double, handle: u64) -> Checked<Arc<PhysChunk>> {
    match d
        .memory
        .chunks
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&handle)
    {
        Some(Some(c)) => Ok(c.clone()),
        Some(None) => Err(Fail::violation(
            codes::INVALID_VALUE,
            format!("allocation handle {handle} was already released"),
        )),
        None => Err(Fail::violation(
            codes::INVALID_VALUE,
            format!("{handle} is not an allocation handle the driver returned"),
        )),
    }
}

fn register(d: &Double, c: PhysChunk) -> u64 {
    let handle = d.memory.fresh_id();
    d.memory
        .chunks
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(handle, Some(Arc::new(c)));
    handle
}

/// `cuMemGetAllocationGranularity`.
///
/// # Safety
/// `granularity` valid for a write; `prop` valid for a read.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const AllocationProp,
    option: u32,
) -> CuResult {
    api(Entry::cuMemGetAllocationGranularity, || {
        let d = double()?;
        if prop.is_null() || option > 1 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("null prop or option {option}"),
            ));
        }
        // SAFETY: non-null; the caller passes a valid CUmemAllocationProp.
        check_prop(unsafe { &*prop }, d.devices.len())?;
        // SAFETY: caller's out-pointer.
        unsafe { put(granularity, GRANULARITY as usize, "granularity") }
    })
}

/// `cuMemAddressReserve` (alignment 0 or a power of two; no fixed address; flags 0).
///
/// # Safety
/// `ptr` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut u64,
    size: usize,
    alignment: usize,
    addr: u64,
    flags: u64,
) -> CuResult {
    api(Entry::cuMemAddressReserve, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemAddressReserve")?;
        let ctx = d.current()?;
        granular("cuMemAddressReserve", size as u64)?;
        if (alignment != 0 && !alignment.is_power_of_two())
            || addr != 0
            || flags != 0
            || ptr.is_null()
        {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemAddressReserve alignment {alignment}, addr {addr:#x}, flags {flags}"),
            ));
        }
        let size = size as u64;
        let base = d.memory.place(ctx.device, size)?;
        let range = Arc::new(VmRange::new(size)?);
        d.memory.insert(Arc::new(Allocation {
            base,
            size,
            device: ctx.device,
            ctx: ctx.handle,
            origin: Origin::Reserved,
            backing: Backing::Reserved(range),
            released: false.into(),
        }));
        // SAFETY: checked non-null; caller's out-pointer.
        unsafe { ptr.write(base) };
        Ok(())
    })
}

/// `cuMemAddressFree`: a whole reservation with nothing mapped.
#[no_mangle]
pub extern "C" fn cuMemAddressFree(ptr: u64, size: usize) -> CuResult {
    api(Entry::cuMemAddressFree, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemAddressFree")?;
        d.memory.remove(ptr, |a| match a.reserved() {
            Some(vm) if a.size == size as u64 && vm.is_empty() => Ok(()),
            Some(_) if a.size != size as u64 => Err(Fail::violation(
                codes::INVALID_VALUE,
                format!(
                    "cuMemAddressFree of {size} bytes of a {}-byte reservation",
                    a.size
                ),
            )),
            Some(_) => Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemAddressFree of {ptr:#x} with chunks still mapped: unmap before free"),
            )),
            None => Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("{ptr:#x} was not reserved with cuMemAddressReserve"),
            )),
        })?;
        Ok(())
    })
}

/// `cuMemCreate` (flags 0); counts against the device's capacity.
///
/// # Safety
/// `handle` valid for a write; `prop` valid for a read.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const AllocationProp,
    flags: u64,
) -> CuResult {
    api(Entry::cuMemCreate, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemCreate")?;
        d.current()?;
        if prop.is_null() || flags != 0 || handle.is_null() {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemCreate null prop/handle or flags {flags}"),
            ));
        }
        // SAFETY: non-null; the caller passes a valid CUmemAllocationProp.
        let (device, exportable) = check_prop(unsafe { &*prop }, d.devices.len())?;
        granular("cuMemCreate", size as u64)?;
        let size = size as u64;
        let dev = &d.devices[device];
        dev.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(size).filter(|&n| n <= dev.total)
            })
            .map_err(|u| {
                Fail::outcome(
                    codes::OUT_OF_MEMORY,
                    format!("{size} bytes; {u} of {} in use", dev.total),
                )
            })?;
        let region = Region::create(Header {
            magic: CHUNK_MAGIC,
            pid: d.pid,
            device: device as u32,
            id: d.memory.fresh_id(),
            size,
        })
        .inspect_err(|_| {
            dev.used.fetch_sub(size, Ordering::AcqRel);
        })?;
        let h = register(
            d,
            PhysChunk {
                device,
                size,
                exportable,
                imported: false,
                region,
            },
        );
        // SAFETY: checked non-null; caller's out-pointer.
        unsafe { handle.write(h) };
        Ok(())
    })
}

/// `cuMemRelease`: the memory goes when its last mapping is unmapped.
#[no_mangle]
pub extern "C" fn cuMemRelease(handle: u64) -> CuResult {
    api(Entry::cuMemRelease, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemRelease")?;
        let c = chunk(d, handle)?;
        d.memory
            .chunks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(handle, None);
        if !c.imported {
            d.devices[c.device].used.fetch_sub(c.size, Ordering::AcqRel);
        }
        Ok(())
    })
}

/// `cuMemMap` (offset 0, flags 0).
#[no_mangle]
pub extern "C" fn cuMemMap(
    ptr: u64,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> CuResult {
    api(Entry::cuMemMap, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemMap")?;
        if offset != 0 || flags != 0 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemMap offset {offset} / flags {flags}: both must be 0"),
            ));
        }
        let c = chunk(d, handle)?;
        let (a, vm, at) = reservation(d, ptr, 0)?;
        if a.device != c.device {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!(
                    "a chunk of device {} mapped into a reservation made on device {}",
                    c.device, a.device
                ),
            ));
        }
        vm.map(at, size as u64, c)
    })
}

/// `cuMemSetAccess` (one or more descriptors; the range must be mapped throughout).
///
/// # Safety
/// `desc` valid for `count` reads.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: u64,
    size: usize,
    desc: *const AccessDesc,
    count: usize,
) -> CuResult {
    api(Entry::cuMemSetAccess, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemSetAccess")?;
        if desc.is_null() || count == 0 {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                "cuMemSetAccess without descriptors",
            ));
        }
        // SAFETY: the caller passes `count` valid descriptors.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        let mut flags = 0;
        for (i, desc) in descs.iter().enumerate() {
            check_location(&format!("desc[{i}]"), &desc.location, d.devices.len())?;
            if ![0, 1, 3].contains(&desc.flags) {
                return Err(Fail::violation(
                    codes::INVALID_VALUE,
                    format!("desc[{i}].flags {:#x}", desc.flags),
                ));
            }
            flags = flags.max(desc.flags);
        }
        let (_, vm, at) = reservation(d, ptr, 0)?;
        vm.set_access(at, size as u64, flags)
    })
}

/// `cuMemUnmap`: one whole mapping that no queued or running device work uses.
#[no_mangle]
pub extern "C" fn cuMemUnmap(ptr: u64, size: usize) -> CuResult {
    api(Entry::cuMemUnmap, || {
        let d = double()?;
        d.captures.check_unsafe("cuMemUnmap")?;
        let (_, vm, at) = reservation(d, ptr, 0)?;
        let busy = d
            .devices
            .iter()
            .flat_map(|dev| dev.context.all_streams())
            .any(|s| s.touches(ptr, size as u64));
        if busy {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("cuMemUnmap of {ptr:#x} while queued device work uses it: the memory must not be in use"),
            ));
        }
        vm.unmap(at, size as u64)
    })
}

/// `cuMemExportToShareableHandle` (POSIX file descriptor; the chunk must be exportable).
///
/// # Safety
/// `shareable` valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: u64,
    kind: u32,
    flags: u64,
) -> CuResult {
    api(Entry::cuMemExportToShareableHandle, || {
        let d = double()?;
        let c = chunk(d, handle)?;
        if kind != HANDLE_POSIX_FD || flags != 0 || !c.exportable || c.imported {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("export as type {kind} (flags {flags}) of a chunk created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, or imported"),
            ));
        }
        // SAFETY: the region's descriptor is open for the chunk's life; dup gives a new one the
        // caller owns.
        let fd = unsafe { libc::fcntl(c.region.fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(Fail::outcome(codes::OPERATING_SYSTEM, "dup failed"));
        }
        // SAFETY: caller's out-pointer of an int.
        unsafe { put(shareable.cast::<libc::c_int>(), fd, "shareableHandle") }
    })
}

/// `cuMemImportFromShareableHandle` (POSIX file descriptor; the descriptor stays the caller's).
///
/// # Safety
/// `handle` valid for a write; `os_handle` carries an open descriptor.
#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut u64,
    os_handle: *mut c_void,
    kind: u32,
) -> CuResult {
    api(Entry::cuMemImportFromShareableHandle, || {
        let d = double()?;
        if kind != HANDLE_POSIX_FD || handle.is_null() {
            return Err(Fail::violation(
                codes::INVALID_VALUE,
                format!("import of handle type {kind}"),
            ));
        }
        let raw = os_handle as usize as libc::c_int;
        // SAFETY: the caller passes an open descriptor, borrowed for this call only.
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        let owned = fd
            .try_clone_to_owned()
            .map_err(|e| Fail::rejected(codes::INVALID_VALUE, format!("descriptor {raw}: {e}")))?;
        let region = Region::adopt(owned, CHUNK_MAGIC)?;
        let header = region.header();
        let h = register(
            d,
            PhysChunk {
                device: header.device as usize,
                size: header.size,
                exportable: false,
                imported: true,
                region,
            },
        );
        let _ = fd.as_raw_fd();
        // SAFETY: checked non-null; caller's out-pointer.
        unsafe { handle.write(h) };
        Ok(())
    })
}
