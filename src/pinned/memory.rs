//! Where the pinned allocator's memory comes from, and where it goes back.
//!
//! | source | made by | released by |
//! |---|---|---|
//! | [`Source::Driver`] | `Driver::host_alloc` (CUDA `cuMemHostAlloc`) | `Driver::host_free` |
//! | [`Source::Registered`] (`pinned_use_cuda_host_register:True`) | an anonymous mapping of ordinary pages, faulted in by `pinned_num_register_threads` threads, then `Driver::host_register` — PyTorch's way to keep the driver's global lock short | `Driver::host_unregister`, then the mapping is unmapped |
//! | [`Source::Reserve`] (`pinned_reserve_segment_size_mb:N`) | carved from one segment of N MiB (made by either way above on the first allocation), bump-allocated while it lasts | never: a carved block stays cached for its size class |
//!
//! Deviation from PyTorch: PyTorch's `empty_cache` forgets carved blocks (their bytes are never
//! used again until the process exits); cudalloc keeps them in the cache, where they are reused.

use std::ffi::c_void;
use std::time::Instant;

use crate::driver::{Driver, HostAddr};
use crate::error::{Error, Result};

/// How a block's memory was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    /// The driver's page-locked allocation.
    Driver,
    /// Ordinary pages registered with the driver.
    Registered,
    /// Carved from the reserve segment.
    Reserve,
}

/// The reserve segment: `[base, base + size)`, the first `used` bytes carved.
#[derive(Debug)]
pub(super) struct Reserve {
    pub(super) base: HostAddr,
    pub(super) size: u64,
    pub(super) used: u64,
    /// How the segment itself was made.
    pub(super) source: Source,
}

impl Reserve {
    /// Carves `size` bytes (aligned to `size`'s power of two, at most a page) if they fit.
    pub(super) fn carve(&mut self, size: u64) -> Option<HostAddr> {
        let align = size.min(4096);
        let start = self.used.checked_add(align - 1)? & !(align - 1);
        let end = start.checked_add(size)?;
        if end > self.size {
            return None;
        }
        self.used = end;
        self.base.offset(start).ok()
    }

    /// Whether `addr` lies in the segment.
    pub(super) fn owns(&self, addr: HostAddr) -> bool {
        addr.0 >= self.base.0 && addr.0 - self.base.0 < self.size
    }
}

/// Makes `size` bytes of page-locked memory the way `register` says; returns it and how long the
/// driver took.
pub(super) fn make(
    driver: &dyn Driver,
    size: u64,
    register: bool,
    threads: u64,
) -> Result<(HostAddr, Source, std::time::Duration)> {
    let started = Instant::now();
    if !register {
        let addr = driver.pinned().host_alloc(size)?;
        return Ok((addr, Source::Driver, started.elapsed()));
    }
    let len = usize::try_from(size)
        .map_err(|_| Error::invalid(format!("{size} bytes exceed the address space")))?;
    // SAFETY: a fresh anonymous mapping at an address the kernel chooses aliases nothing.
    let ptr = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE,
        )
    }
    .map_err(|err| Error::HostOutOfMemory {
        requested: size,
        message: format!("mmap of {size} bytes for a registration failed: {err}"),
    })?;
    prefault(ptr as usize, len, threads);
    let addr = HostAddr(ptr as usize as u64);
    // SAFETY: the mapping was made above, is readable and writable, and is unmapped only after
    // `host_unregister` (`release`).
    if let Err(err) = unsafe { driver.pinned().host_register(addr, size) } {
        // SAFETY: the mapping made above, never registered.
        if let Err(unmap_err) = unsafe { rustix::mm::munmap(ptr, len) } {
            tracing::error!(err = %unmap_err, len,
                "host memory whose registration failed could not be unmapped; it stays mapped");
        }
        return Err(err);
    }
    Ok((addr, Source::Registered, started.elapsed()))
}

/// Touches one byte of every page of `[start, start + len)`, split over `threads` threads when
/// the range has at least a page per thread (PyTorch's `pinned_num_register_threads`).
fn prefault(start: usize, len: usize, threads: u64) {
    const PAGE: usize = 4096;
    let touch = |from: usize, to: usize| {
        let mut page = from.next_multiple_of(PAGE);
        while page < to {
            // SAFETY: `page` lies in the private mapping made by `make`, which nothing else knows
            // yet; a volatile write faults it in.
            unsafe { std::ptr::write_volatile(page as *mut u8, 0) };
            page += PAGE;
        }
    };
    let n = usize::try_from(threads).unwrap_or(1).max(1);
    if n == 1 || len < PAGE * n {
        touch(start, start + len);
        return;
    }
    let part = len / n;
    std::thread::scope(|scope| {
        for i in 0..n {
            let from = start + part * i;
            let to = if i + 1 == n { start + len } else { from + part };
            scope.spawn(move || touch(from, to));
        }
    });
}

/// Gives memory of `source` back (not for [`Source::Reserve`] blocks); returns how long the
/// driver took.
pub(super) fn release(
    driver: &dyn Driver,
    addr: HostAddr,
    size: u64,
    source: Source,
) -> Result<std::time::Duration> {
    let started = Instant::now();
    match source {
        // SAFETY: the block (or reserve segment) is out of the allocator's books: no buffer
        // refers to it, and the events of its last copies completed.
        Source::Driver => unsafe { driver.pinned().host_free(addr) }?,
        Source::Registered => {
            // SAFETY: as above; the mapping is unmapped right after, by this function alone.
            unsafe { driver.pinned().host_unregister(addr) }?;
            // SAFETY: the mapping made by `make` for this registration, which just ended.
            unsafe { rustix::mm::munmap(addr.as_ptr().cast::<c_void>(), size as usize) }
                .map_err(|err| Error::host_os("munmap", std::io::Error::from(err)))?;
        }
        Source::Reserve => {
            return Err(Error::invalid(
                "a block carved from the reserve segment is never released alone",
            ))
        }
    }
    Ok(started.elapsed())
}
