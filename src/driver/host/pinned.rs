//! Page-locked host memory on the host backend: real locked pages, with CUDA's contract
//! (`driver/host_memory.rs`).
//!
//! | CUDA | host backend |
//! |---|---|
//! | `cuMemHostAlloc` | an anonymous private mapping (page aligned), locked with `mlock` |
//! | `cuMemHostRegister` | `mlock` of the pages under the range; a page shared by two registrations stays locked until both are gone (pages are counted) |
//! | `cuMemFreeHost`, `cuMemHostUnregister` | out of the table under its write lock (no new copy can name it), every stream drained, then unlocked (and unmapped) |
//! | `cuMemcpyHtoDAsync` / `DtoHAsync` from or to pinned memory | both ranges checked under the tables' read locks, the copy enqueued before they are released |
//!
//! So a queued copy never touches memory that was unlocked or unmapped, as for segments
//! (`segments.rs`).
//!
//! **Limits.** Bytes are charged in whole pages against [`HostDriverBuilder::pinned_memory`]
//! (`CUDALLOC_HOST_PINNED_MEMORY`); beyond it, and when the operating system refuses to lock
//! (`RLIMIT_MEMLOCK` for a process without `CAP_IPC_LOCK`: 8 MiB on many distributions), the call
//! is an [`Error::HostOutOfMemory`] that names the limit and how to raise it — never a signal.
//! Stricter than CUDA: a copy whose host range is not inside one allocation or registration of
//! this driver is an error, not a silent synchronous copy; a registration overlapping another one
//! is an error (CUDA's `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`). Copies on a capturing stream
//! are refused (the host backend's graphs replay device memory only).
//!
//! [`HostDriverBuilder::pinned_memory`]: super::HostDriverBuilder::pinned_memory

use std::collections::BTreeMap;
use std::ffi::c_void;

use super::{checked_len, kernels, HostDriver, PAGE};
use crate::driver::{ranges, DeviceAddr, HostAddr, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{RwLock, RwLockReadGuard};

/// Whether a range was allocated by the driver or registered by its owner.
#[derive(Debug)]
enum Origin {
    /// `host_alloc`: the driver's own mapping, unmapped when freed.
    Allocated,
    /// `host_register`: the caller's memory, only unlocked.
    Registered,
}

/// One page-locked range.
#[derive(Debug)]
struct Locked {
    len: u64,
    origin: Origin,
}

#[derive(Debug, Default)]
struct Tables {
    by_base: BTreeMap<u64, Locked>,
    /// How many ranges lock each page (page address → count).
    pages: BTreeMap<u64, u32>,
}

/// All page-locked memory of one host driver.
#[derive(Debug, Default)]
pub(super) struct PinnedTable {
    inner: RwLock<Tables>,
    /// Bytes charged (whole pages).
    used: AtomicU64,
}

/// A read view: ranges checked through it stay locked and mapped while it is held.
pub(super) struct PinnedView<'a> {
    tables: RwLockReadGuard<'a, Tables>,
}

impl PinnedView<'_> {
    /// Checks that `[ptr, ptr + len)` lies inside one allocation or registration; returns the
    /// address to access.
    fn check(&self, ptr: HostAddr, len: u64) -> Result<usize> {
        ranges::containing(&self.tables.by_base, |l| l.len, DeviceAddr(ptr.0), len).map_err(
            |_| {
                Error::invalid(format!(
                    "host range {ptr} + {len} bytes is not inside page-locked memory of this \
                     driver (host_alloc or host_register); copy pageable memory with \
                     copy_host_to_device / copy_device_to_host"
                ))
            },
        )?;
        usize::try_from(ptr.0).map_err(|_| Error::invalid("pointer exceeds the address space"))
    }
}

/// The pages `[first, end)` under `[ptr, ptr + len)`, or an error if that overflows.
fn page_span(ptr: u64, len: u64) -> Result<(u64, u64)> {
    let end = ptr
        .checked_add(len)
        .and_then(|e| e.checked_add(PAGE - 1))
        .ok_or_else(|| Error::invalid(format!("host range {ptr:#x} + {len} overflows")))?;
    Ok((ptr & !(PAGE - 1), end & !(PAGE - 1)))
}

