//! The caching allocator: PyTorch's `CUDACachingAllocator` policy, sharded per (device, stream).
//!
//! The files, from the ground up — each names only files listed before it (`tests/layering.rs`
//! fails on a circle inside any folder):
//!
//! * `size.rs` — rounding, pools, segment sizes, split and oversize rules; `stats.rs` — PyTorch's
//!   stats keys; `pool_id.rs` — memory pools' ids and options; `capturing.rs` — the stream
//!   captures under way and the pool each allocates from.
//! * `block.rs` — blocks tiling segments, segment and page records; `pool.rs` — best-fit free pools.
//! * `stacks.rs` — recorded Rust stacks; `nvtx_regions.rs` — mapped memory as NVTX heaps and live
//!   blocks as regions of them; `history.rs` — the memory history (trace ring), the one door
//!   through which the allocator tells what happened to its memory (it feeds `nvtx_regions.rs`);
//!   `observers.rs`, `registration.rs`, `oom.rs` — segment and out-of-memory observers, the
//!   registry of mapped regions and the registrars that register them with transfer engines,
//!   callbacks and the message.
//! * `front.rs` — thread front caches (`thread_cache_mb`, off by default): a thread's freed blocks
//!   reused by its own allocations without the stream's lock, the one deviation from PyTorch's
//!   reuse order, opt-in.
//! * `engine/` — the engine: `Shard`, `ShardState`, `DeviceCore` and the peak book with private
//!   fields, and their concerns as child modules (the shard's state and free path, the one
//!   hand-over of a block's bytes, per-thread shard caches, the device-wide paths — miss
//!   sequence, release, expandable segments, sleep, exact peaks —, snapshots and invariants).
//!   Its module docs list the files; the rest of `alloc/` uses a handful of its methods.
//! * `summary.rs` (the summary table), `pytorch_pickle.rs` (snapshots in PyTorch's pickled
//!   layout), `reports.rs` (what the allocator reports, PyTorch's names for it).
//! * `data_ptr.rs` — [`DataPtr`] and its owners; upper layers attach theirs as trait objects.
//! * `mem_pool.rs` — private memory pools ([`MemPool`], `use_mem_pool`): shards of their own,
//!   retired when a pool drops; `tags.rs` — tags (named pools on expandable segments of their
//!   own) and the phases of their sleep; `graph.rs` — CUDA graphs through the allocator ([`Capture`],
//!   [`Graph`]): a capture's private pool, replays, the pool kept while the graph lives.
//! * `reconfigure.rs` — settings changed on a live allocator, one key at a time or for a scope
//!   ([`ConfigOverride`]).
//! * this file — [`CachingAllocator`], the builder and the allocator's public face.
//!
//! The allocator knows nothing of sharing or copy-on-write: it hands out and takes back
//! `DataPtr`s. IPC administration (ref-counter files, limbo, `ipc_collect`) lives in
//! [`crate::Runtime`], which holds an allocator and the IPC state side by side.
//!
//! A segment belongs to one stream at a time (for its whole life, as in PyTorch, unless
//! `cross_stream_reuse` hands an idle one to another stream: `engine/cross_stream.rs`), so each
//! (device, stream) owns its pools and segments under its own lock: threads on different streams never contend, and
//! a free finds its shard through the [`DataPtr`]'s owner — there is no global pointer map and no
//! device-wide mutex on the hot path.

mod block;
mod capturing;
mod data_ptr;
mod engine;
mod front;
mod graph;
mod history;
mod mem_pool;
mod nvtx_regions;
pub(crate) mod observers;
mod oom;
mod pool;
mod pool_id;
#[cfg(feature = "pickle")]
mod pytorch_pickle;
mod reconfigure;
mod registration;
mod reports;
pub(crate) mod size;
mod stacks;
mod stats;
mod summary;
mod tags;

pub use engine::pool_peaks::PoolsReserved;
pub use engine::roster::Bookkeeping;
pub use engine::snapshot::{Snapshot, SnapshotBlock, SnapshotBlockState, SnapshotSegment};
pub use graph::{Capture, CaptureRoute, Graph, GraphPool};
pub use history::{trace_json_lines, HistoryMode, HistoryOptions, TraceAction, TraceEntry};
pub use mem_pool::{MemPool, PoolScope};
pub use observers::{
    OutOfMemoryEvent, OutOfMemoryObserver, SegmentChange, SegmentEvent, SegmentObserver,
};
pub use oom::{format_size, FreeMemoryCallback};
pub use pool_id::{MemPoolId, MemPoolOptions};
pub use reconfigure::ConfigOverride;
pub use registration::{
    OnRegistrationFailure, Region, RegionKind, RegisteredRegion, Registrar, RegistrarId,
    RegistrarStats, RegistrationStats, SegmentId,
};
pub use stacks::Frame;
pub use stats::{DeviceStats, PoolStats, Stat};

