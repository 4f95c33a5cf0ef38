//! POSIX shared-memory objects: the only module that maps memory (`memmap2`). Used by the host
//! backend (segments, event chunks) and by IPC (ref-counter files).
//!
//! An object is a file in `/dev/shm` (what `shm_open` uses on Linux), created `0600` with
//! `O_CREAT | O_EXCL | O_NOFOLLOW` so a pre-planted file or symlink makes creation fail instead of
//! being used. Opening checks that the object is a regular file owned by our effective user and that
//! its size is what the caller expects. Names are validated before any file-system call: our prefix,
//! only `[A-Za-z0-9._-]`, no `..`, so a name read from another process cannot escape `/dev/shm`.
//!
//! Memory in an object is never turned into Rust references: it is shared with other processes (and
//! with the host backend's stream threads, which play the device), so it is only touched through raw
//! pointer copies by code that owns the ordering argument (see `kernels.rs`).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use memmap2::MmapRaw;

mod guard;
mod names;
pub(crate) mod socket;
pub(crate) mod vm;

pub use names::sweep_orphans;
use names::{ensure_liveness, forget_name, remember_name};
pub(crate) use names::{ofd_lock, REF_FILE_TAG};

use crate::error::{Error, Result};

/// A random 64-bit value (seeded by the OS through std's `RandomState`), for object-name nonces.
pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.finish()
}

/// Where POSIX shared-memory objects live on Linux.
pub(crate) const SHM_DIR: &str = "/dev/shm";

/// Every object cudalloc creates starts with this.
pub(crate) const NAME_PREFIX: &str = "cudalloc-";

/// The name of object `number` of kind `tag` (`seg`, `evt`, `ref`, …) of the process `pid` whose
/// creating component drew `nonce`: `cudalloc-<pid>-<nonce>-<tag><number>`. Every object cudalloc
/// creates is named here, so the creator pid (which the orphan sweep reads) is always first.
pub(crate) fn object_name(pid: u32, nonce: u64, tag: &str, number: u64) -> String {
    format!("{NAME_PREFIX}{pid}-{nonce:016x}-{tag}{number}")
}

/// Longest name accepted (NAME_MAX is 255).
const MAX_NAME_LEN: usize = 200;

/// A mapped shared-memory object. The creator unlinks it on drop (or earlier with
/// [`SharedMemory::unlink`]); every holder unmaps it on drop.
pub(crate) struct SharedMemory {
    name: String,
    /// Declared before `map`: it leaves the guard table before the mapping is unmapped.
    guard: guard::Guard,
    map: MmapRaw,
    len: u64,
    /// The pid of the process that created the object and alone may unlink it; `None` when opened
    /// (or already unlinked).
    creator: Option<u32>,
    /// Created by this process (kept after an unlink: its creator lock is still ours).
    created_here: bool,
    /// Kept open: its open file description carries the OFD byte-range locks of IPC leases.
    file: File,
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory")
            .field("name", &self.name)
            .field("len", &self.len)
            .field("creator", &self.creator)
            .finish()
    }
}

/// Checks that `name` is one of ours and cannot name anything outside `/dev/shm`.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !name.starts_with(NAME_PREFIX)
        || name.len() > MAX_NAME_LEN
        || !ok_chars
        || name.contains("..")
    {
        return Err(Error::bad_handle(format!(
            "shared-memory name {name:?} is not a cudalloc name (prefix {NAME_PREFIX:?}, at most \
             {MAX_NAME_LEN} characters of [A-Za-z0-9._-], no \"..\")"
        )));
    }
    Ok(())
}

pub(crate) fn path_of(name: &str) -> PathBuf {
    PathBuf::from(SHM_DIR).join(name)
}

fn map_file(file: &File, len: u64, call: &'static str) -> Result<MmapRaw> {
    let len_usize = usize::try_from(len).map_err(|_| {
        Error::invalid(format!(
            "shared-memory size {len} exceeds the address space"
        ))
    })?;
    memmap2::MmapOptions::new()
        .len(len_usize)
        .map_raw(file)
        .map_err(|e| Error::host_os(call, e))
}

/// Creates the file of object `name`: read-write, `0600`, exclusive (`O_EXCL`: a pre-planted file
/// makes creation fail), not through a symlink, closed on exec.
fn create_exclusive(name: &str) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path_of(name))
}

/// The `call` of the error [`SharedMemory::create`] returns when `/dev/shm` has no room: callers
/// that allocate device memory turn it into out-of-memory.
/// Only ENOSPC carries it; any other `posix_fallocate` failure is a plain driver error.
pub(crate) const NO_SPACE_CALL: &str = "posix_fallocate (ENOSPC)";

