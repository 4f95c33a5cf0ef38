//! Which shards a device has: one per (stream, memory pool) in its map, created on first use;
//! the retired shards of dropped pools, reused by the next pool on their stream; the sets the
//! device-wide paths visit (all of them, or only those whose cache may be released); the lending of
//! a `use_on_oom` pool's free block (`mem_pool.rs` has the pools' state table).

use super::device::Request;
use super::roster::{self, Bookkeeping, RosterWrite};
use super::ShardState;
use super::{DeviceCore, Shard};
use crate::alloc::block::Allocated;
use crate::alloc::pool_id::{MemPoolId, MemPoolOptions};
use crate::driver::StreamId;
use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex, ShortMutex};

impl DeviceCore {
    /// The shard of `stream` in memory pool `pool`, created on first use — for a pool, from a
    /// retired pool's empty shard of the same stream when there is one (`mem_pool.rs`).
    pub(crate) fn shard_in(
        self: &Arc<Self>,
        stream: StreamId,
        pool: MemPoolId,
        options: MemPoolOptions,
    ) -> Result<Arc<Shard>> {
        if let Some(shard) = self.roster.get(stream, pool) {
            return Ok(shard);
        }
        let device = self.driver.stream_device(stream)?;
        if device != self.device {
            return Err(Error::invalid(format!(
                "stream {} belongs to device {device}, not device {}",
                stream.raw(),
                self.device
            )));
        }
        let mut shards = self.roster.write();
        if let Some(shard) = shards.get(stream, pool) {
            return Ok(shard);
        }
        // Not while a capture runs: taking a retired shard frees its empty reservations, a call
        // a global capture forbids (it invalidated the capture; found by tests/graph_mix.rs).
        if !pool.is_default() && !self.wide.capturing.any() {
            if let Some((shard, bases)) = Self::take_retired(&shards, stream, pool, options) {
                shard
                    .sleeping
                    .store(self.wide.tags.is_sleeping(pool), Ordering::SeqCst);
                self.books.open_pool(pool);
                shards.insert(stream, pool, Arc::clone(&shard));
                drop(shards);
                self.free_reservations(bases);
                return Ok(shard);
            }
        }
        let serial = roster::next_serial();
        // Read under the map's write lock, which a publish holds too (`publish_config`).
        let config = self.config();
        let rules = config.fit_rules();
        // A pool's blocks go back to the pool's shard directly: no thread front caches.
        let front_limit = if pool.is_default() {
            config.thread_cache
        } else {
            0
        };
        // Read under the map's write lock: a tag put to sleep marks itself before it lists its
        // shards (under the read lock), so a shard made meanwhile is listed or asleep.
        let sleeping = self.wide.tags.is_sleeping(pool);
        let state = ShardState {
            serial,
            pool,
            pooled: !pool.is_default(),
            pool_options: options,
            rules,
            ..ShardState::default()
        };
        let recycled = shards.pop_buried();
        let (shard, recycled_from) = match recycled {
            Some(shard) => {
                let old = shard.serial();
                shard.recycle(stream, front_limit, sleeping, state);
                (shard, Some(old))
            }
            None => (
                Arc::new(Shard {
                    stream: AtomicU64::new(stream.raw()),
                    serial: AtomicU64::new(serial),
                    front_limit: AtomicU64::new(front_limit),
                    birth: self.birth,
                    sanitizer: self.sanitizer.clone(),
                    state: ShortMutex::new(state),
                    core: Arc::clone(self),
                    fronts: Mutex::new(Default::default()),
                    sleeping: AtomicBool::new(sleeping),
                    finished: AtomicBool::new(false),
                }),
                None,
            ),
        };
        // The pool's book opens before the shard is in the map, where another thread could find
        // it and settle a change the book would then miss (`pool_peaks.rs`).
        if !pool.is_default() {
            self.books.open_pool(pool);
        }
        shards.insert(stream, pool, Arc::clone(&shard));
        drop(shards);
        // In the peak book from its creation (the book's lock is taken after the map's); a
        // recycled shard is in it already, under its former serial.
        match recycled_from {
            Some(old) => self.rekey_for_peaks(old, &shard),
            None => self.register_for_peaks(&shard),
        }
        Ok(shard)
    }

