//! Names and options of memory pools (PyTorch's `MempoolId_t` and `MemPool` arguments): the
//! part of `mem_pool.rs` that the shard state and snapshots need, below them.

use std::fmt;

use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::Arc;

/// The id of a memory pool: PyTorch's `MempoolId_t`, a pair. Pools a program makes
/// ([`Runtime::mem_pool`](crate::Runtime::mem_pool), PyTorch's `MemPool()` and
/// `graph_pool_handle()`) are `(0, n)`; pools a graph capture makes for itself are `(n, 0)`;
/// `(0, 0)` is the allocator's default pool. Ids are unique in the process and never reused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct MemPoolId {
    first: u64,
    second: u64,
}

/// Numbers of pools a program made.
static NEXT_USER_POOL: AtomicU64 = AtomicU64::new(1);
/// Numbers of pools graph captures made for themselves.
static NEXT_GRAPH_POOL: AtomicU64 = AtomicU64::new(1);

impl MemPoolId {
    /// The default pool: every allocation outside a pool.
    pub const DEFAULT: MemPoolId = MemPoolId {
        first: 0,
        second: 0,
    };

    /// A fresh id of a pool a program makes: `(0, n)`.
    pub(crate) fn next_user() -> MemPoolId {
        MemPoolId {
            first: 0,
            second: NEXT_USER_POOL.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A fresh id of a pool a graph capture makes for itself: `(n, 0)`.
    pub(crate) fn next_graph() -> MemPoolId {
        MemPoolId {
            first: NEXT_GRAPH_POOL.fetch_add(1, Ordering::Relaxed),
            second: 0,
        }
    }

    /// The pair, as PyTorch writes it (`segment_pool_id` in a snapshot).
    pub fn as_pair(self) -> (u64, u64) {
        (self.first, self.second)
    }

    /// Whether this is the default pool.
    pub fn is_default(self) -> bool {
        self == MemPoolId::DEFAULT
    }

    /// Whether a program made the pool (`(0, n)`), not a graph capture for itself.
    pub fn is_user_created(self) -> bool {
        self.first == 0 && self.second != 0
    }
}

impl fmt::Display for MemPoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.first, self.second)
    }
}

/// How a pool serves allocations (PyTorch's `MemPool(use_on_oom=…, no_split=…)`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemPoolOptions {
    /// When an allocation outside any pool finds no memory (after the whole out-of-memory
    /// sequence), it may take a free block of this pool on its stream — the block stays the
    /// pool's and returns to it when freed.
    pub use_on_oom: bool,
    /// Blocks of this pool are never split: every allocation gets a block of its own, whole (what
    /// memory registered with a communication library needs).
    pub no_split: bool,
    /// The pool's memory lives on expandable segments of its own (pages mapped into a reserved
    /// address range), whatever `expandable_segments` says: what sleep and wake by tag need
    /// (`alloc/engine/sleep.rs`; a tag's pool always has it).
    pub expandable_segments: bool,
}

impl MemPoolOptions {
    /// A pool that lends free blocks to allocations that would otherwise fail for lack of memory.
    pub fn with_use_on_oom(mut self, on: bool) -> Self {
        self.use_on_oom = on;
        self
    }

    /// A pool whose blocks are never split.
    pub fn with_no_split(mut self, on: bool) -> Self {
        self.no_split = on;
        self
    }

    /// A pool whose memory lives on expandable segments of its own.
    pub fn with_expandable_segments(mut self, on: bool) -> Self {
        self.expandable_segments = on;
        self
    }
}

/// Where a tag stands in its sleep (`tags.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Awake,
    FallingAsleep,
    Asleep,
    Waking,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Awake => "awake",
            Phase::FallingAsleep => "falling asleep",
            Phase::Asleep => "asleep",
            Phase::Waking => "waking",
        })
    }
}

/// What the engine reads of the tags (`tags.rs` keeps their one record each: name, pool, phase):
/// a shard made for a tag that is not awake starts asleep, and the refusal of an allocation names
/// the tag. Shared by an allocator's devices.
pub(crate) trait TagPhases: Send + Sync + fmt::Debug {
    /// Whether `pool` is a tag that is not awake (asleep, or on its way to or from sleep).
    fn is_sleeping(&self, pool: MemPoolId) -> bool;
    /// The name of the tag whose pool is `pool`.
    fn name_of(&self, pool: MemPoolId) -> Option<Arc<str>>;
}
