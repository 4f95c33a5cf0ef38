//! Handing out [`PinnedBuffer`]s: the cache, the reserve segment, the driver and the
//! out-of-memory path; `empty_cache` and statistics (the policy is described in
//! `pinned/mod.rs`).

use super::buffer::PinnedBuffer;
use super::memory::{self, Reserve, Source};
use super::pinned_allocator::PinnedAllocator;
use super::stats::PinnedStats;
use crate::driver::HostAddr;
use crate::error::{Error, Result};
use crate::sync::os::atomic::Ordering;
use crate::sync::os::Arc;

impl PinnedAllocator {
    /// A buffer of at least `len` bytes of page-locked memory, from the cache when a block of its
    /// size class is free (its streams' work completed), else from the driver. `len` 0 is an
    /// empty buffer.
    pub fn allocate(self: &Arc<Self>, len: u64) -> Result<PinnedBuffer> {
        self.birth.check("this pinned host allocator")?;
        if len == 0 {
            return Ok(PinnedBuffer::empty(Arc::clone(self)));
        }
        let too_large = || Error::invalid(format!("a pinned buffer of {len} bytes is too large"));
        // The buffer is host memory seen as a slice: its length must be a `usize` too.
        let host_len = usize::try_from(len).map_err(|_| too_large())?;
        let size = len.checked_next_power_of_two().ok_or_else(too_large)?;
        if self.pending.load(Ordering::Relaxed) > 0 {
            self.process_events();
        }
        let cached = {
            let mut state = self.lock();
            let got = state.take_cached(size);
            self.checked(&state);
            got
        };
        let (block, addr) = match cached {
            Some(found) => found,
            None => self.allocate_new(size)?,
        };
        if let Some(sanitizer) = self.driver.sanitizer() {
            sanitizer.hand_out_host(addr.0, size);
        }
        Ok(PinnedBuffer::new(
            Arc::clone(self),
            block,
            addr,
            host_len,
            size,
        ))
    }

    /// The slow path: the reserve segment, else the driver; on out of memory, what the cache
    /// holds goes back and the driver is asked once more.
    fn allocate_new(&self, size: u64) -> Result<(usize, HostAddr)> {
        if let Some(found) = self.carve(size)? {
            return Ok(found);
        }
        let made = match self.make(size) {
            Err(err) if err.kind() == crate::ErrorKind::OutOfMemory => {
                self.process_events();
                let released = self.empty_cache()?;
                if released == 0 {
                    return Err(self.out_of_memory(size, err));
                }
                self.make(size)
                    .map_err(|again| self.out_of_memory(size, again))?
            }
            other => other?,
        };
        let (addr, source) = made;
        let mut state = self.lock();
        let index = state.insert(addr, size, source);
        self.checked(&state);
        Ok((index, addr))
    }

    /// Asks the driver for `size` bytes (timed and counted).
    fn make(&self, size: u64) -> Result<(HostAddr, Source)> {
        let (addr, source, took) = memory::make(
            &*self.driver,
            size,
            self.options.use_host_register,
            self.options.register_threads,
        )?;
        let mut state = self.lock();
        state.stats.num_host_alloc += 1;
        state.stats.host_alloc_time.add(took);
        Ok((addr, source))
    }

    /// A block from the reserve segment (made on first use), if it has room.
    fn carve(&self, size: u64) -> Result<Option<(usize, HostAddr)>> {
        let want = self.options.reserve_segment_size;
        if want == 0 {
            return Ok(None);
        }
        let missing = {
            let state = self.lock();
            state.reserve.is_none() && !state.reserve_failed
        };
        if missing {
            match self.make(want) {
                Ok((base, source)) => {
                    let mut state = self.lock();
                    if state.reserve.is_none() {
                        state.reserve = Some(Reserve {
                            base,
                            size: want,
                            used: 0,
                            source,
                        });
                    } else {
                        drop(state);
                        // Another thread made it first.
                        self.release_counted(base, want, source);
                    }
                }
                Err(err) => {
                    // Not fatal: every allocation takes the ordinary path instead.
                    tracing::warn!(%err, bytes = want, "the pinned reserve segment could not be made");
                    self.lock().reserve_failed = true;
                }
            }
        }
        let mut state = self.lock();
        let carved = state.reserve.as_mut().and_then(|r| r.carve(size));
        Ok(carved.map(|addr| {
            let index = state.insert(addr, size, Source::Reserve);
            self.checked(&state);
            (index, addr)
        }))
    }

    /// Gives memory back to the driver, counted as a free (a failure is logged: the memory
    /// stays with the driver's table, unused).
    fn release_counted(&self, addr: HostAddr, size: u64, source: Source) {
        match memory::release(&*self.driver, addr, size, source) {
            Ok(took) => {
                let mut state = self.lock();
                state.stats.num_host_free += 1;
                state.stats.host_free_time.add(took);
            }
            Err(err) => tracing::warn!(%addr, size, %err, "releasing pinned memory failed"),
        }
    }

    fn out_of_memory(&self, size: u64, cause: Error) -> Error {
        let stats = self.stats();
        Error::HostOutOfMemory {
            requested: size,
            message: format!(
                "a pinned block of {size} bytes: {cause}; the pinned allocator holds {} bytes in \
                 {} blocks, {} bytes of them in use or waiting for their streams (its cache was \
                 emptied and the driver asked again)",
                stats.allocated_bytes.current,
                stats.allocations.current,
                stats.active_bytes.current
            ),
        }
    }

    /// Gives every cached block back to the driver (blocks carved from the reserve segment stay
    /// cached); returns the bytes released. Blocks in use or waiting for their streams stay.
    pub fn empty_cache(&self) -> Result<u64> {
        self.birth.check("this pinned host allocator")?;
        self.process_events();
        let blocks = {
            let mut state = self.lock();
            let out = state.take_releasable();
            self.checked(&state);
            out
        };
        let mut released = 0;
        let mut first_error = None;
        for block in blocks {
            match memory::release(&*self.driver, block.addr, block.size, block.source) {
                Ok(took) => {
                    released += block.size;
                    let mut state = self.lock();
                    state.stats.num_host_free += 1;
                    state.stats.host_free_time.add(took);
                }
                Err(err) => {
                    // Still the allocator's (the driver kept it): back in the cache.
                    tracing::warn!(addr = %block.addr, size = block.size, %err, "releasing a pinned block failed");
                    let mut state = self.lock();
                    state.restore(block);
                    self.checked(&state);
                    first_error.get_or_insert(err);
                }
            }
        }
        match first_error {
            Some(err) => Err(err),
            None => Ok(released),
        }
    }

    /// Its statistics (PyTorch's `host_memory_stats`; keys: [`PinnedStats::to_map`]); zeros in
    /// a forked child (the blocks are the parent's).
    pub fn stats(&self) -> PinnedStats {
        self.lock_unless_child("reading the pinned statistics")
            .map(|state| state.stats)
            .unwrap_or_default()
    }

    /// Resets the peaks to the current values (nothing in a forked child).
    pub fn reset_peak_stats(&self) {
        if let Some(mut state) = self.lock_unless_child("resetting the pinned peaks") {
            state.stats.reset_peak();
        }
    }

    /// Resets the accumulated counts (allocated, freed, driver calls and times; nothing in a
    /// forked child).
    pub fn reset_accumulated_stats(&self) {
        if let Some(mut state) = self.lock_unless_child("resetting the pinned counts") {
            state.stats.reset_accumulated();
        }
    }
}
