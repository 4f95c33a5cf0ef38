//! [`HostAllocator`]: allocation, free, event polling, `empty_cache` and statistics (the policy
//! is described in `pinned/mod.rs`).

use super::buffer::PinnedBuffer;
use super::memory::{self, Reserve, Source};
use super::state::{Block, BlockState, Pending, State};
use super::stats::HostMemoryStats;
use crate::config::AllocatorConfig;
use crate::driver::{Driver, EventFlags, EventId, HostAddr};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::atomic::{AtomicUsize, Ordering};
use crate::sync::os::{Arc, Mutex, MutexGuard};

/// The pinned allocator's settings (from `CUDALLOC_CONF`'s `pinned_*` keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PinnedOptions {
    /// Register ordinary pages instead of the driver's page-locked allocation.
    pub use_host_register: bool,
    /// Threads faulting in the pages of one registration.
    pub register_threads: u64,
    /// Bytes of the reserve segment (0: none).
    pub reserve_segment_size: u64,
}

impl PinnedOptions {
    /// The options `config` sets.
    pub fn from_config(config: &AllocatorConfig) -> Self {
        PinnedOptions {
            use_host_register: config.pinned_use_host_register,
            register_threads: config.pinned_num_register_threads,
            reserve_segment_size: config.pinned_reserve_segment_size,
        }
    }
}

impl Default for PinnedOptions {
    fn default() -> Self {
        Self::from_config(&AllocatorConfig::default())
    }
}

/// The caching allocator of page-locked host memory (see `src/pinned/mod.rs`). One per
/// [`Runtime`](crate::Runtime), so one per process through `GLOBAL`.
#[derive(Debug)]
pub struct HostAllocator {
    driver: Arc<dyn Driver>,
    options: PinnedOptions,
    state: Mutex<State>,
    /// Events queued (read without the lock: allocation skips polling when 0).
    pending: AtomicUsize,
    check_invariants: bool,
    birth: Birth,
}

impl HostAllocator {
    /// An allocator of page-locked memory from `driver` (the runtime's, sanitized when it is).
    pub fn new(driver: Arc<dyn Driver>, options: PinnedOptions) -> Arc<Self> {
        Self::build(driver, options, false)
    }

    /// As [`HostAllocator::new`], running the invariant scanner after every change (tests).
    pub fn with_invariant_checks(driver: Arc<dyn Driver>, options: PinnedOptions) -> Arc<Self> {
        Self::build(driver, options, true)
    }

    pub(crate) fn build(
        driver: Arc<dyn Driver>,
        options: PinnedOptions,
        check_invariants: bool,
    ) -> Arc<Self> {
        Arc::new(HostAllocator {
            driver,
            options,
            state: Mutex::new(State::new()),
            pending: AtomicUsize::new(0),
            check_invariants,
            birth: Birth::now(),
        })
    }

    /// Whether this is the process that made it (not a forked child).
    pub(super) fn in_its_process(&self) -> bool {
        self.birth.is_current()
    }

    /// Its options.
    pub fn options(&self) -> PinnedOptions {
        self.options
    }

    /// The driver it allocates from.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Runs the invariant scanner when on; a violation panics (tests only turn it on).
    fn checked(&self, state: &State) {
        if self.check_invariants {
            if let Err(violation) = state.check() {
                panic!("pinned allocator invariant violated: {violation}");
            }
        }
    }

