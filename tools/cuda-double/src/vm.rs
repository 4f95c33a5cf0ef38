//! Virtual memory: reservations (`cuMemAddressReserve`), physical chunks (`cuMemCreate`, POSIX
//! file-descriptor handles), mappings (`cuMemMap`) and access (`cuMemSetAccess`).
//!
//! A reservation is a device address range and an inaccessible host mapping of the same size;
//! mapping a chunk maps its `memfd` at the same offset of the host range, so a range across
//! adjacent chunks is contiguous for device work, as on a GPU.
//!
//! | place in a reservation        | device work on it                     | `cuMemUnmap`           |
//! |-------------------------------|---------------------------------------|------------------------|
//! | not mapped                    | violation (illegal address)           | violation              |
//! | mapped, access not set        | violation ("cuMemSetAccess first")    | ok (whole mapping)     |
//! | mapped, `PROT_READWRITE`      | ok                                    | ok (whole mapping no queued work uses) |
//!
//! Rules (each breach a violation): sizes and addresses are multiples of the granularity; every
//! field of `CUmemAllocationProp` and `CUmemAccessDesc` is valid (pinned device memory, a real
//! device, no Windows metadata, zero reserved bytes); `cuMemMap` takes offset 0 and flags 0 and
//! lands inside a reservation over nothing mapped; `cuMemUnmap` names one whole mapping and no
//! device work is pending (the memory must not be in use); `cuMemAddressFree` names a whole
//! reservation with nothing mapped; a chunk is exported only if it was created exportable.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::codes;
use crate::region::Region;
use crate::report::{Checked, Fail};

