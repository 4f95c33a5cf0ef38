//! Virtual memory on the host, for the host backend's expandable segments: the same objects as
//! CUDA's virtual-memory API, made of real memory.
//!
//! | CUDA                               | here                                                     |
//! |------------------------------------|----------------------------------------------------------|
//! | `cuMemAddressReserve`              | [`Reservation`]: an inaccessible (`PROT_NONE`) mapping of the range |
//! | `cuMemCreate` (POSIX fd handle)    | [`Chunk`]: a `memfd`, backed up front (`posix_fallocate`) |
//! | `cuMemMap` + `cuMemSetAccess`      | [`Reservation::map`]: the chunk mapped `MAP_FIXED \| MAP_SHARED` over its place |
//! | `cuMemUnmap`                       | [`Reservation::unmap`]: the place made inaccessible again (the range stays reserved) |
//! | `cuMemExportToShareableHandle`     | [`Chunk::export`]: a duplicate of the descriptor (for `SCM_RIGHTS`) |
//! | `cuMemImportFromShareableHandle`   | [`Chunk::import`]: a received descriptor, its size checked |
//!
//! A chunk's memory is shared by every mapping of it, in this process or another that received its
//! descriptor, and lives until the last descriptor and mapping are gone. An access to an unmapped
//! place of a reservation faults, as on a device; the driver checks ranges before any access, so
//! that never happens through cudalloc.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result};

fn os(call: &'static str) -> Error {
    Error::host_os(call, std::io::Error::last_os_error())
}

/// A reserved, inaccessible address range.
#[derive(Debug)]
pub(crate) struct Reservation {
    base: usize,
    len: usize,
}

impl Reservation {
    /// Reserves `len` bytes of address space (no memory is committed).
    pub(crate) fn new(len: u64) -> Result<Self> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| Error::invalid(format!("cannot reserve {len} bytes")))?;
        // SAFETY: a fresh anonymous mapping chosen by the kernel; checked for MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os("mmap(PROT_NONE)"));
        }
        Ok(Reservation {
            base: base as usize,
            len,
        })
    }

    /// The first address of the range.
    pub(crate) fn base(&self) -> u64 {
        self.base as u64
    }

    fn place(&self, offset: u64, len: u64) -> Result<usize> {
        let fits = offset
            .checked_add(len)
            .is_some_and(|end| end <= self.len as u64);
        if !fits {
            return Err(Error::invalid(format!(
                "{len} bytes at offset {offset} leave the reservation of {} bytes",
                self.len
            )));
        }
        Ok(self.base + offset as usize)
    }

    /// Maps `chunk` read-write at `offset` (replacing whatever mapping was there).
    pub(crate) fn map(&self, offset: u64, chunk: &Chunk) -> Result<()> {
        let at = self.place(offset, chunk.len)?;
        // SAFETY: `[at, at + chunk.len)` lies inside our own reservation (checked), so MAP_FIXED
        // replaces only pages of this reservation; the descriptor is open and the chunk has
        // `len` bytes.
        let mapped = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                chunk.len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                chunk.fd.as_raw_fd(),
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(os("mmap(MAP_FIXED)"));
        }
        Ok(())
    }

    /// Makes `[offset, offset + len)` inaccessible again, keeping it reserved.
    pub(crate) fn unmap(&self, offset: u64, len: u64) -> Result<()> {
        let at = self.place(offset, len)?;
        // SAFETY: inside our own reservation (checked); an anonymous PROT_NONE mapping replaces
        // the chunk's pages, which no queued work uses any more (the driver drained its streams).
        let mapped = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(os("mmap(PROT_NONE, MAP_FIXED)"));
        }
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `new` and is released once; mapped chunks in it go with
        // it (their memory lives on while descriptors or other mappings hold it).
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// A chunk of physical memory: a `memfd` of `len` bytes.
#[derive(Debug)]
pub(crate) struct Chunk {
    fd: OwnedFd,
    len: u64,
}

impl Chunk {
    /// Creates a zero-filled chunk, backed now: no room is out of memory
    /// ([`super::is_no_space`]), never a fault on first touch.
    pub(crate) fn create(len: u64) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid("a chunk of 0 bytes"));
        }
        let size = libc::off_t::try_from(len)
            .map_err(|_| Error::invalid(format!("chunk of {len} bytes is too large")))?;
        // SAFETY: a static NUL-terminated name and valid flags.
        let raw = unsafe { libc::memfd_create(c"cudalloc-chunk".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os("memfd_create"));
        }
        // SAFETY: `raw` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: the descriptor is open; posix_fallocate only changes its allocation.
        let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, size) };
        match rc {
            0 => Ok(Chunk { fd, len }),
            libc::ENOSPC | libc::ENOMEM => Err(Error::Driver {
                backend: "host",
                call: super::NO_SPACE_CALL,
                message: format!("no memory to back a chunk of {len} bytes"),
            }),
            err => Err(Error::host_os(
                "posix_fallocate",
                std::io::Error::from_raw_os_error(err),
            )),
        }
    }

    /// A chunk from a descriptor another process exported; it must hold exactly `len` bytes.
    pub(crate) fn import(fd: OwnedFd, len: u64) -> Result<Self> {
        let size = File::from(fd.try_clone().map_err(|e| Error::host_os("dup", e))?)
            .metadata()
            .map_err(|e| Error::host_os("fstat", e))?
            .len();
        if size != len || len == 0 {
            return Err(Error::bad_handle(format!(
                "the chunk descriptor holds {size} bytes, the handle says {len}"
            )));
        }
        Ok(Chunk { fd, len })
    }

    /// Bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Runs `f` with a temporary shared mapping of the whole chunk: `(address, length)`.
    pub(crate) fn with_mapping(&self, f: impl FnOnce(usize, usize)) -> Result<()> {
        let len = usize::try_from(self.len)
            .map_err(|_| Error::invalid("chunk exceeds the address space"))?;
        // SAFETY: maps the chunk's `len` bytes where the kernel chooses; checked for MAP_FAILED
        // and unmapped below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(os("mmap"));
        }
        f(addr as usize, len);
        // SAFETY: the mapping made above, released once.
        unsafe { libc::munmap(addr, len) };
        Ok(())
    }

    /// A descriptor of this chunk to hand to another process.
    pub(crate) fn export(&self) -> Result<OwnedFd> {
        self.fd.try_clone().map_err(|e| Error::host_os("dup", e))
    }
}