/// Whether `err` says that `/dev/shm` had no room for a new object.
pub(crate) fn is_no_space(err: &Error) -> bool {
    matches!(err, Error::Driver { call, .. } if *call == NO_SPACE_CALL)
}

/// Backs every page of a new object now. A sparse object (`ftruncate` alone) faults — SIGBUS, the
/// process dies — on the first write to a page the file system cannot back, which on a full
/// `/dev/shm` (Docker's default is 64 MiB) is any write. Reserved up front, a full `/dev/shm` is an
/// error at creation instead.
fn reserve(file: &File, name: &str, len: u64) -> Result<()> {
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::NOSPC) => Err(Error::Driver {
            source: None,
            backend: "host",
            call: NO_SPACE_CALL,
            message: format!(
                "{name}: {SHM_DIR} has no room for {len} more bytes (its free space is smaller than \
                 the configured device capacity; enlarge {SHM_DIR} or lower CUDALLOC_HOST_MEMORY)"
            ),
        }),
        Err(err) => Err(Error::host_os(
            "fallocate",
            format!("{name}: {}", std::io::Error::from(err)),
        )),
    }
}

/// Whether `err` says that another process truncated a shared-memory object
/// ([`SharedMemory::check_intact`]).
pub(crate) fn is_truncated(err: &Error) -> bool {
    matches!(err, Error::Driver { call, .. } if *call == TRUNCATED_CALL)
}

