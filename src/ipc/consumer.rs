//! Consumer side: opening a handle, the caches that make a handle open once per process, and the
//! lease a process holds on a slot while it uses a received storage.
//!
//! * Opened segment mappings are shared per (driver, memory handle): a CUDA handle opens once per
//!   process and context, however many allocators receive storages in it.
//! * Ref-counter files are opened once per process and cached by name.
//! * A lease is taken with the slot's shared OFD lock held *before* `pending` moves to `held`; it is
//!   released after the process's work on the memory is done: streams synchronized, `held` lowered,
//!   the slot pushed into the release ring, then the lock dropped.

use std::collections::HashMap;

use super::lease_table::LeaseTable;
use super::limbo::SlotCounters;
use super::page_mappings::driver_key;
use super::refcount::{underflow, RefCounterFile};
use super::wire::WireHandle;
use crate::alloc::SharedOwner;
use crate::driver::{DeviceAddr, Driver, StreamId, IPC_HANDLE_SIZE};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::process::PerProcess;
use crate::sync::os::{Arc, Mutex, Weak};

/// Ref-counter files this process opened, by name.
/// Ref-counter files by name (weak: a file closes with its last user).
type OpenedFiles = HashMap<String, Weak<RefCounterFile>>;

static OPENED_FILES: PerProcess<Mutex<Option<OpenedFiles>>> = PerProcess::new(|| Mutex::new(None));

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

/// Which count a claim owns: the slot, the generation of the storage it names, its expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotTicket {
    pub slot: u32,
    pub generation: u32,
    /// Unix time (ms) after which the handle is refused (0: never).
    pub expires_ms: u64,
}

/// One pending count on a slot, owned by an `IpcHandle` until it is opened (then it becomes a
/// lease) or dropped (then it is given back). A stale or expired claim owns nothing any more: the
/// slot refuses its operations (see `refcount.rs`).
#[derive(Debug)]
pub(crate) struct Claim {
    inner: Option<(Arc<RefCounterFile>, SlotTicket)>,
    /// A forked child's copy of the handle gives nothing back (the parent's copy does).
    birth: Birth,
}

impl Claim {
    pub(crate) fn new(file: Arc<RefCounterFile>, ticket: SlotTicket) -> Self {
        Claim {
            inner: Some((file, ticket)),
            birth: Birth::now(),
        }
    }

    /// Whether the producer of the claimed slot still runs (see `RefCounterFile::producer_alive`);
    /// `true` for a used claim (nothing to judge by).
    pub(crate) fn producer_alive(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(|(file, _)| file.producer_alive())
    }

    /// Lets the count travel with the bytes (sent to another process): nothing is given back.
    pub(crate) fn forget(mut self) {
        self.inner = None;
    }

    /// Gives the count back to the producer now.
    pub(crate) fn give_back(mut self) {
        if let Some((file, ticket)) = self.inner.take() {
            give_back(&file, ticket);
        }
    }

    /// The ref-counter file the claim counts in (`None` once used).
    pub(crate) fn file(&self) -> Option<&Arc<RefCounterFile>> {
        self.inner.as_ref().map(|(file, _)| file)
    }

    /// Turns the claim into a lease of this process (see [`Lease`]). On error the count is given
    /// back (or, for an expired handle, left to the producer's reclaim).
    pub(crate) fn into_lease(mut self) -> Result<Lease> {
        self.birth.check("this IPC handle")?;
        let (file, ticket) = self
            .inner
            .take()
            .ok_or_else(|| Error::invalid("claim already used"))?;
        Lease::take(file, ticket)
    }
}

/// Gives one `pending` count back without a release hint (the caller's process still holds the
/// slot, so it cannot become free now).
fn give_back_quietly(file: &RefCounterFile, ticket: SlotTicket) -> Result<()> {
    file.slot(ticket.slot)?
        .give_back(ticket.generation)
        .map_err(|refused| refused.into_error(ticket.slot))
}

fn give_back(file: &RefCounterFile, ticket: SlotTicket) {
    match give_back_quietly(file, ticket) {
        Ok(()) => file.push_release(ticket.slot),
        Err(err) => tracing::warn!(%err, "giving an IPC count back failed"),
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            return;
        }
        if let Some((file, ticket)) = self.inner.take() {
            give_back(&file, ticket);
        }
    }
}

