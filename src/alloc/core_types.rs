//! The three types of the allocator's interior that point at each other, and nothing else: a
//! [`Shard`] (one stream's lock and state) holds its [`DeviceCore`]; the core holds its shards
//! and the [`PeakBook`] that knows each shard by a weak reference. Their fields' types live below
//! this file (`state.rs`, `front.rs`, `block.rs`, …) and their methods above it, by concern:
//!
//! | file | what it does with these types |
//! |---|---|
//! | `shard.rs` | one shard: the free path, orphaning, front-cache helpers, its teardown |
//! | `device_shards.rs` | one device's shards: creation per (stream, pool), retired shards, lending |
//! | `device.rs` | one device: the hit and miss paths, release, stats, snapshots |
//! | `expandable.rs` | expandable segments: growth and the release of whole pages |
//! | `sleep.rs` | sleep and wake of a tag's shards: their pages unmapped and mapped back |
//! | `peaks.rs` | exact device-wide peaks: the book's reads, grants and reconciles |
//!
//! So no file of `alloc/` names a file above it, and these definitions are all that the others
//! share.

use std::collections::HashMap;

use slab::Slab;

use super::capturing::CaptureRoutes;
use super::front::FrontRegistry;
use super::history::Trace;
use super::oom::Callbacks;
use super::pool_id::{MemPoolId, TagBook};
use super::state::ShardState;
use super::stats::PEAK_STATS;
use crate::config::AllocatorConfig;
use crate::driver::{Driver, EventId, StreamId};
use crate::process::Birth;
use crate::sync::os::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex, RwLock, Weak};

/// One (device, stream) shard. Aligned to 128 bytes (two cache lines: the adjacent-line
/// prefetcher pairs them) so that two shards' locks and hot state never share a line, wherever the
/// heap puts them.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Shard {
    pub stream: StreamId,
    /// Unique in the process, never reused: tells this shard from a later one at the same address
    /// (thread-local caches compare it; `thread.rs`).
    pub serial: u64,
    /// `thread_cache_mb` in bytes (0: no front caches), next to the lock the free path takes.
    pub front_limit: u64,
    /// The process the allocator belongs to, next to the hot fields: a forked child's frees
    /// release nothing (`process`).
    pub birth: Birth,
    /// The stream sanitizer (when on), next to the hot fields: told of hand-outs and frees.
    pub sanitizer: Option<Arc<crate::driver::Sanitizer>>,
    pub state: Mutex<ShardState>,
    pub core: Arc<DeviceCore>,
    /// Every thread's front cache of this shard (`front.rs`; empty unless `thread_cache_mb`).
    pub fronts: Mutex<FrontRegistry>,
    /// The shard's pool is a tag that sleeps (`sleep.rs`): allocations are refused. Set before
    /// the shard's lock is taken to collect what to offload, read on every allocation of the
    /// shard (once before, once under the lock), cleared when the tag is awake again.
    pub sleeping: AtomicBool,
}

/// Everything an allocator keeps per device.
pub(crate) struct DeviceCore {
    pub device: usize,
    /// The process the allocator belongs to (see `process`).
    pub birth: Birth,
    pub driver: Arc<dyn Driver>,
    pub config: Arc<AllocatorConfig>,
    pub callbacks: Arc<Callbacks>,
    pub trace: Arc<Trace>,
    /// The allocator's captures under way (`capturing.rs`).
    pub capturing: Arc<CaptureRoutes>,
    /// The allocator's tags and which sleep (`sleep.rs`).
    pub tags: Arc<TagBook>,
    pub check_invariants: bool,
    /// The stream sanitizer, when the driver is sanitized: told of every hand-out and free.
    pub sanitizer: Option<Arc<crate::driver::Sanitizer>>,
    /// The driver for the events of pending frees: the unsanitized one under a sanitizer (the
    /// allocator's polls and waits on them are its own, not the program's synchronization; the
    /// sanitizer covers that reuse with the free's clock).
    pub free_events: Arc<dyn Driver>,
    pub capacity: u64,
    /// `f64` bits of the per-process memory fraction; `fraction_set` says whether one was chosen.
    pub(super) fraction_bits: AtomicU64,
    pub(super) fraction_set: AtomicBool,
    /// Bytes of live segments on this device (all shards).
    pub(super) reserved: AtomicU64,
    /// The shards by (stream, memory pool): one per stream for the default pool, one per stream
    /// a pool is used on (`mem_pool.rs`).
    pub(super) shards: RwLock<HashMap<(StreamId, MemPoolId), Arc<Shard>>>,
    /// Shards of dropped pools: kept for the allocator's life (thread caches may still point at
    /// them), released like the default pool's, and taken again by the next pool on their stream
    /// once empty.
    pub(super) retired: Mutex<Vec<Arc<Shard>>>,
    pub(super) events: Mutex<Vec<EventId>>,
    pub(super) alloc_retries: AtomicU64,
    pub(super) ooms: AtomicU64,
    pub(super) sync_all: AtomicU64,
    /// The recorded device-wide peaks (`peaks.rs`).
    pub(super) peaks: Mutex<PeakBook>,
    /// Cached segments taken for release while a capture began: `(stream, base, size)`, freed
    /// by the next release after the captures (`DeviceCore::free_segments`), or at the end.
    pub(super) unfreed: Mutex<Vec<(StreamId, u64, u64)>>,
    /// Segments a registrar refused while a capture ran: `(base, size)`, never seen by observers
    /// or the trace, freed quietly by the next release or at the end (`return_unregistered`).
    pub(super) refused: Mutex<Vec<(u64, u64)>>,
}

impl std::fmt::Debug for DeviceCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCore")
            .field("device", &self.device)
            .field("reserved", &self.reserved.load(Ordering::Relaxed))
            .field("shards", &self.shards.read().len())
            .finish()
    }
}

/// Statistics, one value per statistic with a peak.
pub(super) type Figures = [i64; PEAK_STATS];

/// What the book knows of one shard.
#[derive(Debug)]
pub(super) struct PeakEntry {
    pub(super) shard: Weak<Shard>,
    pub(super) key: usize,
    /// Currents as last read.
    pub(super) current: Figures,
    /// Limits as last set.
    pub(super) limit: Figures,
    /// Told of a change since the last read (listed in `PeakBook::unread`).
    pub(super) unread: bool,
    /// Some limit above its current (listed in `PeakBook::holders`).
    pub(super) holder: bool,
}

/// The device's recorded peaks and what it knows of each shard (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct PeakBook {
    pub(super) peaks: Figures,
    /// Σ of the entries' `current`.
    pub(super) sums: Figures,
    /// Σ of the entries' `limit`.
    pub(super) limits: Figures,
    pub(super) entries: Slab<PeakEntry>,
    pub(super) by_key: HashMap<usize, usize>,
    /// Entries told of a change since their last read (a slot may repeat or be stale).
    pub(super) unread: Vec<usize>,
    /// Entries holding some limit above their current (a slot may repeat or be stale).
    pub(super) holders: Vec<usize>,
    /// A change the book could not place: the next reconcile reads every shard.
    pub(super) stale: bool,
}