/// Bytes `/dev/shm` can still back (what the host backend can really hand out).
pub(crate) fn available_bytes() -> Result<u64> {
    let st = rustix::fs::statvfs(SHM_DIR)
        .map_err(|e| Error::host_os("statvfs", std::io::Error::from(e)))?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// The byte every creator keeps write-locked (an OFD lock) while its object is open: the lock
/// dies with the creator, in whatever pid namespace it ran — unlike its pid, which another
/// namespace cannot see (or sees as another process). Consumers lock only bytes past the headers,
/// so this byte never conflicts with a lease.
const CREATOR_BYTE: u64 = 0;

fn lock_creator(file: &File) -> Result<()> {
    ofd_lock(file, libc::F_WRLCK, libc::F_OFD_SETLK, CREATOR_BYTE, 1).map(|_| ())
}

/// The call named by the error of an access to a truncated object ([`SharedMemory::check_intact`]).
pub(crate) const TRUNCATED_CALL: &str = "shared memory truncated by another process";

fn guard_of(map: &MmapRaw) -> guard::Guard {
    guard::Guard::new(map.as_mut_ptr() as usize, map.len())
}

impl SharedMemory {
    /// Creates, sizes and maps a new object of `len` bytes (zero-filled by the kernel).
    pub(crate) fn create(name: &str, len: u64) -> Result<Self> {
        validate_name(name)?;
        if len == 0 {
            return Err(Error::invalid("shared-memory object of size 0"));
        }
        // Alive (to every sweep) before the first object exists.
        ensure_liveness()?;
        let file = create_exclusive(name)
            .map_err(|e| Error::host_os("shm_open(O_CREAT|O_EXCL)", format!("{name}: {e}")))?;
        let result = file
            .set_len(len)
            .map_err(|e| Error::host_os("ftruncate", format!("{name}: {e}")))
            .and_then(|()| reserve(&file, name, len))
            .and_then(|()| lock_creator(&file))
            .and_then(|()| map_file(&file, len, "mmap"));
        match result {
            Ok(map) => {
                remember_name(name);
                Ok(SharedMemory {
                    name: name.to_owned(),
                    guard: guard_of(&map),
                    map,
                    len,
                    creator: Some(std::process::id()),
                    created_here: true,
                    file,
                })
            }
            Err(err) => {
                // Best effort: the error reported is the mapping's; a file left behind is swept.
                let _ = std::fs::remove_file(path_of(name));
                Err(err)
            }
        }
    }

    /// Opens and maps an existing object created by another cudalloc process of our user.
    /// `expected_len`, when given, must equal the object's size.
    pub(crate) fn open(name: &str, expected_len: Option<u64>) -> Result<Self> {
        validate_name(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path_of(name))
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Error::bad_handle(format!(
                    "shared-memory object {name} does not exist (freed by its owner, or the owner exited)"
                )),
                _ => Error::host_os("shm_open", format!("{name}: {e}")),
            })?;
        let meta = file.metadata().map_err(|e| Error::host_os("fstat", e))?;
        let euid = rustix::process::geteuid().as_raw();
        if !meta.file_type().is_file() || meta.uid() != euid {
            return Err(Error::bad_handle(format!(
                "shared-memory object {name} is not a regular file owned by uid {euid}"
            )));
        }
        let len = meta.len();
        if len == 0 || expected_len.is_some_and(|want| want != len) {
            return Err(Error::bad_handle(format!(
                "shared-memory object {name} has {len} bytes, expected {}",
                expected_len.map_or("a non-zero size".to_owned(), |n| n.to_string())
            )));
        }
        let map = map_file(&file, len, "mmap")?;
        Ok(SharedMemory {
            name: name.to_owned(),
            guard: guard_of(&map),
            map,
            len,
            creator: None,
            created_here: false,
            file,
        })
    }

    /// The object's name in `/dev/shm`.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Start of the mapping in this process.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// An error when another process truncated the object under this mapping (found by a guarded
    /// fault, see `guard.rs`, or by the file's size now): its bytes from the cut on are lost — this
    /// process reads zeros there, and what it writes there reaches no other process.
    pub(crate) fn check_intact(&self) -> Result<()> {
        let from = self.guard.damage().map(|d| d.from).or_else(|| {
            self.file
                .metadata()
                .ok()
                .map(|m| m.len())
                .filter(|&now| now < self.len)
        });
        self.truncated_from(from)
    }

    /// [`Self::check_intact`] without the system call: only a fault already survived counts (an
    /// atomic load, for paths that cannot afford an `fstat`; host segments are checked with
    /// [`Self::check_intact`], so a cut is an error for the very next access).
    pub(crate) fn check_not_faulted(&self) -> Result<()> {
        self.truncated_from(self.guard.damage().map(|d| d.from))
    }

    fn truncated_from(&self, from: Option<u64>) -> Result<()> {
        match from {
            None => Ok(()),
            Some(from) => Err(Error::Driver {
                source: None,
                backend: "host",
                call: TRUNCATED_CALL,
                message: format!(
                    "{} was truncated by another process: its bytes from offset {from} of {} are lost",
                    self.name, self.len
                ),
            }),
        }
    }

    /// Whether the process that created the object still runs (its creator lock is held); seen
    /// from any pid namespace sharing `/dev/shm`. An object this process created reads `true`. A
    /// failed probe reads `true` too: it only ever makes callers wait longer, never free early.
    ///
    /// The lock belongs to the creator's open file description, which a `fork` shares: a child
    /// the creator forked (and that did not exec) keeps the lock — and so "alive" — after the
    /// creator exited, until the child exits too. Callers wait longer then, never shorter: a
    /// foreign event wait ends at its deadline (`Timeout`) instead of at once (`ProducerExited`),
    /// and the sweep keeps the objects until the child is gone.
    pub(crate) fn creator_alive(&self) -> bool {
        if self.created_here {
            return true;
        }
        ofd_lock(
            &self.file,
            libc::F_WRLCK,
            libc::F_OFD_GETLK,
            CREATOR_BYTE,
            1,
        )
        .map_or(true, |fl| fl.l_type != libc::F_UNLCK as libc::c_short)
    }

    /// The open file (for `fcntl` locks on its bytes).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Size of the mapping in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Removes the name now (the mapping stays valid for every holder). Idempotent; a no-op in any
    /// process but the creator (a forked child).
    pub(crate) fn unlink(&mut self) {
        if self.creator.take() == Some(std::process::id()) {
            forget_name(&self.name);
            if let Err(err) = std::fs::remove_file(path_of(&self.name)) {
                tracing::warn!(name = %self.name, %err, "could not unlink shared-memory object");
            }
        }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unique(tag: &str) -> String {
        object_name(std::process::id(), random_u64(), tag, 0)
    }

    #[test]
    fn names_outside_our_pattern_are_rejected() {
        for bad in [
            "../etc/passwd",
            "cudalloc-a/b",
            "cudalloc-..x",
            "other-name",
            "cudalloc-\u{e9}",
            "",
        ] {
            assert!(validate_name(bad).is_err(), "{bad:?} accepted");
        }
        validate_name("cudalloc-123-abc.seg_1").unwrap();
    }

    #[test]
    fn create_is_exclusive_and_private_and_unlinks_on_drop() {
        let name = unique("excl");
        let shm = SharedMemory::create(&name, 4096).unwrap();
        let mode = std::fs::metadata(path_of(&name)).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(SharedMemory::create(&name, 4096).is_err());
        let opened = SharedMemory::open(&name, Some(4096)).unwrap();
        assert!(SharedMemory::open(&name, Some(8192)).is_err());
        drop(shm);
        assert!(!path_of(&name).exists());
        assert_eq!(opened.len(), 4096);
    }

    #[test]
    fn symlinks_are_not_followed() {
        let name = unique("link");
        std::os::unix::fs::symlink("/etc/hostname", path_of(&name)).unwrap();
        assert!(SharedMemory::open(&name, None).is_err());
        assert!(SharedMemory::create(&name, 4096).is_err());
        std::fs::remove_file(path_of(&name)).unwrap();
    }
}