pub(crate) use capturing::{any_capture_under_way, note_captured_use, CapturedUse};
pub use data_ptr::DataPtr;
pub(crate) use data_ptr::{take_shared, BlockOwner, Owner, SharedOwner};
pub(crate) use engine::expandable::PagesUnder;
pub(crate) use tags::{SleepStart, TagRange};

use self::block::Allocated;
use self::capturing::CaptureRoutes;
use self::engine::device::AllocatorWide;
use self::engine::Shard;
use self::engine::{Cores, DeviceCore};
use self::history::Trace;
use self::oom::Callbacks;
use self::tags::Tags;
use crate::config::cell::ConfigCell;
use crate::config::{AllocatorConfig, DefaultStream};
use crate::driver::{DeviceAddr, Driver, SanitizeOptions, SanitizedDriver, StreamId};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex};

static NEXT_ALLOCATOR_ID: AtomicU64 = AtomicU64::new(1);

/// No library default stream set (`CachingAllocator::library_defaults`).
const NO_STREAM: u64 = u64::MAX;

/// Options of a [`CachingAllocator`].
#[derive(Clone, Debug, Default)]
pub(crate) struct CachingAllocatorBuilder {
    config: AllocatorConfig,
    check_invariants: bool,
    sanitize: Sanitize,
}

/// Whether an allocator's driver is checked by the stream sanitizer
/// (`src/driver/sanitizer/mod.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Sanitize {
    /// As `CUDALLOC_SANITIZE` says (unset: off).
    #[default]
    FromEnv,
    /// Off, whatever the environment says.
    Off,
    /// On with these options, whatever the environment says.
    On(SanitizeOptions),
}

impl CachingAllocatorBuilder {
    /// Uses `config` (default: [`AllocatorConfig::default`]).
    pub(crate) fn config(mut self, config: AllocatorConfig) -> Self {
        self.config = config;
        self
    }

    /// Runs the invariant scanner after every mutation and panics on a violation (tests).
    pub(crate) fn check_invariants(mut self, on: bool) -> Self {
        self.check_invariants = on;
        self
    }

    /// Whether the invariant scanner runs (the runtime's pinned allocator follows it).
    pub(crate) fn checks_invariants(&self) -> bool {
        self.check_invariants
    }

    /// Checks the driver with the stream sanitizer (default: as `CUDALLOC_SANITIZE` says).
    pub(crate) fn sanitize(mut self, sanitize: Sanitize) -> Self {
        self.sanitize = sanitize;
        self
    }