/// Leases of this process by (ref-counter file name, slot): how many live [`Lease`]s share the
/// process's one hold on the slot. The process's OFD lock and its `held` count are taken by the
/// first lease and given up by the last, under this table's lock — so two allocators, or two
/// threads, of one process never unlock a slot another lease of the process still needs (the
/// lock sits on the process's one open file description of the ref-counter file).
static LEASES: PerProcess<LeaseTable<(String, u32)>> = PerProcess::new(LeaseTable::default);

fn leases() -> &'static LeaseTable<(String, u32)> {
    LEASES.get()
}

/// This process holds `slot` (one of possibly several leases of the process on it).
///
/// | leases of the process on the slot | taking one                          | dropping one                              |
/// |-----------------------------------|-------------------------------------|-------------------------------------------|
/// | 0 → 1                             | OFD lock, then `pending` → `held`    | —                                         |
/// | n → n + 1 (n ≥ 1)                 | `pending` − 1 (the process already holds) | —                                    |
/// | n → n − 1 (n ≥ 2)                 | —                                   | nothing shared changes                    |
/// | 1 → 0                             | —                                   | `held` − 1, release hint, then unlock     |
///
/// A forked child inherits the lease table, the counts and the OFD lock (on the open file
/// description it shares with its parent): its copy of a lease releases nothing (see `process`).
#[derive(Debug)]
pub(crate) struct Lease {
    pub file: Arc<RefCounterFile>,
    pub slot: u32,
    birth: Birth,
}

impl Lease {
    /// Whether the producer of the leased slot still runs.
    pub(crate) fn producer_alive(&self) -> bool {
        self.file.producer_alive()
    }

    fn take(file: Arc<RefCounterFile>, ticket: SlotTicket) -> Result<Lease> {
        let slot = ticket.slot;
        if ticket.expires_ms != 0 && super::refcount::now_ms() >= ticket.expires_ms {
            // The producer reclaims the count: nothing to give back.
            return Err(super::refcount::Refused::Expired.into_error(slot));
        }
        let key = (file.name().to_owned(), slot);
        leases().take(
            key,
            || {
                file.lock_shared(slot)
                    .inspect_err(|_| give_back(&file, ticket))?;
                // Checked after the lock: a producer that finds the file cut frees a storage
                // only while nobody holds its slot's lock.
                let claimed = file.intact().and_then(|()| file.slot(slot)).and_then(|s| {
                    s.claim(ticket.generation, ticket.expires_ms)
                        .map_err(|refused| refused.into_error(slot))
                });
                if claimed.is_err() {
                    if let Err(err) = file.unlock(slot) {
                        tracing::error!(%err, slot,
                            "unlocking an IPC slot after a refused claim failed; the producer cannot free it while this process lives");
                    }
                }
                claimed
            },
            // The process already holds the slot: this count is covered by that hold.
            || give_back_quietly(&file, ticket),
        )?;
        Ok(Lease {
            file,
            slot,
            birth: Birth::now(),
        })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            // The parent still holds the slot with this very count and lock.
            return;
        }
        let key = (self.file.name().to_owned(), self.slot);
        let known = leases().release(&key, || {
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
        });
        if !known {
            tracing::warn!(slot = self.slot, "IPC lease missing from the lease table");
        }
    }
}

/// Segments of other processes open in this process, by (driver, memory handle), with how many
/// [`Mapping`]s use each. A handle opens once per driver (CUDA refuses a second open in one
/// context; the host backend does too), however many allocators over that driver receive storages
/// in it. Opening and the last close both happen under this table's lock, so a close in progress
/// can never race a reopen of the same handle.
static MAPPINGS: PerProcess<Mutex<Option<HashMap<MappingKey, MappingEntry>>>> =
    PerProcess::new(|| Mutex::new(None));

/// The driver's address (stable while any mapping holds the driver) and the memory handle.
type MappingKey = (usize, [u8; IPC_HANDLE_SIZE]);

#[derive(Debug)]
struct MappingEntry {
    base: DeviceAddr,
    size: u64,
    users: u64,
}

/// One user of an opened segment of another process; the segment is closed when the last user
/// drops.
#[derive(Debug)]
pub(crate) struct Mapping {
    driver: Arc<dyn Driver>,
    key: MappingKey,
    pub base: DeviceAddr,
}

