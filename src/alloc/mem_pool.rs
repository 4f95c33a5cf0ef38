//! Private memory pools: PyTorch's `MemPool` and `use_mem_pool`.
//!
//! A [`MemPool`] is a set of shards of its own — one per (device, stream) it is used on — beside
//! the default pool's: its segments, free blocks and statistics are its own, and memory of a pool
//! never serves an allocation outside it (nor the default pool's an allocation inside it). A
//! thread allocates from a pool while it holds a [`PoolScope`]
//! ([`Runtime::use_mem_pool`](crate::Runtime::use_mem_pool)): every allocation of that thread on that device, on any
//! stream, goes to the pool; scopes nest (the innermost wins) and are the thread's alone.
//!
//! | pool state | its shards | cached memory released by |
//! |---|---|---|
//! | live (a `MemPool`, a clone, or a scope holds it) | in the device's map under `(stream, id)` | [`MemPool::empty_cache`] only — not `empty_cache`, out-of-memory or garbage collection — and not even that while captures or graphs hold the pool (their replays use its free blocks: `capturing.rs`) |
//! | dropped (the last holder gone) | their cached memory given back at once, then moved to the device's retired list in one step under the map's lock (never in neither list, where the allocator's teardown would miss them) | every release of the default pool: blocks still handed out return to their shard and are released like the default pool's |
//! | retired and empty (no block but pages never mapped) | kept for the allocator's life (a thread's shard cache may point at one) | taken again by the next pool used on the same stream — its empty expandable reservations given back, its accumulated counts left behind (`ShardState::pool_base`) — so dropping pools never grows the allocator |
//!
//! What a pool changes in the allocation path: nothing on a thread's cache hit — the thread's
//! cached shards are forgotten when a scope begins or ends, so a cached shard is always the
//! current pool's. A miss asks the thread's innermost scope for the pool. Pools' shards take no
//! thread front caches (`thread_cache_mb`): their blocks go back to the pool's shard directly.
//!
//! Options ([`MemPoolOptions`]): `no_split` hands every block out whole; `use_on_oom` lets an
//! allocation of the default pool that found no memory — after the whole out-of-memory sequence
//! — take a free block of the pool on its stream (the block stays the pool's), unless captures or
//! graphs hold the pool.
//!
//! A pool's statistics ([`MemPool::memory_stats`]) are the sums of its shards' — currents and
//! accumulated counts, exact — and its own peaks, the highest those sums reached, resettable
//! ([`MemPool::reset_peak_stats`]; the pool's book: `engine/pool_peaks.rs`). What all pools and
//! graphs reserve is one cheap call (`Runtime::pools_reserved`).
//!
//! A pool reaches its devices only through the fork check (`engine::Cores`): in a process forked
//! from the pool's, its statistics, peaks and snapshot are
//! [`ErrorKind::ForkedChild`](crate::ErrorKind::ForkedChild) errors and `empty_cache` and a drop
//! do nothing — before any lock, which a thread of the parent may have held at the fork.

use super::engine::snapshot::Snapshot;
use super::engine::thread;
use super::engine::Cores;
use super::pool_id::{MemPoolId, MemPoolOptions};
use super::stats::DeviceStats;
use super::{CachingAllocator, DeviceCore};
use crate::error::{Error, Result};
use crate::sync::os::Arc;

/// A private memory pool of one allocator (PyTorch's `torch.cuda.MemPool`; how pools work is in
/// `src/alloc/mem_pool.rs`). Clones share the pool; the pool is dropped with its last holder (clones,
/// [`PoolScope`]s), and gives its memory back as its blocks are freed.
#[derive(Clone, Debug)]
pub struct MemPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    id: MemPoolId,
    options: MemPoolOptions,
    /// The allocator the pool belongs to.
    allocator: u64,
    /// Its devices, reached through the fork check only (`engine::Cores`): in a forked child
    /// every door of the pool is refused, or does nothing, before any lock.
    devices: Cores,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // In a forked child nothing: the shards are the parent's.
        for device in self.devices.in_its_process().unwrap_or_default() {
            device.retire_pool(self.id);
        }
    }
}

impl MemPool {
    /// The pool's id: `(0, n)` (a graph capture's own pool: `(n, 0)`), unique in the process.
    pub fn id(&self) -> MemPoolId {
        self.inner.id
    }

    /// The options the pool was made with.
    pub fn options(&self) -> MemPoolOptions {
        self.inner.options
    }

    /// How many hold the pool: this handle and its clones, and every live [`PoolScope`]
    /// (PyTorch's `MemPool.use_count()`).
    pub fn use_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// The segments of this pool on every device, by device then address (PyTorch's
    /// `MemPool.snapshot()`); the trace is left empty (the allocator's snapshot has it). In a
    /// process forked from the pool's, an [`ErrorKind::ForkedChild`](crate::ErrorKind::ForkedChild)
    /// error: the segments are the parent's.
    pub fn snapshot(&self) -> Result<Snapshot> {
        let devices = self.cores()?;
        let mut segments = Vec::new();
        for device in devices {
            for shard in device.pool_shards(self.inner.id) {
                shard.segments_into(&mut segments);
            }
        }
        segments.sort_by_key(|s| (s.device, s.address));
        Ok(Snapshot {
            segments,
            trace: Vec::new(),
            device_count: devices.len(),
        })
    }