    /// Builds the allocator over `driver` (wrapped in a [`SanitizedDriver`] when sanitizing).
    pub(crate) fn build(self, driver: Arc<dyn Driver>) -> Result<CachingAllocator> {
        self.config.check_combination()?;
        let options = match self.sanitize {
            Sanitize::FromEnv => SanitizeOptions::from_env()?,
            Sanitize::Off => None,
            Sanitize::On(options) => Some(options),
        };
        let driver = match options {
            Some(options) => SanitizedDriver::wrap(driver, options),
            None => driver,
        };
        let stream_order = self.config.stream_order;
        let nvtx_regions = self.config.nvtx_regions;
        let per_thread_default = self.config.default_stream == DefaultStream::PerThread;
        let config = ConfigCell::new(self.config);
        let callbacks = Arc::new(Callbacks::default());
        let trace = Arc::new(Trace::default());
        let capturing = Arc::new(CaptureRoutes::default());
        let tags = Arc::new(Tags::default());
        if nvtx_regions {
            let phases = Arc::clone(&tags) as Arc<dyn pool_id::TagPhases>;
            let captures = Arc::clone(&capturing);
            if let Some(regions) = nvtx_regions::NvtxRegions::attach(phases, captures) {
                trace.follow_with(regions);
            }
        }
        let wide = AllocatorWide {
            callbacks: Arc::clone(&callbacks),
            trace: Arc::clone(&trace),
            capturing: Arc::clone(&capturing),
            tags: Arc::clone(&tags) as Arc<dyn pool_id::TagPhases>,
        };
        let devices = (0..driver.device_count())
            .map(|d| {
                DeviceCore::new(
                    d,
                    Arc::clone(&driver),
                    (*config.get()).clone(),
                    wide.clone(),
                    self.check_invariants,
                )
                .map(Arc::new)
            })
            .collect::<Result<Vec<_>>>()?;
        // Streams the allocator makes itself (dedicated, per-thread) are destroyed with it.
        let owned_streams = Mutex::new(Vec::new());
        let default_streams = (0..driver.device_count())
            .map(|d| match config.get().default_stream {
                DefaultStream::Dedicated => {
                    let s = driver.stream_create(d)?;
                    owned_streams.lock().push(s);
                    Ok(s)
                }
                _ => driver.default_stream(d),
            })
            .collect::<Result<Vec<_>>>()?;
        let birth = Birth::now();
        Ok(CachingAllocator {
            id: NEXT_ALLOCATOR_ID.fetch_add(1, Ordering::Relaxed),
            birth,
            library_defaults: (0..driver.device_count())
                .map(|_| AtomicU64::new(NO_STREAM))
                .collect(),
            default_generation: AtomicU64::new(0),
            default_streams,
            owned_streams,
            driver,
            config,
            stream_order,
            per_thread_default,
            devices: Cores::new(birth, devices),
            callbacks,
            trace,
            capturing,
            tags,
            #[cfg(feature = "pickle")]
            oom_dump: Mutex::new(()),
        })
    }
}

/// A caching allocator over any [`Driver`], for all its devices.
pub(crate) struct CachingAllocator {
    id: u64,
    /// The process this allocator belongs to (see `process`): in a forked child it refuses
    /// allocation and stream work and releases nothing.
    birth: Birth,
    /// A library's default stream per device (raw id; `NO_STREAM`: none), set with
    /// [`Runtime::set_default_stream`](crate::Runtime::set_default_stream); it overrides the `default_stream` setting.
    library_defaults: Vec<AtomicU64>,
    /// Bumped whenever a library default changes: threads' cached current shards of an older
    /// generation miss.
    default_generation: AtomicU64,
    default_streams: Vec<StreamId>,
    owned_streams: Mutex<Vec<StreamId>>,
    driver: Arc<dyn Driver>,
    config: ConfigCell,
    /// `stream_order`, fixed for the allocator's life (`config/live.rs`): read on every storage
    /// access.
    stream_order: crate::config::StreamOrder,
    /// `default_stream:per_thread`, fixed for the allocator's life: read by every allocation on
    /// a thread's default stream.
    per_thread_default: bool,
    /// The devices, reached through the fork check only (`engine::Cores`).
    devices: Cores,
    callbacks: Arc<Callbacks>,
    trace: Arc<Trace>,
    /// The captures under way and their pools (`capturing.rs`, `graph.rs`).
    capturing: Arc<CaptureRoutes>,
    /// The tags, one record each: name, pool, phase (`tags.rs`); the devices read their phases.
    tags: Arc<Tags>,
    /// Serializes the snapshots written on out-of-memory (`oom_snapshot_path`).
    #[cfg(feature = "pickle")]
    oom_dump: Mutex<()>,
}

impl std::fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("backend", &self.driver.backend())
            .field("devices", &self.devices.len())
            .field("config", &self.config)
            .finish()
    }
}

/// Restores the previous current stream when dropped (see [`Runtime::set_current_stream`](crate::Runtime::set_current_stream)).
///
/// Hold it for as long as the stream should be current: `let _on = …set_current_stream(s)?;`
/// (`let _ = …` or a bare statement drops it at once, and the stream was current for nothing).
/// It cannot move to another thread: the current stream is the setting thread's.
///
/// Dropping it at once is a warning (an error here):
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// fn f() -> cudalloc::Result<()> {
///     let runtime = cudalloc::GLOBAL.get()?;
///     let side = runtime.create_stream(0)?;
///     runtime.set_current_stream(side)?; // current for nothing
///     Ok(())
/// }
/// ```
///
/// and sending it to another thread does not compile:
///
/// ```compile_fail
/// fn f() -> cudalloc::Result<()> {
///     let runtime = cudalloc::GLOBAL.get()?;
///     let side = runtime.create_stream(0)?;
///     let on = runtime.set_current_stream(side)?;
///     std::engine::thread::spawn(move || drop(on));
///     Ok(())
/// }
/// ```
#[derive(Debug)]
#[must_use = "the stream is current only while the guard lives: bind it (`let _on = ...`)"]
pub struct StreamGuard {
    key: (u64, usize),
    previous: Option<StreamId>,
    /// `!Send`: dropped on another thread, it would restore that thread's stream, not ours.
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        engine::thread::set_current_stream(self.key.0, self.key.1, self.previous);
    }
}