impl Mapping {
    /// Opens `wire`'s segment through `driver`, or joins the mapping already open.
    pub(super) fn open(driver: &Arc<dyn Driver>, wire: &WireHandle) -> Result<Mapping> {
        let key = (driver_key(driver), wire.memory);
        let mut table = MAPPINGS.lock();
        let maps = table.get_or_insert_with(HashMap::new);
        let entry = match maps.get_mut(&key) {
            Some(entry) => entry,
            None => {
                let device = usize::try_from(wire.device)
                    .map_err(|_| Error::bad_handle("device ordinal"))?;
                let opened = driver
                    .ipc()
                    .ipc_open_memory(device, &crate::driver::IpcMemHandle(wire.memory))?;
                maps.entry(key).or_insert(MappingEntry {
                    base: opened.ptr,
                    size: opened.size,
                    users: 0,
                })
            }
        };
        entry.users += 1;
        let mapping = Mapping {
            driver: Arc::clone(driver),
            key,
            base: entry.base,
        };
        if entry.size < wire.segment_size {
            let size = entry.size;
            drop(table);
            drop(mapping);
            return Err(Error::bad_handle(format!(
                "the opened segment has {size} bytes, the handle claims {}",
                wire.segment_size
            )));
        }
        Ok(mapping)
    }

    /// Segments open through `driver` now.
    pub(super) fn open_count(driver: &Arc<dyn Driver>) -> usize {
        let key = driver_key(driver);
        MAPPINGS
            .lock()
            .as_ref()
            .map_or(0, |maps| maps.keys().filter(|k| k.0 == key).count())
    }

    /// Bytes of the segments open through `driver` now.
    pub(super) fn open_bytes(driver: &Arc<dyn Driver>) -> u64 {
        let key = driver_key(driver);
        MAPPINGS.lock().as_ref().map_or(0, |maps| {
            maps.iter()
                .filter(|(k, _)| k.0 == key)
                .map(|(_, e)| e.size)
                .sum()
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let mut table = MAPPINGS.lock();
        let Some(maps) = table.as_mut() else { return };
        let Some(entry) = maps.get_mut(&self.key) else {
            return;
        };
        entry.users = entry.users.saturating_sub(1);
        if entry.users > 0 {
            return;
        }
        maps.remove(&self.key);
        if let Err(err) = self.driver.ipc().ipc_close_memory(self.base) {
            tracing::warn!(%err, "closing an IPC mapping failed");
        }
    }
}

/// How a received storage's memory is mapped here.
#[derive(Debug)]
pub(crate) enum ReceivedMapping {
    /// The producer's whole segment (a driver IPC handle).
    Segment(Mapping),
    /// The pages under the storage, from an expandable segment (`page_mappings.rs`).
    Pages(super::page_mappings::PageMapping),
}

impl ReceivedMapping {
    /// Where the mapped segment (or first page) starts here.
    pub(super) fn base(&self) -> DeviceAddr {
        match self {
            ReceivedMapping::Segment(m) => m.base,
            ReceivedMapping::Pages(m) => m.base,
        }
    }
}

/// The owner of a received storage's `DataPtr`.
///
/// Dropping it: the streams that used the memory are synchronized, then the mapping is dropped,
/// then the lease — so the process never holds memory the producer may already have freed (page
/// sharing relies on it, `page_mappings.rs`).
#[derive(Debug)]
pub(crate) struct ReceivedOwner {
    pub wire: WireHandle,
    /// Streams whose work must finish before the lease is released.
    pub streams: Mutex<Vec<StreamId>>,
    pub driver: Arc<dyn Driver>,
    pub lease: Option<Lease>,
    /// Keeps the memory mapped while the storage lives (dropped before the lease).
    pub mapping: Option<ReceivedMapping>,
    /// In a forked child the owner releases nothing: no stream wait, no unmap, no lease.
    pub birth: Birth,
}

impl SharedOwner for ReceivedOwner {
    fn label(&self) -> &'static str {
        "ipc-received"
    }

    fn record_stream(&self, stream: StreamId) -> Result<()> {
        // The lease is released only after the work queued on `stream` so far is done.
        let mut streams = self.streams.lock();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        Ok(())
    }
}

impl Drop for ReceivedOwner {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            std::mem::forget(self.mapping.take());
            std::mem::forget(self.lease.take());
            return;
        }
        for stream in self.streams.lock().drain(..) {
            if let Err(err) = self.driver.stream_synchronize(stream) {
                tracing::warn!(%err, "synchronizing a consumer stream before release failed");
            }
        }
        drop(self.mapping.take());
        drop(self.lease.take());
    }
}