    /// Checks the invariants now (`state.rs`); the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.lock().check()
    }

    /// A buffer of at least `len` bytes of page-locked memory, from the cache when a block of its
    /// size class is free (its streams' work completed), else from the driver. `len` 0 is an
    /// empty buffer.
    pub fn allocate(self: &Arc<Self>, len: usize) -> Result<PinnedBuffer> {
        self.birth.check("this pinned host allocator")?;
        if len == 0 {
            return Ok(PinnedBuffer::empty(Arc::clone(self)));
        }
        let size = u64::try_from(len)
            .ok()
            .and_then(u64::checked_next_power_of_two)
            .ok_or_else(|| {
                Error::invalid(format!("a pinned buffer of {len} bytes is too large"))
            })?;
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
        Ok(PinnedBuffer::new(Arc::clone(self), block, addr, len, size))
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
        if self.lock().reserve.is_none() {
            let (base, source) = self.make(want)?;
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
                memory::release(&*self.driver, base, want, source)?;
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

    /// A block comes back from its buffer: cached at once when nothing used it on a stream,
    /// else once `events` completed.
    pub(super) fn free(&self, block: usize, addr: HostAddr, size: u64, events: Vec<Pending>) {
        if let Some(sanitizer) = self.driver.sanitizer() {
            let ids: Vec<EventId> = events.iter().map(|p| p.event).collect();
            sanitizer.free_host_block(addr.0, size, &ids, &[]);
        }
        let mut state = self.lock();
        if events.is_empty() {
            state.cache(block);
        } else {
            if let Some(b) = state.blocks.get_mut(block) {
                b.state = BlockState::Waiting(u32::try_from(events.len()).unwrap_or(u32::MAX));
            }
            self.pending.fetch_add(events.len(), Ordering::Relaxed);
            state.events.extend(events);
        }
        self.checked(&state);
    }

    /// An idle event of `device` from the pool, or a new one.
    pub(super) fn take_event(&self, device: usize) -> Result<EventId> {
        let pooled = self.lock().event_pool.get_mut(device).and_then(Vec::pop);
        match pooled {
            Some(event) => Ok(event),
            None => self.driver.event_create(device, EventFlags::default()),
        }
    }

    /// Gives an event back to the pool.
    pub(super) fn return_event(&self, device: usize, event: EventId) {
        let mut state = self.lock();
        if state.event_pool.len() <= device {
            state.event_pool.resize_with(device + 1, Vec::new);
        }
        state.event_pool[device].push(event);
    }

    /// Polls the events of freed blocks, oldest first, until one is not complete (PyTorch's
    /// order): the blocks all of whose events completed are cached. Never blocks.
    pub fn process_events(&self) {
        if !self.birth.is_current() {
            return;
        }
        loop {
            // The oldest event stays queued while it is queried (without the lock), so the books
            // never show a waiting block without its events; whoever finds it done first takes it.
            let Some(next) = self.lock().events.front().copied() else {
                return;
            };
            // A query fails inside a capture that forbids it, or on a failed stream: not ready.
            if !self.driver.event_query(next.event).unwrap_or(false) {
                return;
            }
            let mut state = self.lock();
            if state.events.front().is_none_or(|f| f.event != next.event) {
                continue;
            }
            state.events.pop_front();
            self.pending.fetch_sub(1, Ordering::Relaxed);
            if state.event_pool.len() <= next.device {
                state.event_pool.resize_with(next.device + 1, Vec::new);
            }
            state.event_pool[next.device].push(next.event);
            state.event_done(next.block);
            self.checked(&state);
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
        for Block {
            addr, size, source, ..
        } in blocks
        {
            match memory::release(&*self.driver, addr, size, source) {
                Ok(took) => {
                    released += size;
                    let mut state = self.lock();
                    state.stats.num_host_free += 1;
                    state.stats.host_free_time.add(took);
                }
                Err(err) => {
                    tracing::warn!(%addr, size, %err, "releasing a pinned block failed");
                    first_error.get_or_insert(err);
                }
            }
        }
        match first_error {
            Some(err) => Err(err),
            None => Ok(released),
        }
    }

    /// Its statistics (PyTorch's `host_memory_stats`; keys: [`HostMemoryStats::to_map`]).
    pub fn stats(&self) -> HostMemoryStats {
        self.lock().stats
    }

    /// Resets the peaks to the current values.
    pub fn reset_peak_stats(&self) {
        self.lock().stats.reset_peak();
    }

    /// Resets the accumulated counts (allocated, freed, driver calls and times).
    pub fn reset_accumulated_stats(&self) {
        self.lock().stats.reset_accumulated();
    }
}

impl Drop for HostAllocator {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            // A forked child: the blocks and events are the parent's.
            crate::process::leak_in_child(self.birth, &mut self.state);
            return;
        }
        let state = std::mem::take(&mut *self.state.lock());
        for pending in &state.events {
            // Every buffer is gone (each holds the allocator); what waits must finish before
            // its memory goes back.
            let _ = self.driver.event_synchronize(pending.event);
        }
        for pending in state.events {
            let _ = self.driver.event_destroy(pending.event);
        }
        for (_, block) in state.blocks {
            if block.source != Source::Reserve {
                let _ = memory::release(&*self.driver, block.addr, block.size, block.source);
            }
        }
        if let Some(reserve) = state.reserve {
            let _ = memory::release(&*self.driver, reserve.base, reserve.size, reserve.source);
        }
        for events in state.event_pool {
            for event in events {
                let _ = self.driver.event_destroy(event);
            }
        }
    }
}