/// The error of a refused lock: which limit, and how to raise it.
fn lock_refused(requested: u64, err: rustix::io::Errno) -> Error {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
    let limit = match limit {
        Some(bytes) => format!("{} KiB", bytes / 1024),
        None => "unlimited".to_owned(),
    };
    Error::HostOutOfMemory {
        requested,
        message: format!(
            "mlock of {requested} bytes failed ({err}); this process may lock {limit} \
             (RLIMIT_MEMLOCK, `ulimit -l`) unless it has CAP_IPC_LOCK — raise the limit \
             (`ulimit -l`, systemd's LimitMEMLOCK, docker run --ulimit memlock=-1) or grant the \
             capability"
        ),
    }
}

impl PinnedTable {
    pub(super) fn view(&self) -> PinnedView<'_> {
        PinnedView {
            tables: self.inner.read(),
        }
    }

    /// Charges `bytes` against `budget`, or says why not.
    fn charge(&self, bytes: u64, requested: u64, budget: u64) -> Result<()> {
        let mut used = self.used.load(Ordering::SeqCst);
        loop {
            let next = used
                .checked_add(bytes)
                .filter(|&n| n <= budget)
                .ok_or_else(|| Error::HostOutOfMemory {
                    requested,
                    message: format!(
                        "{requested} bytes requested, {used} of the host driver's {budget} bytes \
                         of page-locked memory in use (HostDriverBuilder::pinned_memory, \
                         CUDALLOC_HOST_PINNED_MEMORY)"
                    ),
                })?;
            match self
                .used
                .compare_exchange(used, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Ok(()),
                Err(now) => used = now,
            }
        }
    }

    fn uncharge(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// An IPC export of `ptr` is refused with a reason when it is page-locked host memory.
    pub(super) fn refuse_export(&self, ptr: DeviceAddr) -> Result<()> {
        match self.view().check(HostAddr(ptr.0), 1) {
            Ok(_) => Err(Error::invalid(format!(
                "{ptr} is page-locked host memory: IPC shares device memory only (a pinned \
                 buffer is not shared across processes; copy it into a storage and share that)"
            ))),
            Err(_) => Ok(()),
        }
    }

    /// Bytes charged now.
    pub(super) fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }

    /// Locks the pages of `[ptr, ptr + len)` not locked yet and records the range; returns the
    /// bytes newly locked (charged by the caller first).
    fn insert(&self, tables: &mut Tables, ptr: u64, len: u64, origin: Origin) {
        if let Ok((first, end)) = page_span(ptr, len) {
            let mut page = first;
            while page < end {
                *tables.pages.entry(page).or_insert(0) += 1;
                page += PAGE;
            }
        }
        tables.by_base.insert(ptr, Locked { len, origin });
    }

    /// Pages of `[ptr, ptr + len)` no other range locks.
    fn pages_only_here(tables: &Tables, first: u64, end: u64) -> u64 {
        let shared = tables.pages.range(first..end).count() as u64;
        (end - first) / PAGE - shared
    }

    /// Removes the range based at `ptr` (under the write lock): its record, and the pages only it
    /// locked — returned as runs to unlock once streams drained.
    fn remove(&self, ptr: HostAddr, want: &str) -> Result<(Locked, Vec<(u64, u64)>)> {
        let mut tables = self.inner.write();
        let origin_ok = match tables.by_base.get(&ptr.0).map(|l| &l.origin) {
            Some(Origin::Allocated) => want == "host_free",
            Some(Origin::Registered) => want == "host_unregister",
            None => {
                return Err(Error::invalid(format!(
                    "{want}: {ptr} is not the start of page-locked memory of this driver"
                )))
            }
        };
        if !origin_ok {
            return Err(Error::invalid(format!(
                "{want}: {ptr} was {} (free memory with the call that matches how it was locked)",
                if want == "host_free" {
                    "registered, not allocated: use host_unregister"
                } else {
                    "allocated, not registered: use host_free"
                }
            )));
        }
        let locked = tables
            .by_base
            .remove(&ptr.0)
            .ok_or_else(|| Error::invalid("page-locked range vanished"))?;
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let (first, end) = page_span(ptr.0, locked.len)?;
        let mut page = first;
        while page < end {
            let last = match tables.pages.get_mut(&page) {
                Some(count) if *count > 1 => {
                    *count -= 1;
                    false
                }
                Some(_) => {
                    tables.pages.remove(&page);
                    true
                }
                None => false,
            };
            if last {
                match runs.last_mut() {
                    Some((_, run_end)) if *run_end == page => *run_end = page + PAGE,
                    _ => runs.push((page, page + PAGE)),
                }
            }
            page += PAGE;
        }
        Ok((locked, runs))
    }
}

