//! Why an allocation ran out of memory: the figures an out-of-memory error and its
//! [`OutOfMemoryEvent`] carry beyond the device's totals — what this stream's pool has free and
//! its largest block, what other streams cache and whether one of their blocks would have served
//! the request, what private pools and graphs hold, the address space expandable segments reserve
//! without mapping it. Computed on the failure path only (`DeviceCore::out_of_memory`), shard by
//! shard under each shard's lock, so every figure is one shard's state at one moment: a snapshot
//! taken right after the error (no other thread allocating) shows the same figures
//! (`tests/oom_explained.rs` recomputes them from one).

use super::device::Request;
use super::{DeviceCore, Shard, ShardState};
use crate::alloc::observers::OutOfMemoryEvent;
use crate::alloc::size::{self, PoolKind};

/// One shard's free figures for a request of `rounded` bytes in `pool`.
#[derive(Default)]
struct Free {
    /// Bytes free, every pool kind.
    all: u64,
    /// Bytes free in the request's pool kind.
    in_pool: u64,
    /// The largest free block of the request's pool kind.
    largest: u64,
    /// The largest free block of that kind that may serve the request (0: none).
    largest_fit: u64,
}

impl ShardState {
    fn free_figures(&self, pool: PoolKind, rounded: u64) -> Free {
        let mut out = Free::default();
        for id in self.free_blocks() {
            let b = &self.blocks[id];
            out.all += b.size;
            if b.pool != pool {
                continue;
            }
            out.in_pool += b.size;
            out.largest = out.largest.max(b.size);
            if b.size >= rounded && size::fits_oversize_rules(b.size, rounded, self.rules) {
                out.largest_fit = out.largest_fit.max(b.size);
            }
        }
        out
    }

    /// Address space the shard's expandable segments reserve without mapping (asleep pages
    /// included: their memory went back to the driver).
    fn unmapped_bytes(&self) -> u64 {
        self.expandable
            .iter()
            .map(|(base, pages)| {
                let reserved = self.segments.get(base).map_or(0, |s| s.size);
                reserved.saturating_sub(pages.chunks.len() as u64 * pages.page)
            })
            .sum()
    }
}

impl DeviceCore {
    /// Fills the explanation figures of `facts` for request `req` of `shard`.
    pub(super) fn explain(&self, shard: &Shard, req: Request, facts: &mut OutOfMemoryEvent) {
        let pool = req.pool();
        facts.rounded = req.rounded;
        facts.stream = Some(shard.stream());
        let all_shards = self.roster.all();
        let lendable = {
            let st = shard.state.lock();
            let own = st.free_figures(pool, req.rounded);
            facts.largest_free_block = own.largest;
            facts.free_in_pool = own.in_pool;
            facts.reserved_unmapped += st.unmapped_bytes();
            // `cross_stream_reuse:blocks` lends only to the default pool's misses, never during
            // a capture (`cross_stream.rs`).
            st.pool.is_default() && !self.wide.capturing.any()
        };
        for other in &all_shards {
            if std::ptr::eq(&**other, shard) {
                continue;
            }
            // Asked before the lock (a driver call): could the asking stream wait for it?
            let waitable = lendable
                && other.stream() != shard.stream()
                && self.can_wait(shard.stream(), other);
            let st = other.state.lock();
            facts.reserved_unmapped += st.unmapped_bytes();
            // Another stream's cache: the default pool's and retired shards' (a pool's own
            // stream's default pool is not another stream's).
            if !st.releasable() || other.stream() == shard.stream() {
                continue;
            }
            let free = st.free_figures(pool, req.rounded);
            facts.cached_on_other_streams += free.all;
            if waitable
                && !other
                    .sleeping
                    .load(crate::sync::os::atomic::Ordering::Relaxed)
            {
                facts.largest_fit_on_other_streams =
                    facts.largest_fit_on_other_streams.max(free.largest_fit);
            }
        }
        let pools = self.pools_reserved();
        facts.held_by_pools = pools.pools;
        facts.held_by_graphs = pools.graphs;
        facts.fragmentation = if facts.free_in_pool == 0 {
            0.0
        } else {
            1.0 - facts.largest_free_block as f64 / facts.free_in_pool as f64
        };
    }
}
