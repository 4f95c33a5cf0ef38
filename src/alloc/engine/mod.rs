//! The allocator's engine: the types that point at each other — a [`Shard`] (one (device,
//! stream, pool)'s lock and [`ShardState`]) holds its [`DeviceCore`]; the core holds its shards
//! and the [`PeakBook`] that knows each shard by a weak reference — defined here with **private
//! fields**, and their concerns as child modules, which see those fields (the pattern of
//! `driver/host/`). The rest of `alloc/` (the allocator's face in `mod.rs`, pools, tags, graphs,
//! `DataPtr`) reaches them through a handful of methods: a shard's stream, device, birth and front
//! limit, its allocation and hand-out, its part in a sleep, a pool's view of it. A shard's lock is
//! taken in this folder only. The allocator, its pools and its captures hold their devices as
//! [`Cores`], which hands a `DeviceCore` out only after the fork check (`process`).
//!
//! | file | what it does with these types |
//! |---|---|
//! | `state.rs` | the operations on one shard's state under its lock: split/merge, pending frees |
//! | `handover.rs` | when a block's bytes change owner and what the next owner waits for: the one place that decides it, with the block's lifecycle as a state table |
//! | `shard.rs` | one shard: its face to the rest of `alloc/`, the free path, orphaning, front-cache helpers, its teardown |
//! | `thread.rs` | per-thread state: current streams and a cache of shard pointers (no lock, no atomic on the hot path) |
//! | `snapshot.rs`, `invariants.rs` | a shard's segments as a snapshot; the scanner tests run after every mutation |
//! | `roster.rs` | one device's lists of shards (live by (stream, pool), retired, buried) and the streams being destroyed: the only place a shard moves between them |
//! | `device_shards.rs` | what the device does with its shards: creation (or recycling) per (stream, pool), lending, retiring and burying |
//! | `device.rs` | one device: the hit and miss paths, release, stats, snapshots |
//! | `device_release.rs` | giving cached memory back (`empty_cache`, the miss path's releases, GC) |
//! | `explain.rs` | why an allocation ran out of memory: the figures of the error and its event, on the failure path only |
//! | `cross_stream.rs` | idle memory moving between streams on a miss (`cross_stream_reuse`): another stream's whole idle segment taken over, or its free block lent |
//! | `expandable.rs` | expandable segments: growth and the release of whole pages |
//! | `sleep.rs` | sleep and wake of a tag's shards: their pages unmapped and mapped back |
//! | `peaks.rs` | exact device-wide peaks: the book's reads, grants and reconciles |
//! | `pool_peaks.rs` | each memory pool's peaks (resettable) and what pools and graphs reserve |
//!
//! The fields' own types live below the engine (`block.rs`, `pool.rs`, `front.rs`, `stats.rs`,
//! …); no file of the engine names a file of `alloc/` above it.

mod cross_stream;
pub(in crate::alloc) mod device;
mod device_release;
pub(in crate::alloc) mod device_shards;
pub(in crate::alloc) mod expandable;
mod explain;
pub(in crate::alloc) mod handover;
mod invariants;
mod peaks;
pub(in crate::alloc) mod pool_peaks;
pub(in crate::alloc) mod roster;
mod shard;
mod sleep;
pub(in crate::alloc) mod snapshot;
pub(in crate::alloc) mod state;
pub(in crate::alloc) mod thread;

use std::collections::{BTreeMap, HashMap, VecDeque};

use slab::Slab;

use super::block::{Block, BlockId, ExpandablePages, SegmentInfo};
use super::front::FrontRegistry;
use super::pool::FreePool;
use super::pool_id::MemPoolId;
use super::pool_id::MemPoolOptions;
use super::stats::DeviceStats;
use super::stats::PEAK_STATS;
use crate::config::cell::{ConfigCell, FitRules};
use crate::driver::{Driver, EventId, StreamId};
use crate::process::Birth;
use crate::sync::os::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex, ShortMutex, Weak};

/// One (device, stream) shard. Aligned to 128 bytes (two cache lines: the adjacent-line
/// prefetcher pairs them) so that two shards' locks and hot state never share a line, wherever the
/// heap puts them.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Shard {
    /// The stream (`StreamId`'s raw value). Fixed while the shard serves it; an empty shard of a
    /// destroyed stream is recycled for the next stream's shard (`device_shards.rs`), and only
    /// then does it change, with `serial`.
    stream: AtomicU64,
    /// Unique in the process, never reused: tells this shard from a later one at the same address,
    /// or from the same shard recycled for another stream (thread-local caches compare it;
    /// `thread.rs`).
    serial: AtomicU64,
    /// `thread_cache_mb` in bytes (0: no front caches), next to the lock the free path takes.
    front_limit: AtomicU64,
    /// The process the allocator belongs to, next to the hot fields: a forked child's frees
    /// release nothing (`process`).
    birth: Birth,
    /// The stream sanitizer (when on), next to the hot fields: told of hand-outs and frees.
    sanitizer: Option<Arc<crate::driver::Sanitizer>>,
    state: ShortMutex<ShardState>,
    core: Arc<DeviceCore>,
    /// Every thread's front cache of this shard (`front.rs`; empty unless `thread_cache_mb`).
    fronts: Mutex<FrontRegistry>,
    /// The shard's pool is a tag that sleeps (`sleep.rs`): allocations are refused. Set before
    /// the shard's lock is taken to collect what to offload, read on every allocation of the
    /// shard (once before, once under the lock), cleared when the tag is awake again.
    sleeping: AtomicBool,
    /// Its stream was synchronized and destroyed (`Runtime::destroy_stream`): nothing of it is
    /// left to wait for, so its idle memory goes to another stream without a wait
    /// (`cross_stream.rs`).
    finished: AtomicBool,
}

