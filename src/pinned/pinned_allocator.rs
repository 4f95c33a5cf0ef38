//! The pinned allocator's core: the [`PinnedAllocator`] type, its settings, the steps a
//! [`PinnedBuffer`](super::PinnedBuffer) calls back into (free, events) and event polling.
//! `allocate.rs` above it hands buffers out.

use super::memory::{self, Source};
use super::state::{BlockState, Pending, State};
use crate::config::AllocatorConfig;
use crate::driver::{Driver, EventFlags, EventId, HostAddr};
use crate::error::Result;
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
pub struct PinnedAllocator {
    pub(super) driver: Arc<dyn Driver>,
    pub(super) options: PinnedOptions,
    state: Mutex<State>,
    /// Events queued (read without the lock: allocation skips polling when 0).
    pub(super) pending: AtomicUsize,
    check_invariants: bool,
    pub(super) birth: Birth,
}

impl PinnedAllocator {
    /// An allocator of page-locked memory from `driver` (the runtime's, sanitized when it is).
    pub fn new(driver: Arc<dyn Driver>, options: PinnedOptions) -> Arc<Self> {
        Self::build(driver, options, false)
    }

    /// As [`PinnedAllocator::new`], running the invariant scanner after every change (tests).
    pub fn with_invariant_checks(driver: Arc<dyn Driver>, options: PinnedOptions) -> Arc<Self> {
        Self::build(driver, options, true)
    }

    pub(crate) fn build(
        driver: Arc<dyn Driver>,
        options: PinnedOptions,
        check_invariants: bool,
    ) -> Arc<Self> {
        Arc::new(PinnedAllocator {
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

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// The state, locked — in the allocator's process only: `None` in a forked child, after a
    /// warning that `what` was ignored, and before the lock (which a thread of the parent may
    /// have held at the fork). For the doors that return no `Result`.
    pub(super) fn lock_unless_child(&self, what: &str) -> Option<MutexGuard<'_, State>> {
        (!self.birth.ignored_in_child(what)).then(|| self.state.lock())
    }

    /// Runs the invariant scanner when on; a violation panics (tests only turn it on).
    pub(super) fn checked(&self, state: &State) {
        if self.check_invariants {
            if let Err(violation) = state.check() {
                panic!("pinned allocator invariant violated: {violation}");
            }
        }
    }

    /// Checks the invariants now (`state.rs`); the first violation (an error in a forked
    /// child).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.birth
            .check("this pinned host allocator")
            .map_err(|err| err.to_string())?;
        self.lock().check()
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
            for mut pending in events {
                pending.ticket = state.next_ticket;
                state.next_ticket += 1;
                state.events.push_back(pending);
            }
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
            if state.events.front().is_none_or(|f| f.ticket != next.ticket) {
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
}

impl Drop for PinnedAllocator {
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
            if let Err(err) = self.driver.event_synchronize(pending.event) {
                tracing::error!(%err, block = pending.block,
                    "waiting for a pinned block's copies at teardown failed; it is released anyway");
            }
        }
        for pending in state.events {
            log_teardown(
                self.driver.event_destroy(pending.event),
                "destroying a pending event",
            );
        }
        for (_, block) in state.blocks {
            if block.source != Source::Reserve {
                let released = memory::release(&*self.driver, block.addr, block.size, block.source);
                log_teardown(released.map(drop), "releasing a pinned block");
            }
        }
        if let Some(reserve) = state.reserve {
            let released =
                memory::release(&*self.driver, reserve.base, reserve.size, reserve.source);
            log_teardown(released.map(drop), "releasing the pinned reserve segment");
        }
        for events in state.event_pool {
            for event in events {
                log_teardown(
                    self.driver.event_destroy(event),
                    "destroying a pooled event",
                );
            }
        }
    }
}

/// Logs a failed step of the allocator's teardown: what it held may stay with the driver until
/// the driver itself is dropped.
fn log_teardown(result: Result<()>, what: &str) {
    if let Err(err) = result {
        tracing::warn!(%err, "{what} at the pinned allocator's teardown failed");
    }
}
