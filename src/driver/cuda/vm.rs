//! The CUDA backend's virtual-memory API (expandable segments): `cuMemAddressReserve`,
//! `cuMemCreate` with POSIX file-descriptor handles, `cuMemMap` + `cuMemSetAccess`, `cuMemUnmap`,
//! `cuMemRelease`, `cuMemAddressFree`, and `cuMemExportToShareableHandle` /
//! `cuMemImportFromShareableHandle` for other processes.
//!
//! The bookkeeping is the one both backends share (`driver/vm_space.rs`): a mapping must be
//! aligned, inside a reservation of the chunk's device and over nothing mapped; an unmap names
//! whole mapped chunks and is made one `cuMemUnmap` per chunk (CUDA unmaps only whole mapped
//! ranges), after the streams drain; a reservation is freed only when nothing in it is mapped.
//! Memory operations check their ranges against mapped chunks (across adjacent chunks) with the
//! table's read lock held until the work is enqueued, as for segments.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::{check, CudaDriver};
use crate::driver::{ChunkId, DeviceAddr, ExportedChunk};
use crate::error::{Error, Result};

/// A chunk made or imported here.
#[derive(Debug, Clone, Copy)]
pub(super) struct CudaChunk {
    device: usize,
    handle: sys::CUmemGenericAllocationHandle,
    size: u64,
    imported: bool,
}

