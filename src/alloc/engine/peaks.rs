//! Exact device-wide peaks without a device-wide lock on the hot path, and without reading every
//! shard when one grows.
//!
//! Statistics live in each shard (one per stream) so threads on different streams share no cache
//! line. Currents add up exactly; a device's *peak* is the maximum of the sum over time, which no
//! shard sees alone. PyTorch gets it from its device-wide lock. Here every shard gets a **budget**
//! per statistic: it may grow up to its limit without telling anyone, and the limits never add up
//! to more than the device's recorded peak — so while every shard is within its limit the device's
//! total cannot pass the recorded peak. A shard that goes past a limit (`Stat::increase` reports
//! it; found under the shard's lock, acted on after releasing it) **reconciles** under the device's
//! lock on its [`PeakBook`].
//!
//! The book keeps, per shard, the figures it last read (currents and limits) and their sums, so a
//! reconcile reads only the shards whose figures may have changed since — not every shard:
//!
//! | step | what | cost |
//! |---|---|---|
//! | register | a shard's creation (`DeviceCore::shard`) enters it in the book (figures 0, as a new shard's are) | once per shard |
//! | tell | the first settle of a shard after the book read it marks it *unread* (the book's lock, once per shard between two reads) | none while unread |
//! | read (revoke) | under the shard's lock: its currents and high-water mark since the last read; limit := current; sums updated by the difference | per unread shard |
//! | check | `reserved_bytes.all` summed must equal the device's reserved counter; a mismatch (a change that told no one, or another thread mid-way) reads every shard | O(1) |
//! | raise | peak := max(peak, sums) — the sums are the device's total: unread shards were just read, the others have not changed | O(statistics) |
//! | restore | where the limits add up to more than the peak, the shards holding limits above their currents are read (revoked) too | per such shard, each paid for by an earlier grant |
//! | grant | each read shard: limit := current + what its high-water mark says it needs, from the slack; shards that told the book also share the rest evenly | per read shard |
//!
//! Paths that change a shard without settling (cache releases) tell the book per shard
//! (`release_pages`, which every release loop calls for each shard) or show up in the reserved
//! check (oversize releases free segments); a settle the book cannot place (an unregistered shard)
//! makes the next reconcile read every shard, as does reading the statistics
//! ([`DeviceCore::exact_stats`]: every counter of every shard is summed there anyway).
//!
//! After a shard's limit is revoked it can only shrink without reconciling, so the total of the
//! pass is the device's total at the pass's end with the shrinking linearized after it — an
//! attained value, as PyTorch's serialized peak is. An allocation that went past its limit returns
//! only after its reconcile. A steady loop (allocate, free, repeat) settles after a pass or two:
//! each shard's limit is its own high-water mark, every shard stays unread, and the hot path never
//! takes the book's lock again. A run that keeps reaching new peaks on many streams (a replay of
//! 10,000 streams) pays per reconcile for the shards that changed since the last one, not for all.

use std::cell::Cell;

use super::ShardState;
use super::{DeviceCore, Figures, PeakBook, PeakEntry, Shard};
use crate::alloc::stats::{DeviceStats, PEAK_STATS, RESERVED_BYTES_ALL};
use crate::alloc::CachingAllocator;
use crate::sync::os::atomic::Ordering;
use crate::sync::os::Arc;

thread_local! {
    /// The shard whose settle calls [`DeviceCore::reconcile_peaks`] next on this thread: its
    /// serial and whether it went past its budget ([`ShardState::take_over_budget`]).
    static SETTLING: Cell<Option<(usize, bool)>> = const { Cell::new(None) };
}

/// The book's key for a shard: its serial, which its state carries too (what its settle knows).
fn key_of(shard: &Shard) -> usize {
    shard.serial() as usize
}

/// A shard read in this reconcile: what its high-water mark asks for, and whether it shares
/// the rest of the slack.
struct Read {
    slot: usize,
    shard: Arc<Shard>,
    need: Figures,
    shares: bool,
}

impl PeakBook {
    fn register(&mut self, shard: &Arc<Shard>) {
        let key = key_of(shard);
        // Serials are never reused: a known key is this shard.
        if self.by_key.contains_key(&key) {
            return;
        }
        let slot = self.entries.insert(PeakEntry {
            shard: Arc::downgrade(shard),
            key,
            current: [0; PEAK_STATS],
            limit: [0; PEAK_STATS],
            unread: true,
            holder: false,
        });
        self.by_key.insert(key, slot);
        // Read at the next reconcile: a shard normally starts at 0, but one used before its
        // registration may not have.
        self.unread.push(slot);
    }