/// Everything an allocator keeps per device.
pub(crate) struct DeviceCore {
    device: usize,
    /// The process the allocator belongs to (see `process`).
    birth: Birth,
    driver: Arc<dyn Driver>,
    config: ConfigCell,
    /// What the allocator's devices share: callbacks, history, captures under way
    /// (`capturing.rs`), tags and which sleep (`sleep.rs`).
    wide: device::AllocatorWide,
    check_invariants: bool,
    /// The stream sanitizer, when the driver is sanitized: told of every hand-out and free.
    sanitizer: Option<Arc<crate::driver::Sanitizer>>,
    /// The driver for the events of pending frees: the unsanitized one under a sanitizer (the
    /// allocator's polls and waits on them are its own, not the program's synchronization; the
    /// sanitizer covers that reuse with the free's clock).
    free_events: Arc<dyn Driver>,
    capacity: u64,
    /// Bytes of live segments on this device (all shards).
    reserved: AtomicU64,
    /// The shards: one per (stream, memory pool) in use, the retired and the buried ones, and
    /// the streams being destroyed (`roster.rs`).
    roster: roster::Roster,
    /// Events of pending frees no longer pending, for the next.
    events: Mutex<Vec<EventId>>,
    /// The device-wide counts no shard keeps (`device.rs`).
    counters: device::Counters,
    /// The recorded device-wide peaks (`peaks.rs`) and each live pool's (`pool_peaks.rs`).
    books: Books,
    /// Segments whose release a capture held back (`device_release.rs`).
    withheld: device_release::Withheld,
}

/// An allocator's devices, reached only through the fork check (`process`; DESIGN's "one door
/// for forks"): every way to a [`DeviceCore`] — one device, all of them, a drop's teardown —
/// asks the allocator's birth first, so a forked child is refused (or, in a drop, does nothing)
/// before any lock of the engine is reachable; no door of `alloc/` can forget the check.
#[derive(Clone, Debug)]
pub(crate) struct Cores {
    birth: Birth,
    cores: Vec<Arc<DeviceCore>>,
}

impl Cores {
    /// The devices of an allocator born in process `birth`.
    pub(crate) fn new(birth: Birth, cores: Vec<Arc<DeviceCore>>) -> Self {
        Cores { birth, cores }
    }

    /// How many devices (no lock: any process may ask).
    pub(crate) fn len(&self) -> usize {
        self.cores.len()
    }

    /// Every device; in a forked child [`Error::ForkedChild`](crate::error::Error::ForkedChild)
    /// saying that `what` belongs to the parent.
    #[inline]
    pub(crate) fn all(&self, what: &str) -> crate::error::Result<&[Arc<DeviceCore>]> {
        self.birth.check(what)?;
        Ok(&self.cores)
    }

    /// Device `device`, after the fork check (as [`Self::all`]); an error naming the devices
    /// when it does not exist.
    #[inline]
    pub(crate) fn get(&self, device: usize, what: &str) -> crate::error::Result<&Arc<DeviceCore>> {
        self.birth.check(what)?;
        self.cores.get(device).ok_or_else(|| {
            crate::error::Error::invalid(format!(
                "device {device} does not exist ({} device(s))",
                self.cores.len()
            ))
        })
    }

    /// Every device in the process they belong to; `None` in a forked child — for the calls
    /// that return no `Result` and do nothing there (a drop, `empty_cache`: the parent's memory
    /// is the parent's to release).
    #[inline]
    pub(crate) fn in_its_process(&self) -> Option<&[Arc<DeviceCore>]> {
        self.birth.is_current().then_some(&*self.cores)
    }

    /// As [`Self::in_its_process`], with a warning in a forked child that `what` was ignored.
    pub(crate) fn unless_child(&self, what: &str) -> Option<&[Arc<DeviceCore>]> {
        (!self.birth.ignored_in_child(what)).then_some(&*self.cores)
    }

    /// In a forked child, leaks the references (their drops would act for the parent); nothing
    /// in the devices' own process.
    pub(crate) fn leak_in_child(&mut self) {
        crate::process::leak_in_child(self.birth, &mut self.cores);
    }
}

