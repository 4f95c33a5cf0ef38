//! The id tables both backends keep for the handles they hand out (streams, events): ids are
//! numbers from one counter per driver, never raw CUDA pointers or host addresses, so an id the
//! driver did not hand out — or already destroyed — is an [`Error::InvalidArgument`], never
//! undefined behaviour. Removal returns the entry, so two threads destroying one id cannot both
//! destroy the underlying object.
//!
//! A table is a door of its driver (`process.rs`): looked up, removed from or searched in a forked
//! child, it answers [`Error::ForkedChild`] before taking its lock. Inserting needs no check: what
//! is inserted was just made through another door.

use rustc_hash::FxHashMap;

use super::{DriverTag, StreamId};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::RwLock;

/// A driver's id counters (ids start at 1) and the driver's number its stream ids carry. Streams
/// count apart from the rest (events, segments, graphs, opened handles): a stream id has 36 bits
/// for its number, which the other ids would spend.
#[derive(Debug)]
pub(crate) struct IdCounter {
    next: AtomicU64,
    streams: AtomicU64,
    driver: DriverTag,
}

impl Default for IdCounter {
    fn default() -> Self {
        IdCounter {
            next: AtomicU64::new(1),
            streams: AtomicU64::new(1),
            driver: DriverTag::fresh(),
        }
    }
}

impl IdCounter {
    /// A number never handed out before by this counter.
    pub(crate) fn fresh(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// A stream id on `device` never handed out before by this driver.
    pub(crate) fn stream(&self, device: usize) -> Result<StreamId> {
        let serial = self.streams.fetch_add(1, Ordering::Relaxed);
        StreamId::new(self.driver, device, serial)
    }

    /// The driver's number.
    pub(crate) fn driver(&self) -> DriverTag {
        self.driver
    }
}

/// Entries of one kind (`what` names it in errors) by id.
#[derive(Debug)]
pub(crate) struct Registry<T> {
    what: &'static str,
    /// For a table of streams: the driver whose stream ids it keeps (to name another driver's
    /// stream in the error).
    driver: Option<DriverTag>,
    /// Fx-hashed: the keys are this driver's own counter values, and a lookup (every stream and
    /// event call) is on the hot path; SipHash cost ~150 instructions a lookup.
    entries: RwLock<FxHashMap<u64, T>>,
    birth: Birth,
}

impl<T: Clone> Registry<T> {
    /// An empty table of `what`s (`"stream"`, `"event"`).
    pub(crate) fn new(what: &'static str) -> Self {
        Registry {
            what,
            driver: None,
            entries: RwLock::new(FxHashMap::default()),
            birth: Birth::now(),
        }
    }

    /// An empty table of `driver`'s streams.
    pub(crate) fn of_streams(driver: DriverTag) -> Self {
        Registry {
            driver: Some(driver),
            ..Registry::new("stream")
        }
    }

    /// `Ok` in the process that made the table (see the module docs).
    fn door(&self) -> Result<()> {
        if self.birth.is_current() {
            return Ok(());
        }
        self.birth
            .check(&format!("this driver's {} table", self.what))
    }

    fn unknown(&self, id: u64) -> Error {
        let unknown = || {
            Error::invalid(format!(
                "{} {id} was not created by this driver or was destroyed",
                self.what
            ))
        };
        match self.driver {
            Some(mine) => StreamId(id).unknown_to(mine, unknown),
            None => unknown(),
        }
    }

    /// Adds `value` under `id`.
    pub(crate) fn insert(&self, id: u64, value: T) {
        self.entries.write().insert(id, value);
    }

    /// The entry of `id`.
    pub(crate) fn get(&self, id: u64) -> Result<T> {
        self.door()?;
        self.entries
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| self.unknown(id))
    }

    /// Takes the entry of `id` out (exactly one caller gets it).
    pub(crate) fn remove(&self, id: u64) -> Result<T> {
        self.door()?;
        self.entries
            .write()
            .remove(&id)
            .ok_or_else(|| self.unknown(id))
    }

    /// The id of the entry `matches` accepts, or `make()`'s new entry under a fresh id `fresh()`
    /// (one step: two callers never both insert).
    pub(crate) fn find_or_insert(
        &self,
        matches: impl Fn(&T) -> bool,
        fresh: impl FnOnce() -> Result<u64>,
        make: impl FnOnce() -> T,
    ) -> Result<u64> {
        self.door()?;
        let mut entries = self.entries.write();
        if let Some((&id, _)) = entries.iter().find(|(_, v)| matches(v)) {
            return Ok(id);
        }
        let id = fresh()?;
        entries.insert(id, make());
        Ok(id)
    }

    /// Every entry (a snapshot).
    pub(crate) fn values(&self) -> Vec<T> {
        self.entries.read().values().cloned().collect()
    }

    /// Takes every entry out (teardown).
    pub(crate) fn drain(&self) -> Vec<T> {
        self.entries.write().drain().map(|(_, v)| v).collect()
    }

    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.entries.read().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_removed_ids_are_errors_and_removal_is_exclusive() {
        let ids = IdCounter::default();
        let table = Registry::new("stream");
        let a = ids.fresh();
        table.insert(a, "a");
        assert_eq!(table.get(a).unwrap(), "a");
        assert!(table.get(a + 1).unwrap_err().to_string().contains("stream"));
        assert_eq!(table.remove(a).unwrap(), "a");
        assert!(table.remove(a).is_err(), "a second destroy is refused");
        assert_ne!(ids.fresh(), a);
        assert_eq!(table.len(), 0);
    }
}