    /// The shard known as `old` was recycled under the serial `new` (`Shard::recycle`): the
    /// same entry, under its new key.
    fn rekey(&mut self, old: usize, new: usize) {
        if let Some(slot) = self.by_key.remove(&old) {
            self.entries[slot].key = new;
            self.by_key.insert(new, slot);
        }
    }

    fn tell(&mut self, key: usize) {
        match self.by_key.get(&key) {
            Some(&slot) => {
                let entry = &mut self.entries[slot];
                if !entry.unread {
                    entry.unread = true;
                    self.unread.push(slot);
                }
            }
            None => self.stale = true,
        }
    }

    fn forget(&mut self, slot: usize) {
        let entry = self.entries.remove(slot);
        self.by_key.remove(&entry.key);
        for k in 0..PEAK_STATS {
            self.sums[k] -= entry.current[k];
            self.limits[k] -= entry.limit[k];
        }
    }

    /// Reads (and revokes) the shard of `slot` under its lock; adds it to `reads`.
    fn read(
        &mut self,
        slot: usize,
        shares: bool,
        totals: Option<&mut DeviceStats>,
        reads: &mut Vec<Read>,
    ) {
        let Some(shard) = self.entries.get(slot).and_then(|e| e.shard.upgrade()) else {
            if self.entries.contains(slot) {
                self.forget(slot);
            }
            return;
        };
        let PeakBook {
            entries,
            sums,
            limits,
            ..
        } = self;
        let entry = &mut entries[slot];
        let mut need = [0; PEAK_STATS];
        {
            let mut st = shard.state.lock();
            st.stats.for_each_peak_stat_mut(|k, s| {
                sums[k] += s.current - entry.current[k];
                limits[k] += s.current - entry.limit[k];
                entry.current[k] = s.current;
                entry.limit[k] = s.current;
                need[k] = (s.peak - s.current).max(0);
                s.limit = s.current;
                s.peak = s.current; // the high-water mark starts again
            });
            st.over_budget = false;
            st.stats.unread.0 = false;
            if let Some(totals) = totals {
                totals.accumulate(&st.stats);
            }
        }
        entry.unread = false;
        entry.holder = false;
        reads.push(Read {
            slot,
            shard,
            need,
            shares,
        });
    }

    fn raise_peaks(&mut self) {
        for k in 0..PEAK_STATS {
            self.peaks[k] = self.peaks[k].max(self.sums[k]);
        }
    }

    /// Gives each read shard what its high-water mark asks for, then the rest of the slack evenly
    /// to those that share; `Σ limits ≤ peak` holds after it as before.
    fn grant(&mut self, reads: &[Read]) {
        let sharers = reads.iter().filter(|r| r.shares).count() as i64;
        let mut grants = vec![[0i64; PEAK_STATS]; reads.len()];
        for k in 0..PEAK_STATS {
            let mut slack = (self.peaks[k] - self.limits[k]).max(0);
            for (grant, read) in grants.iter_mut().zip(reads) {
                grant[k] = read.need[k].clamp(0, slack);
                slack -= grant[k];
            }
            if sharers > 0 {
                let share = slack / sharers;
                for (grant, read) in grants.iter_mut().zip(reads) {
                    if read.shares {
                        grant[k] += share;
                    }
                }
            }
        }
        for (grant, read) in grants.iter().zip(reads) {
            if grant.iter().all(|&g| g == 0) || !self.entries.contains(read.slot) {
                continue;
            }
            let entry = &mut self.entries[read.slot];
            {
                let mut st = read.shard.state.lock();
                st.stats
                    .for_each_peak_stat_mut(|k, s| s.limit = entry.current[k] + grant[k]);
                // A shard that grew past its revoked limit meanwhile was told so by its own
                // increase and reconciles next; the grant does not hide that.
            }
            for (k, g) in grant.iter().enumerate() {
                entry.limit[k] = entry.current[k] + g;
                self.limits[k] += g;
            }
            if !entry.holder {
                entry.holder = true;
                self.holders.push(read.slot);
            }
        }
    }
}

