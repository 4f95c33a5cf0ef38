//! Page-locked host memory on CUDA (`driver/host_memory.rs`): `cuMemHostAlloc` and
//! `cuMemHostRegister` with the PORTABLE flag (every context's copies can use it), their frees,
//! and the async copies.
//!
//! The driver keeps its own table of what it locked, as for segments: an async copy is only
//! enqueued when its host range lies in one entry, checked under the table's read lock until the
//! copy is enqueued; a free takes the entry out under the write lock, synchronizes every device
//! (queued copies finish first, as the host backend does) and only then frees or unregisters.
//! So a copy never reaches host memory CUDA no longer knows as locked, where it would silently
//! become a synchronous copy or read freed memory.

use std::collections::BTreeMap;
use std::ffi::c_void;

use cudarc::driver::sys;

use super::{check, CudaDriver};
use crate::driver::{ranges, DeviceAddr, HostAddr, StreamId};
use crate::error::{Error, Result};

/// `CU_MEMHOSTALLOC_PORTABLE`: the memory is page-locked for every context.
const HOST_ALLOC_PORTABLE: u32 = 0x01;
/// `CU_MEMHOSTREGISTER_PORTABLE`.
const HOST_REGISTER_PORTABLE: u32 = 0x01;

/// One page-locked range of the CUDA driver.
#[derive(Clone, Copy, Debug)]
pub(super) struct PinnedEntry {
    len: u64,
    registered: bool,
}

/// Base → entry.
pub(super) type PinnedTable = BTreeMap<u64, PinnedEntry>;

fn host_oom(requested: u64, call: &str, rc: sys::CUresult) -> Error {
    Error::HostOutOfMemory {
        requested,
        message: format!("{call} of {requested} bytes failed: {rc:?}"),
    }
}

impl CudaDriver {
    /// Binds a context for calls that belong to no device (device 0's primary context; the
    /// memory is portable).
    fn bind_any(&self) -> Result<()> {
        self.bind(0)
    }