    /// A free block of a live `use_on_oom` pool on `shard`'s stream, for an allocation of the
    /// default pool that found no memory (PyTorch's `use_on_oom`), with the pool's shard.
    pub(super) fn lend(&self, shard: &Shard, req: Request) -> Option<(Arc<Shard>, Allocated)> {
        if !shard.state.lock().pool.is_default() {
            return None;
        }
        self.roster
            .pools_on(shard.stream())
            .into_iter()
            .find_map(|lending| {
                let (options, pool_id) = {
                    let st = lending.state.lock();
                    (st.pool_options, st.pool)
                };
                // A pool graphs hold lends nothing: its free blocks are the graphs' (`capturing.rs`).
                if !options.use_on_oom || self.wide.capturing.held_by_graphs(pool_id) {
                    return None;
                }
                let hit = self.try_fit(&lending, req)?;
                Some((lending, hit))
            })
    }

    /// A retired shard of `stream` that holds nothing (but expandable segments with no page
    /// mapped, whose reservations are returned: the bases, to free outside the locks), made a
    /// shard of `pool`, its accumulated counts from now on the new pool's.
    fn take_retired(
        shards: &RosterWrite<'_>,
        stream: StreamId,
        pool: MemPoolId,
        options: MemPoolOptions,
    ) -> Option<(Arc<Shard>, Vec<u64>)> {
        shards.take_retired(
            |shard| {
                shard.stream() == stream && {
                    let st = shard.state.lock();
                    st.owners == 0
                        && st
                            .blocks
                            .iter()
                            .all(|(_, b)| b.state == crate::alloc::block::BlockState::Unmapped)
                        && st.pending.values().all(|q| q.is_empty())
                }
            },
            |st| {
                let bases = st.take_empty_expandable();
                st.pool = pool;
                st.pooled = !pool.is_default();
                st.pool_options = options;
                st.pool_base = st.stats.clone();
                // Its currents are the new pool's from now on: told whole at its next settle.
                st.pool_told = Default::default();
                bases
            },
        )
    }

    /// Marks `stream`'s shards finished (`true`: synchronized, about to be destroyed — their idle
    /// memory goes to other streams without a wait) or not (`false`: its destruction failed).
    pub(in crate::alloc) fn mark_finished(&self, stream: StreamId, finished: bool) {
        self.roster.mark_finishing(stream, finished);
    }

    /// `stream` was destroyed (its shards marked finished before): the default pool's shard
    /// leaves the map for the retired list (it lives on for the blocks still out and the thread
    /// caches that point at it, and its cache is released with every release of the default
    /// pool). With `cross_stream_reuse:off` its whole idle segments go back to the driver now:
    /// no stream could reuse them. Finished shards that hold nothing are buried.
    pub(in crate::alloc) fn stream_finished(&self, stream: StreamId) {
        // The driver knows it no more: gone without the list; its default pool's shard retired.
        if let Some(shard) = self.roster.stream_destroyed(stream) {
            // Its thread front caches hold blocks no thread will take again: back to the shard,
            // so its segments can go idle (and be taken over or released).
            shard.flush_fronts();
            // Under `off` no stream could take its idle memory; an expandable segment no stream
            // takes over under any policy (`cross_stream.rs` moves whole plain segments): given
            // back now (found by CI with expandable segments: each destroyed stream's pages
            // stayed cached, its shard retired).
            let expandable = !shard.state.lock().expandable.is_empty();
            if expandable
                || self.config().cross_stream_reuse == crate::config::CrossStreamReuse::Off
            {
                self.release_shard(&shard, false, true);
            }
        }
        self.bury_empty();
    }