/// Bytes in runs of pages.
fn run_bytes(runs: &[(u64, u64)]) -> u64 {
    runs.iter().map(|(start, end)| end - start).sum()
}

/// Unlocks each run of pages (best effort: an unlock failure leaves pages locked, never unsafe).
fn unlock(runs: &[(u64, u64)]) {
    for &(start, end) in runs {
        // SAFETY: the pages were locked by this driver and are still mapped (the caller unmaps
        // after, or the memory is the registrant's until this call returns).
        let unlocked =
            unsafe { rustix::mm::munlock(start as usize as *mut c_void, (end - start) as usize) };
        if let Err(err) = unlocked {
            tracing::warn!(start, end, %err, "munlock failed; the pages stay locked");
        }
    }
}

impl HostDriver {
    /// Bytes of page-locked host memory this driver holds now (allocated and registered,
    /// charged in whole pages).
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned.used()
    }

    pub(super) fn pinned_alloc(&self, size: u64) -> Result<HostAddr> {
        if size == 0 {
            return Err(Error::invalid("host_alloc of 0 bytes"));
        }
        let len = checked_len(size)?;
        let charged = size
            .checked_add(PAGE - 1)
            .map(|s| s & !(PAGE - 1))
            .ok_or_else(|| Error::invalid(format!("host_alloc of {size} bytes overflows")))?;
        self.pinned
            .charge(charged, size, self.config.pinned_memory)?;
        // SAFETY: a fresh anonymous mapping at an address the kernel chooses aliases nothing.
        let mapped = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        };
        let ptr = match mapped {
            Ok(ptr) => ptr,
            Err(err) => {
                self.pinned.uncharge(charged);
                return Err(Error::HostOutOfMemory {
                    requested: size,
                    message: format!("mmap of {size} bytes failed: {err}"),
                });
            }
        };
        // SAFETY: `ptr..ptr+len` is the mapping just made.
        if let Err(err) = unsafe { rustix::mm::mlock(ptr, len) } {
            // SAFETY: the mapping was made above and nothing else knows it.
            if let Err(unmap_err) = unsafe { rustix::mm::munmap(ptr, len) } {
                tracing::error!(err = %unmap_err, len,
                    "pinned memory that could not be locked could not be unmapped; it stays mapped");
            }
            self.pinned.uncharge(charged);
            return Err(lock_refused(size, err));
        }
        let base = ptr as usize as u64;
        let mut tables = self.pinned.inner.write();
        self.pinned
            .insert(&mut tables, base, size, Origin::Allocated);
        Ok(HostAddr(base))
    }

    pub(super) fn pinned_free(&self, ptr: HostAddr) -> Result<()> {
        let (locked, runs) = self.drained_removal(ptr, "host_free")?;
        unlock(&runs);
        // SAFETY: the mapping was made by `pinned_alloc` with this base and length, every stream
        // drained, and it is out of the table.
        let unmapped = unsafe { rustix::mm::munmap(ptr.as_ptr().cast(), locked.len as usize) };
        self.pinned.uncharge(run_bytes(&runs));
        unmapped.map_err(|err| Error::host_os("munmap", std::io::Error::from(err)))
    }

    /// Takes the range at `ptr` out of the table (no new copy can name it) and drains every
    /// stream; when a stream fails to drain, the range goes back and the error is returned —
    /// nothing is unlocked or unmapped under a copy that may still run.
    fn drained_removal(&self, ptr: HostAddr, want: &str) -> Result<(Locked, Vec<(u64, u64)>)> {
        let (locked, runs) = self.pinned.remove(ptr, want)?;
        if let Err(err) = self.synchronize_all() {
            let mut tables = self.pinned.inner.write();
            self.pinned
                .insert(&mut tables, ptr.0, locked.len, locked.origin);
            return Err(err);
        }
        Ok((locked, runs))
    }

    /// # Safety
    /// As [`Driver::host_register`](crate::backend::Driver::host_register).
    pub(super) unsafe fn pinned_register(&self, ptr: HostAddr, size: u64) -> Result<()> {
        if size == 0 {
            return Err(Error::invalid("host_register of 0 bytes"));
        }
        let end = ptr.offset(size)?;
        let (first, page_end) = page_span(ptr.0, size)?;
        let mut tables = self.pinned.inner.write();
        if let Some((&base, other)) = tables.by_base.range(..end.0).next_back() {
            // An allocation owns its whole pages (its tail page is not the caller's to lock).
            let other_end = match other.origin {
                Origin::Allocated => page_span(base, other.len)?.1,
                Origin::Registered => base.saturating_add(other.len),
            };
            if other_end > ptr.0 {
                return Err(Error::invalid(format!(
                    "host_register of {ptr} + {size} bytes overlaps page-locked memory at \
                     {base:#x} ({} bytes) (CUDA: CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)",
                    other.len
                )));
            }
        }
        let fresh = Self::fresh_pages(&tables, first, page_end);
        let charged = fresh.iter().map(|(s, e)| e - s).sum::<u64>();
        self.pinned
            .charge(charged, size, self.config.pinned_memory)?;
        for &(start, run_end) in &fresh {
            // SAFETY: the caller promises the range is mapped memory of this process; the pages
            // under it are too.
            let locked = unsafe {
                rustix::mm::mlock(start as usize as *mut c_void, (run_end - start) as usize)
            };
            if let Err(err) = locked {
                let done: Vec<(u64, u64)> = fresh
                    .iter()
                    .copied()
                    .take_while(|&(s, _)| s < start)
                    .collect();
                unlock(&done);
                self.pinned.uncharge(charged);
                return Err(lock_refused(size, err));
            }
        }
        self.pinned
            .insert(&mut tables, ptr.0, size, Origin::Registered);
        Ok(())
    }

    /// Runs of pages in `[first, end)` no range locks yet.
    fn fresh_pages(tables: &Tables, first: u64, end: u64) -> Vec<(u64, u64)> {
        if PinnedTable::pages_only_here(tables, first, end) == 0 {
            return Vec::new();
        }
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut page = first;
        while page < end {
            if !tables.pages.contains_key(&page) {
                match runs.last_mut() {
                    Some((_, run_end)) if *run_end == page => *run_end = page + PAGE,
                    _ => runs.push((page, page + PAGE)),
                }
            }
            page += PAGE;
        }
        runs
    }

    pub(super) fn pinned_unregister(&self, ptr: HostAddr) -> Result<()> {
        let (_, runs) = self.drained_removal(ptr, "host_unregister")?;
        unlock(&runs);
        self.pinned.uncharge(run_bytes(&runs));
        Ok(())
    }

    /// Enqueues a copy between pinned memory and the device on `stream`.
    pub(super) fn pinned_copy(
        &self,
        stream: StreamId,
        device: DeviceAddr,
        host: HostAddr,
        len: u64,
        to_device: bool,
    ) -> Result<()> {
        let n = checked_len(len)?;
        let what = if to_device {
            "a copy from page-locked host memory"
        } else {
            "a copy to page-locked host memory"
        };
        self.captures.check_blocking(stream, what)?;
        // Held until the copy is enqueued: the host range stays locked and mapped until it ran.
        let view = self.pinned.view();
        let h = view.check(host, len)?;
        self.enqueue_blocking_on_ranges(stream, [(device, len)], move |[d]| {
            let (dst, src) = if to_device { (d, h) } else { (h, d) };
            // SAFETY: the device range was checked against the segments and the host range
            // against the page-locked table, each under its read lock until this was enqueued;
            // both stay mapped until every stream drained.
            unsafe { kernels::copy(dst, src, n) }
        })?;
        drop(view);
        Ok(())
    }

    /// Unmaps what is still allocated and unlocks what is still registered (the driver is
    /// dropped; its streams are joined).
    pub(super) fn drop_pinned(&mut self) {
        let tables = std::mem::take(&mut *self.pinned.inner.write());
        for (base, locked) in tables.by_base {
            match locked.origin {
                Origin::Allocated => {
                    // SAFETY: the mapping was made by `pinned_alloc`; every stream thread was
                    // joined and the table is gone, so nothing touches it any more.
                    let unmapped = unsafe {
                        rustix::mm::munmap(base as usize as *mut c_void, locked.len as usize)
                    };
                    if let Err(err) = unmapped {
                        tracing::debug!(%err, base, "unmapping pinned memory at the driver's teardown failed");
                    }
                }
                Origin::Registered => {
                    if let Ok(span) = page_span(base, locked.len) {
                        unlock(&[span]);
                    }
                }
            }
        }
    }
}