impl CachingAllocator {
    /// The driver underneath (a [`SanitizedDriver`] when the sanitizer is on).
    pub(crate) fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// The body of [`Runtime::sanitizer`](crate::Runtime::sanitizer), documented there.
    pub(crate) fn sanitizer(&self) -> Option<Arc<crate::driver::Sanitizer>> {
        self.driver.sanitizer()
    }

    /// The configuration in force (as of this call: `reconfigure` publishes another; this one
    /// stays readable as long as it is held).
    pub(crate) fn config(&self) -> Arc<AllocatorConfig> {
        self.config.get()
    }

    /// Whether storages order their accesses themselves (`stream_order`, fixed for the
    /// allocator's life).
    #[inline]
    pub(crate) fn stream_order(&self) -> crate::config::StreamOrder {
        self.stream_order
    }

    /// The body of [`Runtime::device_count`](crate::Runtime::device_count), documented there.
    pub(crate) fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// `Ok` in the process that built the allocator; in a forked child
    /// [`Error::ForkedChild`] saying that `what` belongs to the parent — for the objects above
    /// the allocator that lock state of their own (storages, the runtime's sleepers) to ask
    /// before they take a lock.
    #[inline]
    pub(crate) fn check_process(&self, what: &str) -> Result<()> {
        self.birth.check(what)
    }

    fn device(&self, device: usize) -> Result<&Arc<DeviceCore>> {
        self.devices.get(device, "this allocator")
    }

    /// The body of [`Runtime::default_stream`](crate::Runtime::default_stream), documented there.
    pub(crate) fn default_stream(&self, device: usize) -> Result<StreamId> {
        if let Some(library) = self.library_defaults.get(device) {
            let raw = library.load(Ordering::Acquire);
            if raw != NO_STREAM {
                return Ok(StreamId(raw));
            }
        }
        let shared = self.default_streams.get(device).copied().ok_or_else(|| {
            Error::invalid(format!(
                "device {device} does not exist ({} device(s))",
                self.devices.len()
            ))
        })?;
        if !self.per_thread_default {
            return Ok(shared);
        }
        if let Some(stream) = engine::thread::per_thread_stream(self.id, device) {
            return Ok(stream);
        }
        let stream = self.driver.stream_create(device)?;
        self.owned_streams.lock().push(stream);
        engine::thread::set_per_thread_stream(self.id, device, stream);
        Ok(stream)
    }