/// The granularity the double reports (CUDA's on current GPUs).
pub const GRANULARITY: u64 = 2 << 20;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub const HANDLE_POSIX_FD: u32 = 1;
/// Magic of a chunk's region.
pub const CHUNK_MAGIC: [u8; 8] = *b"CUDBLCHK";

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemLocation {
    /// `CUmemLocationType` (1: device).
    pub type_: u32,
    /// The device ordinal.
    pub id: libc::c_int,
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AllocationProp {
    /// `CUmemAllocationType` (1: pinned).
    pub type_: u32,
    /// `CUmemAllocationHandleType` bits.
    pub requested_handle_types: u32,
    /// Where the memory lives.
    pub location: MemLocation,
    /// Windows only: must be null here.
    pub win32_handle_meta_data: *mut libc::c_void,
    /// `compressionType`, `gpuDirectRDMACapable`, `usage` (u16), four reserved bytes.
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AccessDesc {
    /// The device given access.
    pub location: MemLocation,
    /// `CUmemAccess_flags` (0 none, 1 read, 3 read-write).
    pub flags: u32,
}

fn bad(rule: String) -> Fail {
    Fail::violation(codes::INVALID_VALUE, rule)
}

/// Checks a location names device `< devices`; returns its ordinal.
pub fn check_location(what: &str, loc: &MemLocation, devices: usize) -> Checked<usize> {
    if loc.type_ != 1 {
        return Err(bad(format!(
            "{what}.location.type is {} (only CU_MEM_LOCATION_TYPE_DEVICE)",
            loc.type_
        )));
    }
    usize::try_from(loc.id)
        .ok()
        .filter(|&d| d < devices)
        .ok_or_else(|| bad(format!("{what}.location.id {} is not a device", loc.id)))
}

/// Checks every field of an allocation property; returns (device, exportable as a POSIX fd).
pub fn check_prop(prop: &AllocationProp, devices: usize) -> Checked<(usize, bool)> {
    if prop.type_ != 1 {
        return Err(bad(format!(
            "prop.type is {} (only CU_MEM_ALLOCATION_TYPE_PINNED)",
            prop.type_
        )));
    }
    if prop.requested_handle_types & !HANDLE_POSIX_FD != 0 {
        return Err(bad(format!(
            "prop.requestedHandleTypes {:#x}: only CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR exists on Linux",
            prop.requested_handle_types
        )));
    }
    if !prop.win32_handle_meta_data.is_null() {
        return Err(bad("prop.win32HandleMetaData must be null on Linux".into()));
    }
    let [compression, rdma, usage_lo, usage_hi, r0, r1, r2, r3] = prop.alloc_flags;
    if compression != 0 || rdma > 1 || usage_lo != 0 || usage_hi != 0 || [r0, r1, r2, r3] != [0; 4]
    {
        return Err(bad(format!(
            "prop.allocFlags {:?}: unsupported or reserved bytes set",
            prop.alloc_flags
        )));
    }
    let device = check_location("prop", &prop.location, devices)?;
    Ok((device, prop.requested_handle_types & HANDLE_POSIX_FD != 0))
}

/// A physical chunk.
#[derive(Debug)]
pub struct PhysChunk {
    /// Its device.
    pub device: usize,
    /// Bytes.
    pub size: u64,
    /// Exportable as a POSIX file descriptor.
    pub exportable: bool,
    /// Imported from another process (not charged to capacity).
    pub imported: bool,
    /// The memory.
    pub region: Region,
}

#[derive(Debug)]
struct Mapping {
    len: u64,
    access: u32,
    _chunk: Arc<PhysChunk>,
}

/// The host side of a reservation.
#[derive(Debug)]
pub struct VmRange {
    host: usize,
    len: usize,
    mapped: Mutex<BTreeMap<u64, Mapping>>,
}

// SAFETY: the host range is owned by this value and only touched through raw pointers by device
// work that the double's rules keep inside mapped chunks; the table is behind a mutex.
unsafe impl Send for VmRange {}
// SAFETY: as for Send.
unsafe impl Sync for VmRange {}

impl VmRange {
    /// Reserves `len` inaccessible host bytes.
    pub fn new(len: u64) -> Checked<VmRange> {
        let len =
            usize::try_from(len).map_err(|_| Fail::outcome(codes::OUT_OF_MEMORY, "too large"))?;
        // SAFETY: a fresh anonymous mapping; checked for MAP_FAILED.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if host == libc::MAP_FAILED {
            return Err(Fail::outcome(
                codes::OUT_OF_MEMORY,
                "cannot reserve host address space",
            ));
        }
        Ok(VmRange {
            host: host as usize,
            len,
            mapped: Mutex::new(BTreeMap::new()),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Mapping>> {
        self.mapped.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The host address of `offset`.
    pub fn at(&self, offset: u64) -> *mut u8 {
        (self.host + offset as usize) as *mut u8
    }

    /// Whether anything is mapped.
    pub fn is_empty(&self) -> bool {
        self.table().is_empty()
    }

    /// Maps `chunk`'s first `len` bytes at `offset` (checked: aligned, inside, over nothing).
    pub fn map(&self, offset: u64, len: u64, chunk: Arc<PhysChunk>) -> Checked<()> {
        if offset % GRANULARITY != 0 || len % GRANULARITY != 0 || len == 0 || len > chunk.size {
            return Err(bad(format!(
                "cuMemMap of {len} bytes at offset {offset}: multiples of the granularity \
                 ({GRANULARITY}), at most the chunk's {} bytes",
                chunk.size
            )));
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.len as u64)
        {
            return Err(bad(format!(
                "cuMemMap of {len} bytes at offset {offset} leaves the reservation"
            )));
        }
        let mut table = self.table();
        let clash = table
            .range(..offset + len)
            .next_back()
            .is_some_and(|(&at, m)| at + m.len > offset);
        if clash {
            return Err(Fail::violation(
                codes::ALREADY_MAPPED,
                format!("cuMemMap over memory already mapped at offset {offset}"),
            ));
        }
        // SAFETY: inside our own reservation (checked), MAP_FIXED replaces only its pages; the
        // chunk's descriptor is open and holds at least `len` bytes after its header page.
        let mapped = unsafe {
            libc::mmap(
                (self.host + offset as usize) as *mut libc::c_void,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                chunk.region.fd(),
                crate::region::HEADER as libc::off_t,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(Fail::outcome(
                codes::OPERATING_SYSTEM,
                "mmap of a chunk failed",
            ));
        }
        table.insert(
            offset,
            Mapping {
                len,
                access: 0,
                _chunk: chunk,
            },
        );
        Ok(())
    }

    /// `cuMemSetAccess` over `[offset, offset + len)`, which must be mapped throughout.
    pub fn set_access(&self, offset: u64, len: u64, flags: u32) -> Checked<()> {
        let mut table = self.table();
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let (&start, m) = table
                .range_mut(..=at)
                .next_back()
                .filter(|(&s, m)| at < s + m.len)
                .ok_or_else(|| {
                    bad(format!(
                        "cuMemSetAccess over offset {at}, which is not mapped"
                    ))
                })?;
            m.access = flags;
            at = start + m.len;
        }
        Ok(())
    }

    /// Checks `[offset, offset + len)` is mapped with access set throughout.
    pub fn check_covered(&self, ptr: u64, offset: u64, len: u64) -> Checked<()> {
        let table = self.table();
        let mut at = offset;
        let end = offset + len;
        loop {
            let Some((&start, m)) = table
                .range(..=at)
                .next_back()
                .filter(|(&s, m)| at < s + m.len || (len == 0 && at == s + m.len))
            else {
                return Err(Fail::violation(
                    codes::ILLEGAL_ADDRESS,
                    format!("{len} bytes at {ptr:#x} touch reserved memory that is not mapped"),
                ));
            };
            if m.access != 3 {
                return Err(Fail::violation(
                    codes::ILLEGAL_ADDRESS,
                    format!("{len} bytes at {ptr:#x} touch a mapping whose access was not set to read-write (cuMemSetAccess)"),
                ));
            }
            if start + m.len >= end {
                return Ok(());
            }
            at = start + m.len;
        }
    }

    /// `cuMemUnmap` of exactly one whole mapping at `offset`.
    pub fn unmap(&self, offset: u64, len: u64) -> Checked<()> {
        let mut table = self.table();
        match table.get(&offset) {
            Some(m) if m.len == len => {}
            _ => {
                return Err(bad(format!(
                    "cuMemUnmap of {len} bytes at offset {offset}: not one whole mapped range \
                     (CUDA unmaps only entire mappings)"
                )))
            }
        }
        // SAFETY: inside our reservation; the pages become inaccessible again.
        let remapped = unsafe {
            libc::mmap(
                (self.host + offset as usize) as *mut libc::c_void,
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if remapped == libc::MAP_FAILED {
            return Err(Fail::outcome(codes::OPERATING_SYSTEM, "unmapping failed"));
        }
        table.remove(&offset);
        Ok(())
    }
}

impl Drop for VmRange {
    fn drop(&mut self) {
        // SAFETY: the range mapped by `new`, released once.
        unsafe { libc::munmap(self.host as *mut libc::c_void, self.len) };
    }
}