fn location(ordinal: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

/// The properties of every chunk: pinned device memory exportable as a POSIX file descriptor.
fn properties(ordinal: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is plain data; all-zero is its documented default before the
    // fields below are set (allocFlags zero, no win32 metadata).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = location(ordinal);
    prop
}

fn to_usize(size: u64) -> Result<usize> {
    usize::try_from(size)
        .map_err(|_| Error::invalid(format!("{size} bytes exceed the address space")))
}

impl CudaDriver {
    fn chunk(&self, chunk: ChunkId) -> Result<CudaChunk> {
        self.chunks.get(chunk.0)
    }

    /// A new chunk id for `chunk`.
    fn register_chunk(&self, chunk: CudaChunk) -> ChunkId {
        let id = self.fresh_id();
        self.chunks.insert(id, chunk);
        ChunkId(id)
    }

    /// The device's granularity, asked of the driver once (every create and map checks it).
    pub(super) fn granularity(&self, device: usize) -> Result<u64> {
        let dev = self.device(device)?;
        if let Some(&g) = dev.granularity.get() {
            return Ok(g);
        }
        let ordinal = dev.ordinal;
        self.bind(device)?;
        let prop = properties(ordinal);
        let mut granularity = 0usize;
        // SAFETY: out-pointer valid; `prop` is fully initialized.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(*dev.granularity.get_or_init(|| granularity as u64))
    }

    fn check_granular(&self, device: usize, what: &str, size: u64) -> Result<u64> {
        let g = self.granularity(device)?;
        if size == 0 || g == 0 || !size.is_multiple_of(g) {
            return Err(Error::invalid(format!(
                "{what} of {size} bytes: a positive multiple of the granularity ({g} bytes)"
            )));
        }
        Ok(g)
    }

    pub(super) fn reserve(&self, device: usize, size: u64) -> Result<DeviceAddr> {
        self.check_granular(device, "a reservation", size)?;
        self.bind(device)?;
        let mut base = 0;
        // SAFETY: out-pointer valid; no fixed address, default alignment, flags 0.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, to_usize(size)?, 0, 0, 0)
        })?;
        self.vm_table()?.write().insert(base, device, size);
        Ok(DeviceAddr(base))
    }

    pub(super) fn free_reservation(&self, base: DeviceAddr) -> Result<()> {
        let reservation = self.vm_table()?.write().remove(base.0)?;
        self.bind(reservation.device)?;
        // SAFETY: the range was reserved by cuMemAddressReserve with this size and nothing is
        // mapped in it (checked by `remove`); freed once (removed from the table).
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(base.0, to_usize(reservation.size)?)
        })
    }

    pub(super) fn create_chunk(&self, device: usize, size: u64) -> Result<ChunkId> {
        self.check_granular(device, "a chunk", size)?;
        self.bind(device)?;
        let prop = properties(self.device(device)?.ordinal);
        let mut handle = 0;
        // SAFETY: out-pointer valid; `prop` fully initialized; flags 0.
        let rc = unsafe { sys::cuMemCreate(&mut handle, to_usize(size)?, &prop, 0) };
        if rc == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(Error::OutOfMemory {
                device,
                requested: size,
                message: format!("cuMemCreate of {size} bytes: {rc:?}"),
            });
        }
        check("cuMemCreate", rc)?;
        Ok(self.register_chunk(CudaChunk {
            device,
            handle,
            size,
            imported: false,
        }))
    }

    pub(super) fn release_chunk(&self, chunk: ChunkId) -> Result<()> {
        let c = self.chunks.remove(chunk.0)?;
        self.bind(c.device)?;
        // SAFETY: a handle made or imported by this driver, removed from the table: released
        // once. Mappings of it stay valid until unmapped (CUDA's documented behaviour).
        check("cuMemRelease", unsafe { sys::cuMemRelease(c.handle) })
    }

    pub(super) fn map(&self, addr: DeviceAddr, chunk: ChunkId) -> Result<()> {
        let c = self.chunk(chunk)?;
        let granularity = self.granularity(c.device)?;
        self.bind(c.device)?;
        let mut vm = self.vm_table()?.write();
        let device = vm.check_map(addr.0, c.size, granularity)?;
        if device != c.device {
            return Err(Error::invalid(format!(
                "a chunk of device {} cannot be mapped into a reservation of device {device}",
                c.device
            )));
        }
        let size = to_usize(c.size)?;
        // SAFETY: `addr` is aligned inside a reservation of the chunk's device, over nothing
        // mapped (checked above with the table locked); the handle is live.
        check("cuMemMap", unsafe {
            sys::cuMemMap(addr.0, size, 0, c.handle, 0)
        })?;
        let access = sys::CUmemAccessDesc {
            location: location(self.device(device)?.ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range was just mapped; one fully initialized descriptor.
        let access_set = check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(addr.0, size, &access, 1)
        });
        if let Err(err) = access_set {
            // SAFETY: mapped just above and known to no one else.
            let unmapped = check("cuMemUnmap", unsafe { sys::cuMemUnmap(addr.0, size) });
            if let Err(unmap_err) = unmapped {
                tracing::error!(err = %unmap_err, addr = addr.0, size,
                    "unmapping a chunk whose access could not be set failed; the range stays mapped");
            }
            return Err(err);
        }
        vm.insert_mapping(addr.0, c.size, chunk)
    }

    pub(super) fn unmap(&self, addr: DeviceAddr, size: u64) -> Result<()> {
        let (device, taken) = {
            let mut vm = self.vm_table()?.write();
            let device = vm.device_of(addr.0)?;
            (device, vm.take_mappings(addr.0, size)?)
        };
        // Nothing new can name the range; let what was queued on it finish first.
        let mut result = self.synchronize_all().and_then(|()| self.bind(device));
        for (at, len, _) in &taken {
            // SAFETY: each range is exactly one mapped chunk, taken out of the table, and no
            // queued work uses it any more (drained above).
            let unmapped = to_usize(*len)
                .and_then(|n| check("cuMemUnmap", unsafe { sys::cuMemUnmap(*at, n) }));
            result = result.and(unmapped);
        }
        self.vm_table()?.write().finish_unmap(addr.0, size);
        result
    }

    pub(super) fn export_chunk(&self, chunk: ChunkId) -> Result<ExportedChunk> {
        let c = self.chunk(chunk)?;
        if c.imported {
            return Err(Error::invalid(
                "a chunk imported from another process cannot be exported again",
            ));
        }
        self.bind(c.device)?;
        let mut fd: libc::c_int = -1;
        // SAFETY: for POSIX file-descriptor handles the shareable handle is an `int` written
        // through the out-pointer; the handle was made exportable as one.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut libc::c_int).cast(),
                c.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(Error::Driver {
                source: None,
                backend: "cuda",
                call: "cuMemExportToShareableHandle",
                message: format!("returned descriptor {fd}"),
            });
        }
        // SAFETY: the driver handed us a new descriptor we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // One descriptor per chunk: the chunk is all of it.
        Ok(ExportedChunk { fd, offset: 0 })
    }

    pub(super) fn import_chunk(
        &self,
        device: usize,
        chunk: ExportedChunk,
        size: u64,
    ) -> Result<ChunkId> {
        if chunk.offset != 0 {
            return Err(Error::bad_handle(format!(
                "a CUDA chunk descriptor names one whole chunk; offset {} is not 0",
                chunk.offset
            )));
        }
        let fd = chunk.fd;
        self.check_granular(device, "an imported chunk", size)?;
        self.bind(device)?;
        let mut handle = 0;
        // SAFETY: for POSIX file-descriptor handles the OS handle is the descriptor's value cast
        // to a pointer; the descriptor stays open for the call (CUDA does not take it over; it is
        // closed when `fd` drops below).
        let rc = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        drop(fd);
        check("cuMemImportFromShareableHandle", rc).map_err(|e| match e {
            Error::Driver { message, .. } => Error::bad_handle(format!(
                "cuMemImportFromShareableHandle refused the descriptor: {message}"
            )),
            other => other,
        })?;
        Ok(self.register_chunk(CudaChunk {
            device,
            handle,
            size,
            imported: true,
        }))
    }
}
