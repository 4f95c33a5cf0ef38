//! [`Runtime`]: a caching allocator and the IPC state of its shared storages, side by side.
//!
//! The allocator (`alloc`) knows nothing of sharing; the IPC layer (`ipc`) knows nothing of
//! storages. The runtime is the one place that holds both: it registers the IPC limbo drain as the
//! allocator's first free-memory callback (a cache miss frees what consumers released before
//! asking the driver), answers `ipc_collect` and its relatives, sweeps what dead processes left in
//! `/dev/shm` when it starts, and at teardown keeps memory consumers still count on out of the
//! cache. [`Storage`](crate::Storage)s hold a runtime.
//!
//! It also holds the process's pinned host allocator (`pinned`), over the same driver, and with
//! it puts tags to sleep and wakes them (`sleep.rs`).
//!
//! It answers for its allocator itself (`allocator.rs`): allocation, streams, stats, snapshots,
//! pools, tags and captures are the runtime's methods; the allocator is not public.

mod allocator;
mod events;
mod sleep;

use crate::alloc::{CachingAllocator, CachingAllocatorBuilder};
use crate::config::AllocatorConfig;
use crate::driver::Driver;
use crate::error::Result;
use crate::ipc::{Drained, IpcState};
use crate::pinned::{PinnedAllocator, PinnedBuffer, PinnedOptions};
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex};

pub use events::Event;
pub use sleep::{SleepReport, WakeOptions, WakeReport};

static NEXT_RUNTIME_ID: AtomicU64 = AtomicU64::new(1);

/// Options of a [`Runtime`].
#[derive(Clone, Debug)]
pub struct RuntimeBuilder {
    allocator: CachingAllocatorBuilder,
    ipc_slots_per_file: u32,
    ipc_event_budget: usize,
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        RuntimeBuilder {
            allocator: CachingAllocatorBuilder::default(),
            ipc_slots_per_file: crate::ipc::refcount::DEFAULT_SLOTS,
            ipc_event_budget: crate::ipc::DEFAULT_EVENT_BUDGET,
        }
    }
}

impl RuntimeBuilder {
    /// Uses `config` (default: [`AllocatorConfig::default`]).
    pub fn config(mut self, config: AllocatorConfig) -> Self {
        self.allocator = self.allocator.config(config);
        self
    }

    /// Runs the allocator's invariant scanner after every mutation (tests).
    pub fn check_invariants(mut self, on: bool) -> Self {
        self.allocator = self.allocator.check_invariants(on);
        self
    }

    /// Checks the driver with the stream sanitizer (default: as `CUDALLOC_SANITIZE` says).
    pub fn sanitize(mut self, sanitize: crate::alloc::Sanitize) -> Self {
        self.allocator = self.allocator.sanitize(sanitize);
        self
    }

    /// Slots per IPC ref-counter file (default 10,000).
    pub fn ipc_slots_per_file(mut self, slots: u32) -> Self {
        self.ipc_slots_per_file = slots;
        self
    }

    /// Live interprocess events before sharing synchronizes instead (default 1,000).
    pub fn ipc_event_budget(mut self, events: usize) -> Self {
        self.ipc_event_budget = events;
        self
    }

    /// Builds the runtime over `driver`.
    pub fn build(self, driver: Arc<dyn Driver>) -> Result<Runtime> {
        // What dead processes left in /dev/shm goes before this process adds its own.
        if let Err(err) = crate::shm::sweep_orphans() {
            tracing::debug!(%err, "sweeping orphaned shared-memory objects failed");
        }
        let check_invariants = self.allocator.checks_invariants();
        let allocator = Arc::new(self.allocator.build(Arc::clone(&driver))?);
        // The allocator's driver: sanitized when the allocator is (the IPC layer's events and
        // copies are checked too).
        drop(driver);
        let ipc = Arc::new(IpcState::new(
            Arc::clone(allocator.driver()),
            self.ipc_slots_per_file,
            self.ipc_event_budget,
            allocator.config().ipc_handle_ttl_ms,
        ));
        // A cache miss first drains the IPC limbo (cost proportional to what consumers released).
        let weak_ipc = Arc::downgrade(&ipc);
        allocator.register_free_memory_callback(Arc::new(move || {
            weak_ipc
                .upgrade()
                .is_some_and(|ipc| ipc.drain().storages > 0)
        }));
        let host = PinnedAllocator::build(
            Arc::clone(allocator.driver()),
            PinnedOptions::from_config(&allocator.config()),
            check_invariants,
        );
        Ok(Runtime {
            id: NEXT_RUNTIME_ID.fetch_add(1, Ordering::Relaxed),
            allocator,
            ipc,
            host,
            sleepers: Mutex::new(sleep::Sleepers::default()),
        })
    }
}