impl ShardState {
    /// Called by every settle under the shard's lock: takes the flag that a statistic went past
    /// its limit (set by the increases themselves, so the hot path pays one compare per increase)
    /// and tells whether the device's book must hear of this shard — past its budget, or changed
    /// for the first time since the book read it. When true, the settle calls
    /// [`DeviceCore::reconcile_peaks`] next, on this thread, after unlocking.
    #[inline]
    pub(crate) fn take_over_budget(&mut self) -> bool {
        let over = std::mem::take(&mut self.over_budget);
        if !over && self.stats.unread.0 {
            return false;
        }
        self.stats.unread.0 = true;
        let key = self.serial as usize;
        SETTLING.with(|s| s.set(Some((key, over))));
        true
    }
}

impl DeviceCore {
    /// Enters `shard` in the peak book (at its creation; see the module docs).
    pub(in crate::alloc) fn register_for_peaks(&self, shard: &Arc<Shard>) {
        self.books.device.lock().register(shard);
    }

    /// `shard`, known to the book under serial `old`, was recycled under its serial now.
    pub(in crate::alloc) fn rekey_for_peaks(&self, old: u64, shard: &Arc<Shard>) {
        self.books.device.lock().rekey(old as usize, key_of(shard));
    }

    /// Tells the book that `shard`'s statistics may have changed on a path that does not settle
    /// (a cache release).
    pub(in crate::alloc) fn tell_peaks(&self, shard: &Shard) {
        self.books.device.lock().tell(key_of(shard));
    }

    /// After a settle that had to tell the book: records the shard as unread and, when it went
    /// past its budget, reconciles (see the module docs).
    pub(crate) fn reconcile_peaks(&self) {
        let settling = SETTLING.with(Cell::take);
        let reads = {
            let mut book = self.books.device.lock();
            let over = match settling {
                Some((key, over)) => {
                    book.tell(key);
                    over
                }
                None => {
                    book.stale = true;
                    true
                }
            };
            if !over {
                return;
            }
            self.sync(&mut book)
        };
        // The shards read are released after the book's lock.
        drop(reads);
    }

    /// Every shard's statistics added up, with exact device-wide peaks (`reset`: the peaks start
    /// again from the currents).
    pub(crate) fn exact_stats(&self, reset: bool) -> DeviceStats {
        let mut total = DeviceStats::default();
        let reads = {
            let mut book = self.books.device.lock();
            let reads = self.read_all(&mut book, reset, Some(&mut total));
            let peaks = book.peaks;
            total.for_each_peak_stat_mut(|k, s| s.peak = peaks[k].max(s.current));
            reads
        };
        drop(reads);
        total
    }

    /// The device's current totals of the statistics with a peak, exact, after reading the
    /// shards that changed since the book last read them (not every shard).
    #[cfg(feature = "replay")]
    pub(in crate::alloc) fn current_totals(&self) -> [i64; PEAK_STATS] {
        let (sums, reads) = {
            let mut book = self.books.device.lock();
            let reads = self.sync(&mut book);
            (book.sums, reads)
        };
        drop(reads);
        sums
    }

    /// Reads the unread shards (or every shard when the book cannot trust its figures), raises
    /// the peaks, restores `Σ limits ≤ peak` and grants. Returns the shards read, to be released
    /// after the book's lock.
    fn sync(&self, book: &mut PeakBook) -> Vec<Read> {
        if book.stale {
            return self.read_all(book, false, None);
        }
        let mut reads = Vec::new();
        for slot in std::mem::take(&mut book.unread) {
            if book.entries.get(slot).is_some_and(|e| e.unread) {
                book.read(slot, true, None, &mut reads);
            }
        }
        let reserved = i64::try_from(self.reserved.load(Ordering::SeqCst)).unwrap_or(i64::MAX);
        if reserved != book.sums[RESERVED_BYTES_ALL] {
            let mut all = self.read_all(book, false, None);
            all.append(&mut reads); // only to be released after the book's lock
            return all;
        }
        book.raise_peaks();
        if (0..PEAK_STATS).any(|k| book.limits[k] > book.peaks[k]) {
            for slot in std::mem::take(&mut book.holders) {
                if book.entries.get(slot).is_some_and(|e| e.holder) {
                    book.read(slot, false, None, &mut reads);
                }
            }
            book.raise_peaks();
        }
        book.grant(&reads);
        reads
    }

    /// Reads every shard of the device into a fresh book (the peaks kept, or reset to the
    /// currents), adding their statistics into `totals`.
    fn read_all(
        &self,
        book: &mut PeakBook,
        reset: bool,
        mut totals: Option<&mut DeviceStats>,
    ) -> Vec<Read> {
        let peaks = book.peaks;
        *book = PeakBook {
            peaks,
            ..PeakBook::default()
        };
        let shards = self.roster.all();
        let mut reads = Vec::with_capacity(shards.len());
        for shard in &shards {
            book.register(shard);
        }
        book.unread.clear();
        let slots: Vec<usize> = book.entries.iter().map(|(slot, _)| slot).collect();
        for slot in slots {
            book.read(slot, true, totals.as_deref_mut(), &mut reads);
        }
        if reset {
            book.peaks = book.sums;
        }
        book.raise_peaks();
        book.grant(&reads);
        reads
    }
}

