//! Virtual memory on the host, for the host backend's expandable segments: the same objects as
//! CUDA's virtual-memory API, made of real memory.
//!
//! | CUDA                               | here                                                     |
//! |------------------------------------|----------------------------------------------------------|
//! | `cuMemAddressReserve`              | [`Reservation`]: an inaccessible (`PROT_NONE`) mapping of the range |
//! | `cuMemCreate` (POSIX fd handle)    | [`Chunk::create`]: a range of an [`Arena`] (a sealed `memfd`), backed up front (`posix_fallocate`) |
//! | `cuMemMap` + `cuMemSetAccess`      | [`Reservation::map`]: the chunk's range mapped `MAP_FIXED \| MAP_SHARED` over its place |
//! | `cuMemUnmap`                       | [`Reservation::unmap`]: the place made inaccessible again (the range stays reserved) |
//! | `cuMemRelease` (last reference)    | [`Chunk`]'s drop: a hole punched in the arena, the range free for the next chunk |
//! | `cuMemExportToShareableHandle`     | [`Chunk::export`]: a duplicate of the arena's descriptor and the chunk's offset (for `SCM_RIGHTS`) |
//! | `cuMemImportFromShareableHandle`   | [`Chunk::import`]: a received descriptor, its seals and size checked; one descriptor kept per foreign arena |
//!
//! **Few descriptors.** Chunks are carved from arenas of [`ARENA_BYTES`] (first fit, freed ranges
//! merged), so a device needs one descriptor per arena, not one per 2 MiB page: with
//! `ulimit -n 1024` the host backend used to stop at about 2 GiB with a driver error (EMFILE); now
//! 1,024 descriptors hold 256 GiB, and running out of them is out-of-memory saying why
//! ([`is_out_of_descriptors`]). Imported arenas are deduplicated by inode, so a consumer holds one
//! descriptor per producer arena too.
//!
//! **What a receiver reaches.** A chunk's descriptor is its arena's: a process given one chunk can
//! map the other chunks of that arena (memory of the same producer), as a CUDA IPC handle reaches
//! a whole allocation and not one tensor. Peers are processes of our own user, which could read
//! the producer's memory through `/proc` anyway; the page socket decides who gets a descriptor.
//! Arenas are sealed at their size from creation, so no holder can cut pages under a mapping
//! (`SIGBUS`); punching holes stays possible for every holder (it needs no seal to be lifted), and
//! reads as zeros, never as a signal.
//!
//! An owned chunk's memory lives until the chunk's last reference in this process goes (the
//! driver's table and its mappings): then its pages go back to the system — another process that
//! still maps them sees zeros, which only happens after it released its count. An access to an
//! unmapped place of a reservation faults, as on a device; the driver checks ranges before any
//! access, so that never happens through cudalloc.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};

use rustix::fs::{fcntl_add_seals, memfd_create, FallocateFlags, MemfdFlags, SealFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};
use crate::process::PerProcess;
use crate::sync::os::{Arc, Mutex, Weak};

fn os(call: &'static str) -> Error {
    Error::host_os(call, std::io::Error::last_os_error())
}

