//! Consumer side: opening a handle, the caches that make a handle open once per process, and the
//! lease a process holds on a slot while it uses a received storage.
//!
//! * Opened segment mappings are cached by memory handle (a CUDA handle opens once per process);
//!   received storages by (memory handle, offset), weakly: a second receipt of a live storage
//!   returns the same `Storage` and gives the producer its count back at once.
//! * Ref-counter files are opened once per process and cached by name.
//! * A lease is taken with the slot's shared OFD lock held *before* `pending` moves to `held`; it is
//!   released after the process's work on the memory is done: streams synchronized, `held` lowered,
//!   the slot pushed into the release ring, then the lock dropped.

use std::collections::HashMap;

use super::limbo::SlotCounters;
use super::refcount::{underflow, RefCounterFile};
use super::wire::WireHandle;
use crate::driver::{DevicePtr, Driver, StreamId, IPC_HANDLE_SIZE};
use crate::error::{Error, Result};
use crate::storage::WeakStorage;
use crate::sync::os::{Arc, Mutex, Weak};

/// Ref-counter files this process opened, by name.
static OPENED_FILES: Mutex<Option<HashMap<String, Weak<RefCounterFile>>>> = Mutex::new(None);

/// Opens (or reuses) another process's ref-counter file.
pub(crate) fn open_ref_file(name: &str, producer_pid: u32) -> Result<Arc<RefCounterFile>> {
    let mut guard = OPENED_FILES.lock();
    let files = guard.get_or_insert_with(HashMap::new);
    files.retain(|_, w| w.strong_count() > 0);
    if let Some(file) = files.get(name).and_then(Weak::upgrade) {
        return Ok(file);
    }
    let file = Arc::new(RefCounterFile::open(name, producer_pid)?);
    files.insert(name.to_owned(), Arc::downgrade(&file));
    Ok(file)
}

/// One pending count on a slot, owned by an `IpcHandle` until it is opened (then it becomes a
/// lease) or dropped (then it is given back).
#[derive(Debug)]
pub(crate) struct Claim {
    inner: Option<(Arc<RefCounterFile>, u32)>,
}

impl Claim {
    pub fn new(file: Arc<RefCounterFile>, slot: u32) -> Self {
        Claim {
            inner: Some((file, slot)),
        }
    }

    /// Lets the count travel with the bytes (sent to another process): nothing is given back.
    pub fn forget(mut self) {
        self.inner = None;
    }

    /// Gives the count back to the producer now.
    pub fn give_back(mut self) {
        if let Some((file, slot)) = self.inner.take() {
            give_back(&file, slot);
        }
    }

    /// Turns the claim into a lease of this process (lock, then `pending` → `held`). On error the
    /// count is given back.
    pub fn into_lease(mut self) -> Result<Lease> {
        let (file, slot) = self
            .inner
            .take()
            .ok_or_else(|| Error::invalid("claim already used"))?;
        if let Err(err) = file.lock_shared(slot) {
            give_back(&file, slot);
            return Err(err);
        }
        let held = file.slot(slot).and_then(|s| {
            if s.pending_to_held() {
                Ok(())
            } else {
                Err(underflow("pending"))
            }
        });
        if let Err(err) = held {
            let _ = file.unlock(slot);
            return Err(err);
        }
        Ok(Lease { file, slot })
    }
}

fn give_back(file: &RefCounterFile, slot: u32) {
    match file.slot(slot).and_then(|s| {
        if s.give_back_pending() {
            Ok(())
        } else {
            Err(underflow("pending"))
        }
    }) {
        Ok(()) => file.push_release(slot),
        Err(err) => tracing::warn!(%err, "giving an IPC count back failed"),
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some((file, slot)) = self.inner.take() {
            give_back(&file, slot);
        }
    }
}

/// This process holds `slot`.
#[derive(Debug)]
pub(crate) struct Lease {
    pub file: Arc<RefCounterFile>,
    pub slot: u32,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Err(err) = self.file.slot(self.slot).and_then(|s| {
            if s.release_held() {
                Ok(())
            } else {
                Err(underflow("held"))
            }
        }) {
            tracing::warn!(%err, "releasing an IPC lease failed");
        }
        self.file.push_release(self.slot);
        if let Err(err) = self.file.unlock(self.slot) {
            tracing::warn!(%err, "unlocking an IPC slot failed");
        }
    }
}

/// An opened segment of another process; closed when the last storage in it drops.
#[derive(Debug)]
pub(crate) struct Mapping {
    driver: Arc<dyn Driver>,
    pub base: DevicePtr,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Err(err) = self.driver.ipc_close_memory(self.base) {
            tracing::warn!(%err, "closing an IPC mapping failed");
        }
    }
}

/// The owner of a received storage's `DataPtr`.
#[derive(Debug)]
pub(crate) struct ReceivedOwner {
    pub wire: WireHandle,
    /// Streams whose work must finish before the lease is released.
    pub streams: Mutex<Vec<StreamId>>,
    pub driver: Arc<dyn Driver>,
    pub lease: Option<Lease>,
    /// Keeps the segment open while the storage lives (dropped after the lease).
    pub _mapping: Arc<Mapping>,
}

impl Drop for ReceivedOwner {
    fn drop(&mut self) {
        for stream in self.streams.lock().drain(..) {
            if let Err(err) = self.driver.stream_synchronize(stream) {
                tracing::warn!(%err, "synchronizing a consumer stream before release failed");
            }
        }
        drop(self.lease.take());
    }
}

/// Per-allocator consumer caches.
#[derive(Debug, Default)]
pub(crate) struct ConsumerCaches {
    pub mappings: Mutex<HashMap<[u8; IPC_HANDLE_SIZE], Weak<Mapping>>>,
    pub received: Mutex<HashMap<([u8; IPC_HANDLE_SIZE], u64), WeakStorage>>,
}

impl ConsumerCaches {
    /// The mapping of `wire`'s segment, opened once per process.
    pub fn mapping(&self, driver: &Arc<dyn Driver>, wire: &WireHandle) -> Result<Arc<Mapping>> {
        let mut maps = self.mappings.lock();
        maps.retain(|_, w| w.strong_count() > 0);
        if let Some(m) = maps.get(&wire.memory).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let device =
            usize::try_from(wire.device).map_err(|_| Error::bad_handle("device ordinal"))?;
        let opened = driver.ipc_open_memory(device, &crate::driver::IpcMemHandle(wire.memory))?;
        let mapping = Arc::new(Mapping {
            driver: Arc::clone(driver),
            base: opened.ptr,
        });
        if opened.size < wire.segment_size {
            return Err(Error::bad_handle(format!(
                "the opened segment has {} bytes, the handle claims {}",
                opened.size, wire.segment_size
            )));
        }
        maps.insert(wire.memory, Arc::downgrade(&mapping));
        Ok(mapping)
    }
}

impl ConsumerCaches {
    /// Number of segments of other processes open now.
    pub fn open_mappings(&self) -> usize {
        self.mappings
            .lock()
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }
}