impl CachingAllocator {
    /// Allocated bytes, reserved bytes and segments on `device` now (all pools), exact — what
    /// [`Runtime::memory_stats`](crate::Runtime::memory_stats) reports of them — read in time proportional to the
    /// shards that changed since the last read rather than to all of them: what a replay reads
    /// after every operation (`replay/run.rs`).
    #[cfg(feature = "replay")]
    pub(crate) fn usage_now(&self, device: usize) -> crate::error::Result<[u64; 3]> {
        use crate::alloc::stats::{ALLOCATED_BYTES_ALL, SEGMENT_ALL};
        let get = |v: i64| u64::try_from(v).unwrap_or(0);
        if self.config().thread_cache > 0 {
            // Front caches hide their blocks from the totals only when all are summed.
            let s = self.memory_stats(device)?;
            return Ok([
                get(s.allocated_bytes.all.current),
                get(s.reserved_bytes.all.current),
                get(s.segment.all.current),
            ]);
        }
        let sums = self.device(device)?.current_totals();
        Ok([
            get(sums[ALLOCATED_BYTES_ALL]),
            get(sums[RESERVED_BYTES_ALL]),
            get(sums[SEGMENT_ALL]),
        ])
    }
}

#[cfg(all(test, feature = "replay"))]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::config::AllocatorConfig;
    use crate::driver::{Driver, SimDriver};

    const MIB: u64 = 1 << 20;

    #[test]
    fn totals_read_from_the_unread_shards_equal_a_pass_over_every_shard() {
        // Sixteen streams on a device that fills up; cache releases, oversize releases,
        // expandable segments, garbage collection and `empty_cache` in turn. After every
        // operation the totals are read the cheap way; now and then they are checked against a
        // full read (which also resets what the book has to read next time).
        for conf in [
            "",
            "max_split_size_mb:32",
            "expandable_segments:True",
            "garbage_collection_threshold:0.5,per_process_memory_fraction:0.9",
            "garbage_collection_threshold:0.5,per_process_memory_fraction:0.9,expandable_segments:True",
        ] {
            let driver: Arc<dyn Driver> = Arc::new(SimDriver::new(1, 320 * MIB).unwrap());
            let a = crate::alloc::CachingAllocatorBuilder::default().config(AllocatorConfig::parse(conf).unwrap()).build(driver).unwrap();
            let streams: Vec<_> = (0..16).map(|_| a.create_stream(0).unwrap()).collect();
            let mut held = BTreeMap::new();
            let mut max = [0u64; 3];
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let mut check_in = 1;
            for i in 0..4000u64 {
                let r = next();
                if held.is_empty() || (r % 5 < 3 && held.len() < 24) {
                    let size = 1 + (r >> 16) % if i % 7 == 0 { 30 * MIB } else { 200_000 };
                    if let Ok(data) = a.allocate_on(streams[(r >> 8) as usize % 16], size) {
                        held.insert(i, data);
                    }
                } else {
                    let key = *held.keys().nth((r >> 20) as usize % held.len()).unwrap();
                    held.remove(&key);
                }
                if i % 700 == 699 {
                    a.empty_cache();
                }
                let now = a.usage_now(0).unwrap();
                for (m, n) in max.iter_mut().zip(now) {
                    *m = (*m).max(n);
                }
                check_in -= 1;
                if check_in == 0 {
                    check_in = 1 + (r >> 40) % 40;
                    let s = a.memory_stats(0).unwrap();
                    let full = [
                        s.allocated_bytes.all.current,
                        s.reserved_bytes.all.current,
                        s.segment.all.current,
                    ]
                    .map(|v| v as u64);
                    assert_eq!(now, full, "{conf:?}: operation {i}");
                }
            }
            let s = a.memory_stats(0).unwrap();
            assert!(s.num_device_free > 0, "{conf:?}: memory went back to the device");
            let peaks = [
                s.allocated_bytes.all.peak,
                s.reserved_bytes.all.peak,
                s.segment.all.peak,
            ]
            .map(|v| v as u64);
            assert_eq!(peaks, max, "{conf:?}");
        }
    }
}