fn failed(call: &'static str, err: Errno) -> Error {
    Error::host_os(call, std::io::Error::from(err))
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
        let file_offset = libc::off_t::try_from(chunk.offset)
            .map_err(|_| Error::invalid("chunk offset exceeds the file offset type"))?;
        // SAFETY: `[at, at + chunk.len)` lies inside our own reservation (checked), so MAP_FIXED
        // replaces only pages of this reservation; the arena's descriptor is open and holds the
        // chunk's `len` bytes at its offset (checked at creation or import).
        let mapped = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                chunk.len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                chunk.arena.fd.as_raw_fd(),
                file_offset,
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

/// The seals every arena carries from its creation: its size is final (no process holding its
/// descriptor can shrink it, which would make every mapping of the cut pages fault with `SIGBUS`,
/// nor grow it) and the seals themselves are final.
const ARENA_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// Bytes of one arena: the chunks of this process share memfds of this size (a chunk larger than
/// it gets an arena of its own size), so a device of `n` bytes needs `n / ARENA_BYTES`
/// descriptors, not one per page.
pub(crate) const ARENA_BYTES: u64 = 256 << 20;

/// The `call` of the error that says the process ran out of descriptors (`EMFILE`/`ENFILE`):
/// callers that create device memory turn it into out-of-memory.
pub(crate) const NO_DESCRIPTORS_CALL: &str = "memfd_create (EMFILE)";

/// Whether `err` says that the process (or the system) has no descriptor left for a new arena.
pub(crate) fn is_out_of_descriptors(err: &Error) -> bool {
    matches!(err, Error::Driver { call, .. } if *call == NO_DESCRIPTORS_CALL)
}

/// One memfd holding many chunks at offsets: sparse at creation, each chunk's pages backed when
/// the chunk is made and given back (a punched hole) when it goes.
#[derive(Debug)]
pub(crate) struct Arena {
    fd: OwnedFd,
    /// Free ranges `start → length` (arenas this process made; empty for imported ones).
    free: Mutex<BTreeMap<u64, u64>>,
}

impl Arena {
    fn create(len: u64) -> Result<Arena> {
        let fd = match memfd_create(
            c"cudalloc-chunks",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        ) {
            Ok(fd) => fd,
            Err(err @ (Errno::MFILE | Errno::NFILE)) => {
                return Err(Error::Driver {
                    source: None,
                    backend: "host",
                    call: NO_DESCRIPTORS_CALL,
                    message: format!(
                        "no descriptor left for another arena of device memory ({}; the \
                         process's open-file limit, `ulimit -n`, bounds the host backend's \
                         device memory at {} MiB per descriptor)",
                        std::io::Error::from(err),
                        ARENA_BYTES >> 20
                    ),
                })
            }
            Err(err) => return Err(Error::host_os("memfd_create", std::io::Error::from(err))),
        };
        rustix::fs::ftruncate(&fd, len).map_err(|e| failed("ftruncate", e))?;
        fcntl_add_seals(&fd, ARENA_SEALS).map_err(|e| failed("fcntl(F_ADD_SEALS)", e))?;
        Ok(Arena {
            fd,
            free: Mutex::new(BTreeMap::from([(0, len)])),
        })
    }

    /// Takes `len` bytes (first fit); their offset.
    fn take(&self, len: u64) -> Option<u64> {
        let mut free = self.free.lock();
        let (&start, &have) = free.iter().find(|(_, &have)| have >= len)?;
        free.remove(&start);
        if have > len {
            free.insert(start + len, have - len);
        }
        Some(start)
    }

    /// Gives `[offset, offset + len)` back, merging with its free neighbours.
    fn give_back(&self, offset: u64, len: u64) {
        let mut free = self.free.lock();
        let (mut start, mut end) = (offset, offset + len);
        if let Some((&before, &before_len)) = free.range(..start).next_back() {
            if before + before_len == start {
                free.remove(&before);
                start = before;
            }
        }
        if let Some(&after_len) = free.get(&end) {
            free.remove(&end);
            end += after_len;
        }
        free.insert(start, end - start);
    }

    /// Backs `[offset, offset + len)` now: no room is out of memory, never a fault on first touch.
    fn back(&self, offset: u64, len: u64) -> Result<()> {
        match rustix::fs::fallocate(&self.fd, FallocateFlags::empty(), offset, len) {
            Ok(()) => Ok(()),
            Err(Errno::NOSPC | Errno::NOMEM) => Err(Error::Driver {
                source: None,
                backend: "host",
                call: super::NO_SPACE_CALL,
                message: format!("no memory to back a chunk of {len} bytes"),
            }),
            Err(err) => Err(failed("fallocate", err)),
        }
    }

    /// Gives the memory of `[offset, offset + len)` back to the system (a hole reads as zeros).
    fn punch(&self, offset: u64, len: u64) {
        let hole = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        if let Err(err) = rustix::fs::fallocate(&self.fd, hole, offset, len) {
            tracing::debug!(%err, "punching a released chunk failed");
        }
    }

    fn identity(fd: &OwnedFd) -> Result<(u64, u64, u64)> {
        let meta = File::from(fd.try_clone().map_err(|e| Error::host_os("dup", e))?)
            .metadata()
            .map_err(|e| Error::host_os("fstat", e))?;
        use std::os::unix::fs::MetadataExt;
        Ok((meta.dev(), meta.ino(), meta.len()))
    }
}

/// The arenas this process made (chunks are carved from them) and the ones it imported (by
/// device and inode, so chunks of one foreign arena share one descriptor here too).
#[derive(Debug, Default)]
struct Arenas {
    own: Vec<Arc<Arena>>,
    imported: HashMap<(u64, u64), Weak<Arena>>,
}

static ARENAS: PerProcess<Mutex<Arenas>> = PerProcess::new(|| Mutex::new(Arenas::default()));

/// A chunk of physical memory: `len` bytes at `offset` of an arena (a sealed memfd).
#[derive(Debug)]
pub(crate) struct Chunk {
    arena: Arc<Arena>,
    offset: u64,
    len: u64,
    /// Made here: its range goes back to the arena (and its pages to the system) on drop.
    owned: bool,
}

impl Chunk {
    /// Creates a zero-filled chunk, backed now: no room is out of memory
    /// ([`super::is_no_space`]), never a fault on first touch; no descriptor for a new arena is
    /// [`is_out_of_descriptors`].
    pub(crate) fn create(len: u64) -> Result<Self> {
        if len == 0 || !len.is_multiple_of(4096) {
            return Err(Error::invalid(format!(
                "a chunk of {len} bytes: a positive multiple of 4096 (chunks are mapped at their \
                 offsets in an arena)"
            )));
        }
        let (arena, offset) = {
            let mut arenas = ARENAS.get().lock();
            let found = arenas
                .own
                .iter()
                .find_map(|a| a.take(len).map(|at| (Arc::clone(a), at)));
            match found {
                Some(found) => found,
                None => {
                    let arena = Arc::new(Arena::create(len.max(ARENA_BYTES))?);
                    let at = arena
                        .take(len)
                        .ok_or_else(|| Error::invalid("a fresh arena has no room"))?;
                    arenas.own.push(Arc::clone(&arena));
                    (arena, at)
                }
            }
        };
        let chunk = Chunk {
            arena,
            offset,
            len,
            owned: true,
        };
        // Dropped on failure: the range goes back.
        chunk.arena.back(offset, len)?;
        Ok(chunk)
    }

    /// A chunk another process exported: `len` bytes at `offset` of the arena `fd`, which must be
    /// sealed at its size (else its exporter could cut pages this process maps: `SIGBUS`) and hold
    /// the whole range.
    pub(crate) fn import(fd: OwnedFd, offset: u64, len: u64) -> Result<Self> {
        let seals = rustix::fs::fcntl_get_seals(&fd).unwrap_or(SealFlags::empty());
        if !seals.contains(ARENA_SEALS) {
            return Err(Error::bad_handle(format!(
                "the chunk descriptor is not sealed at its size (seals {:#x}, needed {:#x}): its \
                 exporter could shrink it under this process's mappings",
                seals.bits(),
                ARENA_SEALS.bits()
            )));
        }
        let (dev, ino, size) = Arena::identity(&fd)?;
        let fits = offset.checked_add(len).is_some_and(|end| end <= size);
        if !fits || len == 0 || !offset.is_multiple_of(4096) {
            return Err(Error::bad_handle(format!(
                "the chunk descriptor holds {size} bytes; the handle names {len} bytes at offset \
                 {offset}"
            )));
        }
        let mut arenas = ARENAS.get().lock();
        let arena = match arenas.imported.get(&(dev, ino)).and_then(Weak::upgrade) {
            // Already open here: the new descriptor is closed, the known one serves.
            Some(known) => known,
            None => {
                let arena = Arc::new(Arena {
                    fd,
                    free: Mutex::new(BTreeMap::new()),
                });
                arenas.imported.retain(|_, weak| weak.strong_count() > 0);
                arenas.imported.insert((dev, ino), Arc::downgrade(&arena));
                arena
            }
        };
        Ok(Chunk {
            arena,
            offset,
            len,
            owned: false,
        })
    }

    /// Bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Runs `f` with a temporary shared mapping of the whole chunk: `(address, length)`.
    pub(crate) fn with_mapping(&self, f: impl FnOnce(usize, usize)) -> Result<()> {
        let len = usize::try_from(self.len)
            .map_err(|_| Error::invalid("chunk exceeds the address space"))?;
        let offset = libc::off_t::try_from(self.offset)
            .map_err(|_| Error::invalid("chunk offset exceeds the file offset type"))?;
        // SAFETY: maps the chunk's `len` bytes (inside its arena, checked at creation or import)
        // where the kernel chooses; checked for MAP_FAILED and unmapped below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.arena.fd.as_raw_fd(),
                offset,
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

    /// A descriptor of this chunk's arena and the chunk's offset in it, to hand to another
    /// process. The receiver can reach the whole arena (the other chunks of this process in it),
    /// as a CUDA IPC handle reaches a whole allocation; see the module docs.
    pub(crate) fn export(&self) -> Result<(OwnedFd, u64)> {
        let fd = self
            .arena
            .fd
            .try_clone()
            .map_err(|e| Error::host_os("dup", e))?;
        Ok((fd, self.offset))
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if self.owned {
            self.arena.punch(self.offset, self.len);
            self.arena.give_back(self.offset, self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_holding_a_chunks_descriptor_cannot_change_its_size() {
        let chunk = Chunk::create(2 << 20).unwrap();
        let (fd, _) = chunk.export().unwrap();
        let peer = File::from(fd);
        let size = peer.metadata().unwrap().len();
        // What a hostile consumer would do: cut the arena under the producer's mappings.
        let shrink = peer.set_len(4096).unwrap_err();
        assert_eq!(shrink.raw_os_error(), Some(libc::EPERM), "{shrink}");
        let grow = peer.set_len(size + (4 << 20)).unwrap_err();
        assert_eq!(grow.raw_os_error(), Some(libc::EPERM), "{grow}");
        assert_eq!(peer.metadata().unwrap().len(), size);
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
        assert!(fcntl_add_seals(&peer, SealFlags::WRITE).is_err());
    }

    #[test]
    fn a_chunk_descriptor_that_is_not_sealed_or_too_small_is_refused() {
        let fd = memfd_create(c"unsealed", MemfdFlags::CLOEXEC).unwrap();
        File::from(fd.try_clone().unwrap()).set_len(4096).unwrap();
        let err = Chunk::import(fd, 0, 4096).unwrap_err();
        assert!(err.to_string().contains("not sealed"), "{err}");
        let sealed = Chunk::create(4096).unwrap();
        let (fd, offset) = sealed.export().unwrap();
        let err = Chunk::import(fd, ARENA_BYTES, 4096).unwrap_err();
        assert!(err.to_string().contains("holds"), "{err}");
        let (fd, _) = sealed.export().unwrap();
        assert_eq!(Chunk::import(fd, offset, 4096).unwrap().len(), 4096);
    }

    #[test]
    fn chunks_share_arenas_and_released_ranges_are_reused() {
        let page = 2 << 20;
        let chunks: Vec<Chunk> = (0..16).map(|_| Chunk::create(page).unwrap()).collect();
        let arenas: std::collections::HashSet<*const Arena> =
            chunks.iter().map(|c| Arc::as_ptr(&c.arena)).collect();
        // Other tests of this binary carve chunks at the same time: at most a few arenas.
        assert!(arenas.len() <= 4, "{} arenas for 16 pages", arenas.len());
        let (arena, offset) = (Arc::clone(&chunks[3].arena), chunks[3].offset);
        chunks[3]
            .with_mapping(|addr, _| {
                // SAFETY: the mapping covers the chunk; its first byte is written.
                unsafe { (addr as *mut u8).write_volatile(9) }
            })
            .unwrap();
        drop(chunks);
        // The released range reads as zeros again (its pages went back to the system). Other
        // tests carve chunks meanwhile: read it holding the arena's free list, while it is free.
        let again = Chunk {
            arena: Arc::clone(&arena),
            offset,
            len: page,
            owned: false,
        };
        let free = arena.free.lock();
        let still_free = free
            .range(..=offset)
            .next_back()
            .is_some_and(|(&start, &len)| offset + page <= start + len);
        if still_free {
            again
                .with_mapping(|addr, _| {
                    // SAFETY: as above; read only.
                    assert_eq!(unsafe { (addr as *const u8).read_volatile() }, 0);
                })
                .unwrap();
        }
        drop(free);
    }

    #[test]
    fn an_imported_arena_is_opened_once() {
        let a = Chunk::create(2 << 20).unwrap();
        let b = Chunk::create(2 << 20).unwrap();
        if !Arc::ptr_eq(&a.arena, &b.arena) {
            return; // another test's chunk took the rest of an arena in between
        }
        let (fa, oa) = a.export().unwrap();
        let (fb, ob) = b.export().unwrap();
        let ia = Chunk::import(fa, oa, 2 << 20).unwrap();
        let ib = Chunk::import(fb, ob, 2 << 20).unwrap();
        assert!(
            Arc::ptr_eq(&ia.arena, &ib.arena),
            "one descriptor per foreign arena"
        );
    }
}
