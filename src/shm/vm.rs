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

/// The seals every chunk carries once backed: its size is final (no process holding its descriptor
/// can shrink it, which would make every mapping of the cut pages fault with `SIGBUS`, nor grow it)
/// and the seals themselves are final.
const CHUNK_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A chunk of physical memory: a `memfd` of `len` bytes, sealed at that size ([`CHUNK_SEALS`]).
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
        let raw = unsafe {
            libc::memfd_create(
                c"cudalloc-chunk".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(os("memfd_create"));
        }
        // SAFETY: `raw` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: the descriptor is open; posix_fallocate only changes its allocation.
        let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, size) };
        match rc {
            0 => {
                // SAFETY: the descriptor is open; F_ADD_SEALS only changes what it permits.
                if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, CHUNK_SEALS) } != 0 {
                    return Err(os("fcntl(F_ADD_SEALS)"));
                }
                Ok(Chunk { fd, len })
            }
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

    /// A chunk from a descriptor another process exported; it must hold exactly `len` bytes and be
    /// sealed at that size (else its exporter could cut pages this process maps: `SIGBUS`).
    pub(crate) fn import(fd: OwnedFd, len: u64) -> Result<Self> {
        // SAFETY: the descriptor is open; F_GET_SEALS only reads its seals.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & CHUNK_SEALS != CHUNK_SEALS {
            return Err(Error::bad_handle(format!(
                "the chunk descriptor is not sealed at its size (seals {seals:#x}, needed \
                 {CHUNK_SEALS:#x}): its exporter could shrink it under this process's mappings"
            )));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_holding_a_chunks_descriptor_cannot_change_its_size() {
        let chunk = Chunk::create(2 << 20).unwrap();
        let peer = File::from(chunk.export().unwrap());
        // What a hostile consumer would do: cut the chunk under the producer's mappings.
        let shrink = peer.set_len(4096).unwrap_err();
        assert_eq!(shrink.raw_os_error(), Some(libc::EPERM), "{shrink}");
        let grow = peer.set_len(4 << 20).unwrap_err();
        assert_eq!(grow.raw_os_error(), Some(libc::EPERM), "{grow}");
        assert_eq!(peer.metadata().unwrap().len(), 2 << 20);
        // The last page is still backed: touching it is no SIGBUS.
        chunk
            .with_mapping(|addr, len| {
                // SAFETY: the mapping covers `len` bytes; the last one is written and read back.
                unsafe {
                    let last = (addr + len - 1) as *mut u8;
                    last.write_volatile(7);
                    assert_eq!(last.read_volatile(), 7);
                }
            })
            .unwrap();
        // And its seals cannot be lifted or added to.
        // SAFETY: valid descriptor; F_ADD_SEALS only changes what it permits.
        let rc = unsafe { libc::fcntl(peer.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert_eq!(rc, -1);
    }

    #[test]
    fn a_chunk_descriptor_that_is_not_sealed_is_refused() {
        // SAFETY: a static NUL-terminated name and valid flags.
        let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: `raw` is a fresh descriptor owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        File::from(fd.try_clone().unwrap()).set_len(4096).unwrap();
        let err = Chunk::import(fd, 4096).unwrap_err();
        assert!(err.to_string().contains("not sealed"), "{err}");
        let sealed = Chunk::create(4096).unwrap();
        assert_eq!(
            Chunk::import(sealed.export().unwrap(), 4096).unwrap().len(),
            4096
        );
    }
}