    pub(super) fn pinned_alloc(&self, size: u64) -> Result<HostAddr> {
        if size == 0 {
            return Err(Error::invalid("host_alloc of 0 bytes"));
        }
        let bytes = usize::try_from(size)
            .map_err(|_| Error::invalid(format!("size {size} exceeds the address space")))?;
        self.bind_any()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; a context is current.
        let rc = unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, HOST_ALLOC_PORTABLE) };
        match rc {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(host_oom(size, "cuMemHostAlloc", rc))
            }
            other => check("cuMemHostAlloc", other)?,
        }
        let base = ptr as usize as u64;
        self.pinned_table()?.write().insert(
            base,
            PinnedEntry {
                len: size,
                registered: false,
            },
        );
        Ok(HostAddr(base))
    }

    /// Takes the entry at `ptr` out of the table, checking it was locked the way `want` frees.
    fn take_pinned(&self, ptr: HostAddr, registered: bool, want: &str) -> Result<PinnedEntry> {
        let mut table = self.pinned_table()?.write();
        match table.get(&ptr.0) {
            Some(e) if e.registered == registered => {}
            Some(_) => {
                return Err(Error::invalid(format!(
                "{want}: {ptr} was {} (free memory with the call that matches how it was locked)",
                if registered {
                    "allocated with host_alloc: use host_free"
                } else {
                    "registered: use host_unregister"
                }
            )))
            }
            None => {
                return Err(Error::invalid(format!(
                    "{want}: {ptr} is not the start of page-locked memory of this driver"
                )))
            }
        }
        table
            .remove(&ptr.0)
            .ok_or_else(|| Error::invalid("page-locked range vanished"))
    }

    /// Puts an entry back after a free that could not synchronize.
    fn restore_pinned(&self, ptr: HostAddr, entry: PinnedEntry) {
        self.pinned.write().insert(ptr.0, entry);
    }

    pub(super) fn pinned_free(&self, ptr: HostAddr) -> Result<()> {
        let entry = self.take_pinned(ptr, false, "host_free")?;
        if let Err(err) = self.synchronize_all() {
            self.restore_pinned(ptr, entry);
            return Err(err);
        }
        self.bind_any()?;
        // SAFETY: allocated by cuMemHostAlloc, out of the table, every device synchronized.
        check("cuMemFreeHost", unsafe {
            sys::cuMemFreeHost(ptr.as_ptr().cast())
        })
    }

    /// # Safety
    /// As [`Driver::host_register`](crate::backend::Driver::host_register).
    pub(super) unsafe fn pinned_register(&self, ptr: HostAddr, size: u64) -> Result<()> {
        if size == 0 {
            return Err(Error::invalid("host_register of 0 bytes"));
        }
        let end = ptr.offset(size)?;
        let bytes = usize::try_from(size)
            .map_err(|_| Error::invalid(format!("size {size} exceeds the address space")))?;
        let mut table = self.pinned_table()?.write();
        if let Some((&base, other)) = table.range(..end.0).next_back() {
            if base.saturating_add(other.len) > ptr.0 {
                return Err(Error::invalid(format!(
                    "host_register of {ptr} + {size} bytes overlaps page-locked memory at \
                     {base:#x} ({} bytes)",
                    other.len
                )));
            }
        }
        self.bind_any()?;
        // SAFETY: the caller promises the range is live memory of this process until
        // unregistered; a context is current.
        let rc = unsafe {
            sys::cuMemHostRegister_v2(ptr.as_ptr().cast(), bytes, HOST_REGISTER_PORTABLE)
        };
        match rc {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(host_oom(size, "cuMemHostRegister_v2", rc))
            }
            other => check("cuMemHostRegister_v2", other)?,
        }
        table.insert(
            ptr.0,
            PinnedEntry {
                len: size,
                registered: true,
            },
        );
        Ok(())
    }

    pub(super) fn pinned_unregister(&self, ptr: HostAddr) -> Result<()> {
        let entry = self.take_pinned(ptr, true, "host_unregister")?;
        if let Err(err) = self.synchronize_all() {
            self.restore_pinned(ptr, entry);
            return Err(err);
        }
        self.bind_any()?;
        // SAFETY: registered by cuMemHostRegister, out of the table, every device synchronized.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr.as_ptr().cast())
        })
    }

    /// Enqueues an async copy between page-locked memory and the device.
    pub(super) fn pinned_copy(
        &self,
        stream: StreamId,
        device: DeviceAddr,
        host: HostAddr,
        len: u64,
        to_device: bool,
    ) -> Result<()> {
        let (_held, n) = self.hold_ranges([(device, len)])?;
        let pinned = self.pinned_table()?.read();
        ranges::containing(&pinned, |e| e.len, DeviceAddr(host.0), len).map_err(|_| {
            Error::invalid(format!(
                "host range {host} + {len} bytes is not inside page-locked memory of this driver \
                 (host_alloc or host_register); copy pageable memory with copy_host_to_device / \
                 copy_device_to_host"
            ))
        })?;
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if to_device {
            // SAFETY: both ranges were checked under the tables' read locks, held until the copy
            // is enqueued; a free synchronizes every device after taking the write lock.
            check("cuMemcpyHtoDAsync_v2", unsafe {
                sys::cuMemcpyHtoDAsync_v2(device.0, host.as_ptr().cast(), n, s.raw.0)
            })
        } else {
            // SAFETY: as above.
            check("cuMemcpyDtoHAsync_v2", unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.as_ptr().cast(), device.0, n, s.raw.0)
            })
        }
    }

    /// Frees or unregisters what is left (the driver is dropped).
    pub(super) fn drop_pinned(&mut self) {
        let table = std::mem::take(&mut *self.pinned.write());
        if table.is_empty() || self.bind_any().is_err() {
            return;
        }
        for (base, entry) in table {
            let ptr = base as usize as *mut c_void;
            // SAFETY: each entry was locked by this driver and is freed once, here; the driver is
            // being dropped, so no copy of its can be enqueued any more.
            let (call, rc) = unsafe {
                if entry.registered {
                    ("cuMemHostUnregister", sys::cuMemHostUnregister(ptr))
                } else {
                    ("cuMemFreeHost", sys::cuMemFreeHost(ptr))
                }
            };
            super::log_teardown(call, rc);
        }
    }
}