impl std::fmt::Debug for DeviceCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCore")
            .field("device", &self.device)
            .field("reserved", &self.reserved.load(Ordering::Relaxed))
            .field("shards", &self.roster.live_count())
            .finish()
    }
}

/// The mutable state of one shard.
#[derive(Debug, Default)]
pub(crate) struct ShardState {
    /// The shard's serial (`Shard::serial`), for what knows only the state (`peaks.rs`).
    serial: u64,
    blocks: Slab<Block>,
    free_small: FreePool,
    free_large: FreePool,
    segments: BTreeMap<u64, SegmentInfo>,
    /// Pending-free events, per stream that used the blocks, oldest first.
    pending: HashMap<StreamId, VecDeque<(EventId, BlockId)>>,
    stats: DeviceStats,
    /// Allocations served so far (age clock of garbage collection).
    tick: u64,
    /// The pages of each expandable segment (at most one per pool), by base (`expandable.rs`).
    expandable: HashMap<u64, ExpandablePages>,
    /// A statistic went past its limit since the flag was last taken (`peaks.rs`).
    over_budget: bool,
    /// The shard is in its device's retired list (its pool dropped, or its stream destroyed):
    /// its cache is the device's to release or hand over until a new pool takes it. Checked
    /// under the lock by the paths that take the default pool's and retired shards' memory: a
    /// list of shards made before can hold a retired shard that a new pool took meanwhile.
    retired: bool,
    /// The shard serves a memory pool (not the default pool): its settles tell the pool's book
    /// (`pool_peaks.rs`). `pool` says which; this flag is what the hot path reads.
    pooled: bool,
    /// Blocks handed out and not yet released: each has a `BlockOwner` pointing at this shard.
    owners: u64,
    /// The allocator is gone while blocks were out: the last release drops the shard.
    orphaned: bool,
    /// The memory pool whose blocks this shard holds (`mem_pool.rs`; the default pool unless the
    /// shard serves one). Under the lock: a retired pool's empty shard serves the next pool.
    pool: MemPoolId,
    /// The pool's options (`MemPoolOptions::no_split`: blocks are handed out whole).
    pool_options: MemPoolOptions,
    /// The accumulated counts `stats` held when a retired shard was taken by `pool`: the earlier
    /// pools' (the device's totals keep them, the pool's statistics leave them out).
    pool_base: DeviceStats,
    /// Blocks freed with stream uses while a capture was under way, and those streams: pending
    /// until the last capture ends, when their events are recorded (`capturing.rs`).
    deferred: Vec<(BlockId, Vec<StreamId>)>,
    /// A pool shard's currents as its pool's book last added them (`pool_peaks.rs`).
    pool_told: Figures,
    /// The fit rules of the configuration in force, copied here by every publish
    /// (`config/cell.rs`): read under the lock, with nothing to keep alive.
    rules: FitRules,
}

/// A device's books of peaks: its own (`peaks.rs`), each live pool's (`pool_peaks.rs`). Each
/// behind its own lock, the device's taken first when both are.
#[derive(Debug, Default)]
pub(super) struct Books {
    device: Mutex<PeakBook>,
    pools: Mutex<HashMap<MemPoolId, PoolBook>>,
}

/// Statistics, one value per statistic with a peak.
pub(in crate::alloc) type Figures = [i64; PEAK_STATS];

/// One live memory pool's figures on one device: the sums of its shards' currents as they
/// told them, and the highest each sum reached since the last reset (`pool_peaks.rs`).
#[derive(Debug, Default)]
pub(in crate::alloc) struct PoolBook {
    sums: Figures,
    peaks: Figures,
    /// The accumulated counts of the pool's shards that left it while it lives (a destroyed
    /// stream's, once empty: `device_shards.rs`), so that its statistics keep them.
    departed: DeviceStats,
}

/// What the book knows of one shard.
#[derive(Debug)]
pub(in crate::alloc) struct PeakEntry {
    pub(in crate::alloc) shard: Weak<Shard>,
    pub(in crate::alloc) key: usize,
    /// Currents as last read.
    pub(in crate::alloc) current: Figures,
    /// Limits as last set.
    pub(in crate::alloc) limit: Figures,
    /// Told of a change since the last read (listed in `PeakBook::unread`).
    pub(in crate::alloc) unread: bool,
    /// Some limit above its current (listed in `PeakBook::holders`).
    pub(in crate::alloc) holder: bool,
}

/// The device's recorded peaks and what it knows of each shard (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct PeakBook {
    peaks: Figures,
    /// Σ of the entries' `current`.
    sums: Figures,
    /// Σ of the entries' `limit`.
    limits: Figures,
    entries: Slab<PeakEntry>,
    by_key: HashMap<usize, usize>,
    /// Entries told of a change since their last read (a slot may repeat or be stale).
    unread: Vec<usize>,
    /// Entries holding some limit above their current (a slot may repeat or be stale).
    holders: Vec<usize>,
    /// A change the book could not place: the next reconcile reads every shard.
    stale: bool,
}