    /// The body of [`Runtime::set_default_stream`](crate::Runtime::set_default_stream), documented there.
    pub(crate) fn set_default_stream(&self, stream: StreamId) -> Result<()> {
        let device = self.driver.stream_device(stream)?;
        let slot = self.library_defaults.get(device).ok_or_else(|| {
            Error::invalid(format!(
                "stream {} is on unknown device {device}",
                stream.raw()
            ))
        })?;
        if stream.raw() == NO_STREAM {
            return Err(Error::invalid("stream id reserved"));
        }
        slot.store(stream.raw(), Ordering::Release);
        self.default_generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Gives `device` back its configured default stream (undoes
    /// [`Runtime::set_default_stream`](crate::Runtime::set_default_stream)).
    pub(crate) fn clear_default_stream(&self, device: usize) -> Result<()> {
        self.device(device)?;
        if let Some(slot) = self.library_defaults.get(device) {
            slot.store(NO_STREAM, Ordering::Release);
        }
        self.default_generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// The body of [`Runtime::import_stream`](crate::Runtime::import_stream), documented there.
    pub(crate) unsafe fn import_stream(&self, device: usize, raw: u64) -> Result<StreamId> {
        self.device(device)?;
        // SAFETY: forwarded; the caller upholds the driver's contract.
        unsafe { self.driver.interop().import_stream(device, raw) }
    }

    /// The body of [`Runtime::raw_stream`](crate::Runtime::raw_stream), documented there.
    pub(crate) fn raw_stream(&self, stream: StreamId) -> Result<u64> {
        self.driver.interop().raw_stream(stream)
    }

    /// The shard of `stream`: from this thread's cache, else from its device (and cached).
    #[inline]
    fn shard_of(&self, stream: StreamId) -> Result<&Shard> {
        if self.capturing.any() {
            return self.shard_while_capturing(stream);
        }
        let shard = match engine::thread::cached_shard(self.id, stream) {
            Some(shard) => shard,
            None => {
                let (pool, options) =
                    engine::thread::current_pool(self.id, stream.device()).unwrap_or_default();
                let device = self.device(stream.device())?;
                let shard = Arc::as_ptr(&device.shard_in(stream, pool, options)?);
                engine::thread::cache_shard(self.id, stream, shard);
                shard
            }
        };
        // SAFETY: `shard` is a shard of this allocator (cached under its never-reused id, or just
        // taken from its device). Its device holds it — in its map, or once its memory pool is
        // dropped in its retired list — until this allocator's `Drop`, which cannot run while
        // `&self` is borrowed, so it lives at least as long as the result.
        Ok(unsafe { &*shard })
    }

    /// The shard of `stream` while a capture is under way, uncached: the capture's pool when the
    /// stream is captured by one of this allocator's captures, else as [`Self::shard_of`] finds
    /// it (`capturing.rs`).
    #[cold]
    fn shard_while_capturing(&self, stream: StreamId) -> Result<&Shard> {
        let captured = self
            .driver
            .graphs()
            .stream_capture_status(stream)?
            .capture_id()
            .and_then(|id| self.capturing.pool_of(id));
        let (pool, options) = captured
            .or_else(|| engine::thread::current_pool(self.id, stream.device()))
            .unwrap_or_default();
        let device = self.device(stream.device())?;
        let shard = Arc::as_ptr(&device.shard_in(stream, pool, options)?);
        // SAFETY: as in `shard_of`: a shard of this allocator's device, held until its `Drop`.
        Ok(unsafe { &*shard })
    }

    /// The body of [`Runtime::create_stream`](crate::Runtime::create_stream), documented there.
    pub(crate) fn create_stream(&self, device: usize) -> Result<StreamId> {
        self.driver.stream_create(device)
    }

    /// Waits for `stream`'s work and destroys it. The memory cached for it is not stranded:
    /// under `cross_stream_reuse:segments` or `blocks` other streams take it over without a
    /// wait (its work is done), under `off` its whole idle segments go back to the driver now
    /// (`engine/cross_stream.rs`). Blocks still allocated on it stay valid and return to its
    /// cache when freed. The device's default stream (and a stream being captured) is refused.
    pub(crate) fn destroy_stream(&self, stream: StreamId) -> Result<()> {
        let device = self.driver.stream_device(stream)?;
        if self.default_stream(device)? == stream {
            return Err(Error::invalid(format!(
                "stream {} is device {device}'s default stream: it is not destroyed",
                stream.raw()
            )));
        }
        if self.capturing.any()
            || self
                .driver
                .graphs()
                .stream_capture_status(stream)?
                .is_capturing()
        {
            return Err(Error::capture(format!(
                "stream {} cannot be destroyed while a stream capture is under way (its \
                 synchronization would invalidate the capture): end the capture first",
                stream.raw()
            )));
        }
        let core = self.device(device)?;
        self.driver.stream_synchronize(stream)?;
        // Finished before the destruction, so no search meanwhile waits on a dead stream; the
        // work it would wait for is done.
        core.mark_finished(stream, true);
        if let Err(err) = self.driver.stream_destroy(stream) {
            core.mark_finished(stream, false);
            return Err(err);
        }
        core.stream_finished(stream);
        Ok(())
    }

    /// The body of [`Runtime::current_stream`](crate::Runtime::current_stream), documented there.
    pub(crate) fn current_stream(&self, device: usize) -> Result<StreamId> {
        match engine::thread::current_stream(self.id, device) {
            Some(stream) => Ok(stream),
            None => self.default_stream(device),
        }
    }

    /// The body of [`Runtime::set_current_stream`](crate::Runtime::set_current_stream), documented there.
    pub(crate) fn set_current_stream(&self, stream: StreamId) -> Result<StreamGuard> {
        let device = self.driver.stream_device(stream)?;
        let previous = engine::thread::set_current_stream(self.id, device, Some(stream));
        Ok(StreamGuard {
            key: (self.id, device),
            previous,
            _this_thread: std::marker::PhantomData,
        })
    }

    /// The body of [`Runtime::allocate`](crate::Runtime::allocate), documented there.
    pub(crate) fn allocate(&self, device: usize, size: u64) -> Result<DataPtr> {
        self.birth.check("this allocator")?;
        if size == 0 {
            self.device(device)?;
            return Ok(DataPtr::empty(device));
        }
        if self.capturing.any() {
            let shard = self.shard_of(self.current_stream(device)?)?;
            return self.allocate_in(shard, size);
        }
        let generation = self.default_generation.load(Ordering::Acquire);
        let shard = match engine::thread::current_shard(self.id, device, generation) {
            // SAFETY: as in `shard_of`: a shard of this allocator, alive while `&self` is.
            Some(shard) => unsafe { &*shard },
            None => {
                let shard = self.shard_of(self.current_stream(device)?)?;
                engine::thread::cache_current_shard(self.id, device, generation, shard);
                shard
            }
        };
        self.allocate_in(shard, size)
    }

    /// The body of [`Runtime::allocate_on`](crate::Runtime::allocate_on), documented there.
    pub(crate) fn allocate_on(&self, stream: StreamId, size: u64) -> Result<DataPtr> {
        self.birth.check("this allocator")?;
        if size == 0 {
            return Ok(DataPtr::empty(self.driver.stream_device(stream)?));
        }
        self.allocate_in(self.shard_of(stream)?, size)
    }

    /// Allocates `size` (> 0) bytes from `shard`.
    #[inline]
    fn allocate_in(&self, shard: &Shard, size: u64) -> Result<DataPtr> {
        if shard.front_limit() > 0 {
            if let Some(hit) = shard.take_from_front(size) {
                return self.data_ptr(shard, shard, &hit, size);
            }
        }
        let mut lender = None;
        let a = match shard.allocate(size, &mut lender) {
            Ok(a) => a,
            Err(err) => {
                if matches!(err, Error::OutOfMemory { .. }) {
                    self.dump_snapshot_on_oom();
                }
                return Err(err);
            }
        };
        self.data_ptr(lender.as_deref().unwrap_or(shard), shard, &a, size)
    }

    /// The pointer owning block `a`, just handed out by `owner` (from its pools or this thread's
    /// front cache) for use on `user`'s stream (the same shard, or a lender: a `use_on_oom` pool
    /// on the same stream, another stream under `cross_stream_reuse:blocks`). The sanitizer is
    /// told of the `requested` bytes, not the rounded block: an access past what was asked for
    /// is out of bounds even inside the rounding.
    #[inline]
    fn data_ptr(
        &self,
        owner: &Shard,
        user: &Shard,
        a: &Allocated,
        requested: u64,
    ) -> Result<DataPtr> {
        // SAFETY: the shard (or a front cache of it) just handed `a.block` out, counted in its
        // owners; this is its only owner.
        let data = match unsafe { BlockOwner::new(owner, a) } {
            Some(block) => DataPtr::new(DeviceAddr(a.ptr), owner.device(), Owner::Block(block)),
            None => return Err(owner.refuse_block(a.block)),
        };
        // After the pointer owns the block: in the sanitizer's panic mode the unwinding frees it.
        user.handed_out(a.ptr, requested, a.rounded);
        Ok(data)
    }

    /// Makes work next enqueued on `to` wait for the work queued on `used` so far, across
    /// captures too (`engine/handover.rs`); an error when `used` is captured by a capture this
    /// allocator did not begin.
    pub(crate) fn order_after(&self, to: StreamId, used: StreamId) -> Result<()> {
        self.device(self.driver.stream_device(to)?)?
            .order_after(to, used)
    }

    /// The body of [`Runtime::record_stream`](crate::Runtime::record_stream), documented there.
    pub(crate) fn record_stream(&self, data: &DataPtr, stream: StreamId) -> Result<()> {
        data.record_stream(stream)
    }

    /// The body of [`Runtime::clone_data`](crate::Runtime::clone_data), documented there.
    pub(crate) fn clone_data(
        &self,
        src: &DataPtr,
        nbytes: u64,
        stream: StreamId,
    ) -> Result<DataPtr> {
        let device = self.driver.stream_device(stream)?;
        if device != src.device() {
            return Err(Error::invalid(format!(
                "clone: source on device {} but stream on device {device}",
                src.device()
            )));
        }
        let out = self.allocate_on(stream, nbytes)?;
        if nbytes > 0 {
            // SAFETY: the allocator's own copy into `out`, a block no one else holds yet, from `src`, read only.
            unsafe {
                self.driver
                    .copy_device_to_device(stream, out.ptr(), src.ptr(), nbytes)
            }?;
            self.record_stream(src, stream)?;
        }
        Ok(out)
    }

    /// The body of [`Runtime::register_segment_observer`](crate::Runtime::register_segment_observer), documented there.
    pub(crate) fn register_segment_observer(&self, observer: SegmentObserver) {
        if self
            .birth
            .ignored_in_child("registering a segment observer")
        {
            return;
        }
        self.callbacks.observers.add_segment(observer);
    }

    /// The body of [`Runtime::attach_registrar`](crate::Runtime::attach_registrar), documented there.
    pub(crate) fn attach_registrar(
        &self,
        registrar: Arc<dyn Registrar>,
        on_failure: OnRegistrationFailure,
    ) -> Result<RegistrarId> {
        self.birth.check("this allocator")?;
        self.callbacks.registry.attach(registrar, on_failure)
    }

    /// The body of [`Runtime::detach_registrar`](crate::Runtime::detach_registrar), documented there.
    pub(crate) fn detach_registrar(&self, id: RegistrarId) -> bool {
        if self.birth.ignored_in_child("detaching a registrar") {
            return false;
        }
        self.callbacks.registry.detach(id)
    }

    /// The regions mapped now and each attached registrar's figures (none in a forked child:
    /// the registry is the parent's, and its lock may be held for good there).
    pub(crate) fn registration_stats(&self) -> RegistrationStats {
        if self
            .birth
            .ignored_in_child("reading the registration statistics")
        {
            return RegistrationStats::default();
        }
        self.callbacks.registry.stats()
    }

    /// The body of [`Runtime::registered_regions`](crate::Runtime::registered_regions), documented there.
    pub(crate) fn registered_regions(
        &self,
        device: usize,
        addr: DeviceAddr,
        len: u64,
    ) -> Result<Vec<RegisteredRegion>> {
        self.birth.check("this allocator")?;
        self.callbacks.registry.regions_of(device, addr.0, len)
    }

    /// The body of [`Runtime::register_out_of_memory_observer`](crate::Runtime::register_out_of_memory_observer), documented there.
    pub(crate) fn register_out_of_memory_observer(&self, observer: OutOfMemoryObserver) {
        if self
            .birth
            .ignored_in_child("registering an out-of-memory observer")
        {
            return;
        }
        self.callbacks.observers.add_out_of_memory(observer);
    }

    /// The body of [`Runtime::register_free_memory_callback`](crate::Runtime::register_free_memory_callback), documented there.
    pub(crate) fn register_free_memory_callback(&self, callback: FreeMemoryCallback) {
        if self
            .birth
            .ignored_in_child("registering a free-memory callback")
        {
            return;
        }
        self.callbacks.register(callback);
    }

    /// Waits for pending frees and returns every cached whole segment of every device to the driver.
    /// In a forked child it does nothing (the cached segments are the parent's).
    pub(crate) fn empty_cache(&self) {
        let Some(devices) = self.devices.unless_child("emptying the cache") else {
            return;
        };
        if self.capturing.any() {
            tracing::warn!("empty_cache during a stream capture does nothing: releasing would synchronize and free, which the capture forbids");
            return;
        }
        for d in devices {
            d.release_cached(true);
        }
    }

    /// Runs the invariant scanner over every shard.
    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        self.devices
            .all("this allocator")
            .map_err(|err| err.to_string())?
            .iter()
            .try_for_each(|d| d.check_invariants())
    }
}

impl Drop for CachingAllocator {
    fn drop(&mut self) {
        let Some(devices) = self.devices.in_its_process() else {
            // A forked child's copy: the shards, segments and streams are the parent's.
            self.devices.leak_in_child();
            crate::process::leak_in_child(self.birth, &mut self.owned_streams);
            return;
        };
        for d in devices {
            d.shutdown();
        }
        for stream in self.owned_streams.lock().drain(..) {
            if let Err(err) = self.driver.stream_destroy(stream) {
                tracing::debug!(%err, "destroying an allocator's own stream failed");
            }
        }
        // The tags' pools hold their devices, which hold the tags: the cycle ends here.
        self.tags.clear();
    }
}