    /// Gives a dropped pool's retired shard's idle cache back, and moves the retired shards
    /// that hold nothing (no block out, no segment, nothing pending) — a destroyed stream's, a
    /// dropped pool's — to the buried list, where the next new shard takes one
    /// ([`Shard::recycle`]): a program that makes and destroys a stream, a pool or a graph per
    /// step neither grows what every miss and release walks nor the memory the allocator keeps
    /// — the buried list is never longer than the most shards alive at once.
    pub(in crate::alloc) fn bury_empty(&self) {
        // A dropped pool's retired shard with no block out keeps only cache: given back first (a
        // graph's private pool is retired while the graph's captured storages still hold its
        // blocks, which they free into it afterwards — found by the soak: one shard and its
        // segment kept per captured graph). A destroyed stream's default-pool cache stays for
        // other streams to take over (`cross_stream_reuse`; under `off` it went at once). Not
        // while a capture runs (a free would invalidate it).
        if !self.wide.capturing.any() {
            let idle: Vec<Arc<Shard>> = self
                .roster
                .retired()
                .into_iter()
                .filter(|shard| {
                    let st = shard.state.lock();
                    !st.pool.is_default()
                        && st.owners == 0
                        && !st.has_pending()
                        && !st.segments.is_empty()
                })
                .collect();
            for shard in idle {
                self.release_shard(&shard, false, true);
            }
        }
        // A live pool's shard of a destroyed stream, once it holds nothing, leaves the pool (the
        // pool's book keeps its accumulated counts): a pool that lives across many streams keeps
        // a shard per live stream, not one per stream it has seen (found by review).
        self.roster.retire_where(|(_, pool), shard, st| {
            let leaves = !pool.is_default()
                && shard.finished.load(Ordering::SeqCst)
                && st.owners == 0
                && !st.has_pending()
                && st.segments.is_empty();
            if leaves {
                self.books.depart(st);
            }
            leaves
        });
        let mut reservations = Vec::new();
        let mut rekeyed = Vec::new();
        self.roster.bury(|shard| {
            // Every empty retired shard, a dropped pool's on a live stream too (one per captured
            // graph). Burying those once left 4 KiB of device memory behind on the CUDA double:
            // buried shards were left out of the teardown, so each kept its device, and the
            // device its driver, alive (`Roster::drain`).
            let mut st = shard.state.lock();
            if st.owners != 0 || st.has_pending() {
                return false;
            }
            // Expandable segments with nothing mapped hold only address space: given back
            // (found by review: under `expandable_segments` no destroyed stream's shard was
            // ever buried, and each kept a reservation of twice the device's memory) — not
            // while a capture runs, which the driver call would invalidate.
            if !self.wide.capturing.any() {
                reservations.extend(st.take_empty_expandable());
            }
            if !st.segments.is_empty() {
                return false;
            }
            // Out of reach from here: a thread's slot still naming it misses (a new serial),
            // and an allocation that reached it already is refused under this lock (found by
            // review: a slot of the destroyed stream put a block into a buried shard, which
            // its recycling then lost).
            let old = shard.serial();
            let serial = roster::next_serial();
            st.serial = serial;
            shard.serial.store(serial, Ordering::Release);
            shard.sleeping.store(true, Ordering::SeqCst);
            rekeyed.push((old, Arc::clone(shard)));
            true
        });
        for (old, shard) in rekeyed {
            self.rekey_for_peaks(old, &shard);
        }
        self.free_reservations(reservations);
    }

    /// Gives back the reservations of expandable segments with nothing mapped (taken out of a
    /// shard's state with `take_empty_expandable`, freed outside the locks).
    fn free_reservations(&self, bases: Vec<u64>) {
        for base in bases {
            if let Err(err) = self
                .driver
                .vm()
                .vm_free_reservation(crate::driver::DeviceAddr(base))
            {
                tracing::error!(%err, base, "freeing an expandable segment's reservation failed");
            }
        }
    }

    /// What the device keeps for its shards (see [`Bookkeeping`]).
    pub(in crate::alloc) fn bookkeeping(&self) -> Bookkeeping {
        self.roster.bookkeeping()
    }

    /// The shards of live pool `pool`.
    pub(in crate::alloc) fn pool_shards(&self, pool: MemPoolId) -> Vec<Arc<Shard>> {
        self.roster.of_pool(pool)
    }

    /// Pool `pool` was dropped: its shards leave the map for the retired list, giving their
    /// cached memory back (blocks still handed out return to them and are released like the
    /// default pool's).
    pub(in crate::alloc) fn retire_pool(&self, pool: MemPoolId) {
        // Released while still in the map (nothing allocates from a dropped pool), then moved
        // to the retired list in one step under the map's lock: a shard is never in neither,
        // where the allocator's teardown (and stats, snapshots) would miss it.
        for shard in self.pool_shards(pool) {
            self.release_shard(&shard, false, false);
        }
        self.roster.retire_pool(pool);
        self.books.close_pool(pool);
        // Those of destroyed streams that hold nothing go at once.
        self.bury_empty();
    }
}