/// A caching allocator with the IPC state of the storages it shares (see `src/runtime/mod.rs`).
pub struct Runtime {
    id: u64,
    allocator: Arc<CachingAllocator>,
    ipc: Arc<IpcState>,
    /// The pinned host allocator (`pinned`), over the same driver.
    host: Arc<PinnedAllocator>,
    /// The sleeping tags' offloaded bytes (`sleep.rs`).
    sleepers: Mutex<sleep::Sleepers>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("allocator", &self.allocator)
            .field("ipc", &self.ipc)
            .finish()
    }
}

impl Runtime {
    /// A builder with the default configuration.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// A runtime over `driver` with `config`.
    pub fn new(driver: Arc<dyn Driver>, config: AllocatorConfig) -> Result<Self> {
        Self::builder().config(config).build(driver)
    }

    /// The allocator (the runtime answers for it: `allocator.rs`).
    pub(crate) fn allocator(&self) -> &Arc<CachingAllocator> {
        &self.allocator
    }

    /// The caching allocator of page-locked host memory (`src/pinned/mod.rs`), configured by the
    /// `pinned_*` keys of the runtime's configuration.
    pub fn pinned_allocator(&self) -> &Arc<PinnedAllocator> {
        &self.host
    }

    /// A pinned host buffer of at least `len` bytes ([`PinnedAllocator::allocate`]).
    pub fn pinned(&self, len: u64) -> Result<PinnedBuffer> {
        self.host.allocate(len)
    }

    /// A number unique to this runtime in the process (keys of the storage layer's caches).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn ipc(&self) -> &Arc<IpcState> {
        &self.ipc
    }

    /// Frees shared storages that consumers released, those held only by dead consumer processes
    /// and those whose unopened handles expired; removes what dead processes left in `/dev/shm`.
    /// Returns what it freed (PyTorch's `torch.cuda.ipc_collect`).
    pub fn ipc_collect(&self) -> Drained {
        self.ipc.collect()
    }

    /// The cheap part of [`Self::ipc_collect`]: frees limbo storages whose slots consumers released
    /// since the last drain, reading only those releases (cost independent of the limbo's size).
    /// This is what every producer-side free and every cache miss run.
    pub fn ipc_drain(&self) -> Drained {
        self.ipc.drain()
    }

    /// Shared storages in limbo (dropped here, still counted by consumers) and their bytes.
    pub fn ipc_limbo(&self) -> (usize, u64) {
        self.ipc.limbo_size()
    }

    /// Memory of other processes mapped through this runtime's driver: whole segments (each opened
    /// once, however many storages live in it) and page spans of expandable segments (each mapped
    /// once, however many storages live on exactly those pages).
    pub fn ipc_open_segments(&self) -> usize {
        crate::ipc::open_segments(self.allocator.driver())
    }

    /// Bytes of address space this runtime's driver holds for memory received from other
    /// processes: whole segments opened through driver IPC handles, and the page spans mapped for
    /// storages of expandable segments (only the pages under each storage, never the producer's
    /// whole range).
    pub fn ipc_imported_address_space(&self) -> u64 {
        crate::ipc::imported_address_space(self.allocator.driver())
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Memory consumers still count on stays allocated (out of the cache) until process exit.
        self.ipc.shutdown();
    }
}