    /// The pool's statistics on `device`: the sums of its shards' currents and accumulated
    /// counts, and the pool's own peaks — the highest the sums over its streams reached since
    /// the pool was made or [`MemPool::reset_peak_stats`] (`engine/pool_peaks.rs`). In a
    /// forked child, an [`ErrorKind::ForkedChild`](crate::ErrorKind::ForkedChild) error.
    pub fn memory_stats(&self, device: usize) -> Result<DeviceStats> {
        Ok(self.core(device)?.pool_memory_stats(self.inner.id))
    }

    /// Resets the pool's peaks on `device` to its currents (PyTorch's
    /// `reset_peak_memory_stats`, for one pool); the device's peaks are untouched.
    pub fn reset_peak_stats(&self, device: usize) -> Result<()> {
        self.core(device)?.reset_pool_peaks(self.inner.id);
        Ok(())
    }

    /// Device `device` of the pool: [`Error::ForkedChild`] in a forked child, before any lock
    /// (every door that reaches a device comes through here or [`Self::cores`]).
    fn core(&self, device: usize) -> Result<&Arc<DeviceCore>> {
        self.inner.devices.get(device, "this memory pool")
    }

    /// Every device of the pool: [`Error::ForkedChild`] in a forked child, before any lock.
    fn cores(&self) -> Result<&[Arc<DeviceCore>]> {
        self.inner.devices.all("this memory pool")
    }

    /// Waits for the pool's pending frees and gives its cached whole segments back to the
    /// driver (the allocator's `empty_cache` leaves a live pool's cache alone). Nothing while a
    /// capture or a graph holds the pool: its free blocks are the graph's, which replays write
    /// (`capturing.rs`). Nothing in a forked child (the cached segments are the parent's).
    pub fn empty_cache(&self) {
        let Some(devices) = self
            .inner
            .devices
            .unless_child("emptying a memory pool's cache")
        else {
            return;
        };
        for device in devices {
            if device.held_by_graphs(self.inner.id) {
                return;
            }
        }
        for device in devices {
            for shard in device.pool_shards(self.inner.id) {
                device.release_shard(&shard, true, false);
            }
        }
    }
}

/// While it lives, this thread allocates from a [`MemPool`] on one device, on every stream
/// (see [`Runtime::use_mem_pool`](crate::Runtime::use_mem_pool)). It holds the pool; it cannot move to another thread.
#[derive(Debug)]
#[must_use = "the pool is used only while the scope lives: bind it (`let _in_pool = ...`)"]
pub struct PoolScope {
    pool: MemPool,
    device: usize,
    token: u64,
    /// `!Send`: the scope is its thread's.
    _this_thread: std::marker::PhantomData<*const ()>,
}

impl PoolScope {
    /// The pool allocations go to.
    pub fn pool(&self) -> &MemPool {
        &self.pool
    }
}

impl Drop for PoolScope {
    fn drop(&mut self) {
        thread::leave_pool(self.pool.inner.allocator, self.device, self.token);
    }
}

impl CachingAllocator {
    /// The body of [`Runtime::mem_pool`](crate::Runtime::mem_pool), documented there.
    pub(crate) fn mem_pool(&self, options: MemPoolOptions) -> Result<MemPool> {
        self.birth.check("this allocator")?;
        Ok(self.new_pool(MemPoolId::next_user(), options))
    }

    /// A pool a graph capture makes for itself (`(n, 0)`).
    pub(super) fn graph_pool(&self, options: MemPoolOptions) -> MemPool {
        self.new_pool(MemPoolId::next_graph(), options)
    }

    /// Whether `pool` is one of this allocator's.
    pub(super) fn owns_pool(&self, pool: &MemPool) -> bool {
        pool.inner.allocator == self.id
    }

    fn new_pool(&self, id: MemPoolId, options: MemPoolOptions) -> MemPool {
        MemPool {
            inner: Arc::new(PoolInner {
                id,
                options,
                allocator: self.id,
                devices: self.devices.clone(),
            }),
        }
    }

    /// The body of [`Runtime::use_mem_pool`](crate::Runtime::use_mem_pool), documented there.
    pub(crate) fn use_mem_pool(&self, pool: &MemPool, device: usize) -> Result<PoolScope> {
        self.device(device)?;
        if pool.inner.allocator != self.id {
            return Err(Error::invalid(format!(
                "memory pool {} belongs to another allocator",
                pool.id()
            )));
        }
        let token = thread::enter_pool(self.id, device, pool.id(), pool.options());
        Ok(PoolScope {
            pool: pool.clone(),
            device,
            token,
            _this_thread: std::marker::PhantomData,
        })
    }

    /// The body of [`Runtime::current_mem_pool`](crate::Runtime::current_mem_pool), documented there.
    pub(crate) fn current_mem_pool(&self, device: usize) -> Option<MemPoolId> {
        thread::current_pool(self.id, device).map(|(id, _)| id)
    }
}
