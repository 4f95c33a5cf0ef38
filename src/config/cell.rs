//! The configuration in force, with one home per setting and nothing kept beyond it.
//!
//! A live runtime changes settings (`Runtime::reconfigure`); what the allocator keeps of them must
//! not grow with the number of changes (found by a hostile round: every published value was kept
//! for the allocator's life and compared with the next — 20,000 distinct values cost 9.5 MiB and
//! made a change 11 times slower). So the cell holds exactly the configuration in force, shared
//! (`Arc`) with the readers that asked for it, and the values the hot paths read are copied out
//! of it by value when it is published:
//!
//! | reader | reads | cost |
//! |---|---|---|
//! | a request being rounded (before any lock: the allocation door, a thread's front cache) | [`ConfigCell::divisions_for`]: the one `roundup_power2_divisions` entry of the size's interval | one atomic load |
//! | a fit, a split, a segment counted as oversize (under a shard's lock) | the shard's [`FitRules`], copied into every shard's state by the publish | none: a field under the lock already held |
//! | everything else (misses, releases, reports, the runtime's door) | [`ConfigCell::get`]: the whole configuration | a lock and a reference count, on cold paths only |
//!
//! A superseded configuration is dropped when its last reader lets it go; the allocator keeps one.
//! A request rounded just before a change and fitted just after sees each value whole (one
//! division, then the fit rules of one configuration): every combination is one some setting
//! would make.

use super::{AllocatorConfig, ROUNDUP_INTERVALS};
use crate::process::Birth;
use crate::sync::os::atomic::{AtomicPtr, AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex};

/// The settings a fit, a split and the oversize count read under a shard's lock, by value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FitRules {
    /// `max_split_size` in bytes (`u64::MAX`: no limit).
    pub max_split_size: u64,
    /// `max_non_split_rounding` in bytes.
    pub max_non_split_rounding: u64,
}

impl AllocatorConfig {
    /// The fit rules of this configuration.
    pub(crate) fn fit_rules(&self) -> FitRules {
        FitRules {
            max_split_size: self.max_split_size,
            max_non_split_rounding: self.max_non_split_rounding,
        }
    }
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct ConfigCell {
    current: Mutex<Arc<AllocatorConfig>>,
    /// The configuration `current` holds, as a pointer: what a forked child reads, where the
    /// lock may be held by a parent thread that does not exist there (`process`). Set under the
    /// lock, before the value it replaces is dropped, so it always points at a live value — in
    /// a child too, where the parent's writer never drops the value it was replacing.
    forked: AtomicPtr<AllocatorConfig>,
    /// The process the cell belongs to.
    birth: Birth,
    /// `roundup_power2_divisions` of the configuration in force, entry by entry.
    divisions: [AtomicU64; ROUNDUP_INTERVALS],
    /// `pass_through` of the configuration in force, read by every fit and free: a live runtime
    /// refuses to change it (`live.rs`), so the value the cell was made with stays in force.
    pass_through: bool,
    /// Writers one at a time ([`ConfigCell::update`]).
    writers: Mutex<()>,
}

impl ConfigCell {
    /// A cell holding `config`.
    pub(crate) fn new(config: AllocatorConfig) -> Self {
        let divisions = config.roundup_power2_divisions.map(AtomicU64::new);
        let pass_through = config.pass_through;
        let current = Arc::new(config);
        ConfigCell {
            pass_through,
            forked: AtomicPtr::new(Arc::as_ptr(&current).cast_mut()),
            birth: Birth::now(),
            current: Mutex::new(current),
            divisions,
            writers: Mutex::new(()),
        }
    }

    /// The configuration in force (as of this call), kept alive by the returned reference.
    pub(crate) fn get(&self) -> Arc<AllocatorConfig> {
        if !self.birth.is_current() {
            // A forked child: no lock (a parent thread may have held it at the fork).
            let ptr = self.forked.load(Ordering::Acquire).cast_const();
            // SAFETY: `forked` points at the value of an `Arc` the cell holds, or held until a
            // writer of the parent replaced it and had not yet dropped it (see the field; that
            // writer does not exist in this child, so it never will). This thread is the
            // child's only one: nothing drops the value while its count is raised here, and
            // from then on the returned `Arc` owns that count — what `Arc::clone` does.
            return unsafe {
                Arc::increment_strong_count(ptr);
                Arc::from_raw(ptr)
            };
        }
        Arc::clone(&self.current.lock())
    }

    /// The `roundup_power2_divisions` entry for a request of `size` bytes in the configuration
    /// in force (`AllocatorConfig::divisions_for`).
    #[inline]
    pub(crate) fn divisions_for(&self, size: u64) -> u64 {
        self.divisions[AllocatorConfig::division_interval(size)].load(Ordering::Relaxed)
    }

    /// Whether the default pool passes every allocation through to the driver (no lock, no
    /// reference count: the fit and free paths ask).
    #[inline]
    pub(crate) fn pass_through(&self) -> bool {
        self.pass_through
    }

    /// Makes `config` the one in force; the one it replaces is dropped with its last reader.
    pub(crate) fn publish(&self, config: AllocatorConfig) {
        for (cell, &value) in self.divisions.iter().zip(&config.roundup_power2_divisions) {
            cell.store(value, Ordering::Relaxed);
        }
        let mut current = self.current.lock();
        let previous = std::mem::replace(&mut *current, Arc::new(config));
        self.forked
            .store(Arc::as_ptr(&current).cast_mut(), Ordering::Release);
        drop(current);
        // Dropped outside the lock, after `forked` moved on.
        drop(previous);
    }

    /// Publishes what `next` makes of the configuration in force, one writer at a time (a
    /// concurrent `update` waits, then sees this one's value); nothing is published when `next`
    /// fails.
    pub(crate) fn update<E>(
        &self,
        next: impl FnOnce(&AllocatorConfig) -> Result<AllocatorConfig, E>,
    ) -> Result<(), E> {
        let _one_writer = self.writers.lock();
        let value = next(&self.get())?;
        self.publish(value);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_keeps_its_value_and_the_cell_keeps_one() {
        let cell = ConfigCell::new(AllocatorConfig::default());
        let before = cell.get();
        for i in 0..1_000 {
            cell.update(|c| {
                let mut next = c.clone();
                next.garbage_collection_threshold = 0.5 + f64::from(i) / 10_000.0;
                next.roundup_power2_divisions[3] = 4;
                Ok::<_, ()>(next)
            })
            .unwrap();
        }
        assert_eq!(
            before.garbage_collection_threshold, 0.0,
            "the reader's value"
        );
        assert!((cell.get().garbage_collection_threshold - 0.5999).abs() < 1e-9);
        assert_eq!(
            Arc::strong_count(&before),
            1,
            "superseded values are the readers' only"
        );
        assert_eq!(cell.divisions_for(8 << 20), 4);
        assert_eq!(cell.divisions_for(1 << 20), 0);
        let failed: Result<(), &str> = cell.update(|_| Err("refused"));
        assert!(failed.is_err());
        assert!((cell.get().garbage_collection_threshold - 0.5999).abs() < 1e-9);
    }
}
