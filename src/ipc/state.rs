//! The producer's bookkeeping: ref-counter files and their free slots, the limbo of storages that
//! died while consumers still counted on them, and the storages it shared (for same-process
//! receipt). One `IpcState` per [`Runtime`](crate::Runtime).
//!
//! Limbo entries are keyed by (file number, slot). Draining reads each file's release ring and
//! re-checks only the hinted slots — cost proportional to what consumers released, independent of
//! how much sits in limbo. [`IpcState::collect`] additionally looks for slots whose holders all died
//! (`pending == 0`, `held > 0`, no OFD lock) and reclaims them with a warning.

use super::limbo::{Limbo, SlotCounters};
use super::page_protocol;
use super::page_server::SpanRegistration;
use super::page_thread::PageServer;
use super::refcount::RefCounterFile;
use super::wire::WirePages;
use super::SharedKey;
use crate::alloc::{DataPtr, PagesUnder};
use crate::driver::{Backend, ChunkId, Driver, EventId, IPC_HANDLE_SIZE};
use crate::error::Result;
use crate::process::Birth;
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex};

/// Default live interprocess-event budget (PyTorch's number).
pub(crate) const DEFAULT_EVENT_BUDGET: usize = 1000;

/// Everything a shared storage keeps while consumers may count on it (`producer.rs` makes it;
/// the limbo here keeps it while consumers count).
#[derive(Debug)]
pub(crate) struct SentData {
    /// Memory of an expandable segment: its pages are served to consumers while this lives.
    /// Declared first, so it is dropped (unregistered) before `original` frees the block.
    pub _served_pages: Option<SpanRegistration>,
    /// The original owner: keeps the block allocated.
    pub original: DataPtr,
    pub slot: SlotRef,
    pub event: Option<EventId>,
    pub memory: [u8; IPC_HANDLE_SIZE],
    pub segment_size: u64,
    pub offset: u64,
    pub nbytes: u64,
    /// The pages under the storage, for memory of an expandable segment.
    pub pages: Option<WirePages>,
}

/// A slot taken in one of our files.
#[derive(Debug, Clone)]
pub(crate) struct SlotRef {
    pub file: Arc<RefCounterFile>,
    pub file_index: u64,
    pub slot: u32,
    /// The slot's generation while this storage holds it.
    pub generation: u32,
}

#[derive(Debug)]
struct ProducerFile {
    file: Arc<RefCounterFile>,
    index: u64,
    free: Vec<u32>,
    next_unused: u32,
    in_use: u32,
}

#[derive(Debug, Default)]
struct Files {
    files: Vec<ProducerFile>,
    next_index: u64,
}

/// What one drain or collect freed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Storages freed.
    pub storages: u64,
    /// Bytes freed.
    pub bytes: u64,
    /// Of those, storages reclaimed from dead consumers.
    pub from_dead_consumers: u64,
}

/// Per-allocator IPC state.
pub(crate) struct IpcState {
    pub driver: Arc<dyn Driver>,
    pub backend: Backend,
    pid: u32,
    /// The process this state belongs to (see `process`): a forked child's copy shares nothing,
    /// and its drop releases nothing.
    birth: Birth,
    nonce: u64,
    slots_per_file: u32,
    pub event_budget: usize,
    /// Time-to-live of handles in ms (0: none).
    pub handle_ttl_ms: u64,
    pub live_events: AtomicU64,
    files: Mutex<Files>,
    /// The producers' ref-counter files this runtime opened storages of last (at most
    /// [`RECENT_FILES`]): kept mapped, so the next handle of the same producer is decoded without
    /// opening and mapping its file again (the file cache of `consumer.rs` holds only what is
    /// alive). Released with the runtime.
    recent_files: Mutex<std::collections::VecDeque<Arc<RefCounterFile>>>,
    limbo: Limbo<(u64, u32), SentData>,
    /// Serves the pages of shared expandable memory; started by the first such share.
    page_server: Mutex<Option<PageServer>>,
}

impl std::fmt::Debug for IpcState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcState")
            .field("limbo", &self.limbo.len())
            .finish()
    }
}

/// Ref-counter files a runtime keeps mapped after their storages are gone (`keep_recent`).
const RECENT_FILES: usize = 8;

impl IpcState {
    pub(crate) fn new(
        driver: Arc<dyn Driver>,
        slots_per_file: u32,
        event_budget: usize,
        handle_ttl_ms: u64,
    ) -> Self {
        IpcState {
            backend: driver.backend(),
            driver,
            pid: std::process::id(),
            birth: Birth::now(),
            nonce: crate::shm::random_u64(),
            slots_per_file: slots_per_file.max(1),
            event_budget,
            handle_ttl_ms,
            live_events: AtomicU64::new(0),
            files: Mutex::new(Files::default()),
            recent_files: Mutex::new(std::collections::VecDeque::new()),
            limbo: Limbo::default(),
            page_server: Mutex::new(None),
        }
    }

    /// Keeps `file` among the recently opened ref-counter files (the oldest beyond
    /// [`RECENT_FILES`] let go).
    pub(crate) fn keep_recent(&self, file: Arc<RefCounterFile>) {
        let mut recent = self.recent_files.lock();
        if let Some(at) = recent.iter().position(|f| Arc::ptr_eq(f, &file)) {
            recent.remove(at);
        } else if recent.len() == RECENT_FILES {
            recent.pop_back();
        }
        recent.push_front(file);
    }

    /// Refuses use by a forked child: the ref-counter files, slots, events and page socket are the
    /// parent's (a child's share would count in the parent's slots; its pages would be served by
    /// the parent's socket, which knows nothing of them).
    pub(crate) fn check_process(&self) -> Result<()> {
        self.birth
            .check("this runtime's IPC state (ref-counter files, events, page socket)")
    }

    /// Whether this is the process the state was made in (false in a forked child).
    pub(crate) fn in_its_process(&self) -> bool {
        self.birth.is_current()
    }

    /// The expiry of a handle made now (0 without a time-to-live).
    pub(crate) fn handle_expiry(&self) -> u64 {
        if self.handle_ttl_ms == 0 {
            0
        } else {
            super::refcount::now_ms().saturating_add(self.handle_ttl_ms)
        }
    }

    /// Serves `pages` of the storage `key` (whose slot is in `file`) to consumers until the
    /// registration drops (starting this allocator's page server on first use).
    pub(crate) fn serve_pages(
        &self,
        key: SharedKey,
        pages: PagesUnder,
        file: Arc<RefCounterFile>,
    ) -> Result<SpanRegistration> {
        let mut server = self.page_server.lock();
        if server.is_none() {
            let name = crate::shm::object_name(self.pid, self.nonce, page_protocol::SOCKET_TAG, 0);
            *server = Some(PageServer::start(Arc::clone(&self.driver), &name)?);
        }
        match server.as_ref() {
            Some(s) => s.register(key, pages, file),
            None => Err(crate::Error::invalid("page server missing")),
        }
    }

    /// The first address of memory in `[start, end)` shared with other processes that somebody
    /// still counts on (a consumer holds it, or a handle to it is unopened), if any: memory
    /// that a sleep must not unmap (`runtime/sleep.rs`).
    pub(crate) fn shared_in(&self, start: u64, end: u64) -> Option<u64> {
        self.page_server
            .lock()
            .as_ref()
            .and_then(|server| server.counted_span_in(start, end))
    }

    /// Serves the shared spans that `lookup` knows with the chunks it gives (`lookup(first,
    /// page, count)`): a sleeping tag's pages were mapped again with new chunks
    /// (`runtime/sleep.rs`).
    pub(crate) fn refresh_served(&self, lookup: impl Fn(u64, u64, u64) -> Option<Vec<ChunkId>>) {
        if let Some(server) = self.page_server.lock().as_ref() {
            server.rechunk(lookup);
        }
    }

    /// Serves nothing of the shared spans `inside(first, end)` picks until
    /// [`Self::refresh_served`] names their chunks again: a sleeping tag's pages are released.
    pub(crate) fn pause_served(&self, inside: impl Fn(u64, u64) -> bool) {
        if let Some(server) = self.page_server.lock().as_ref() {
            server.pause(inside);
        }
    }

    /// Takes a free slot (creating a file when every file is full).
    pub(crate) fn take_slot(&self) -> Result<SlotRef> {
        self.check_process()?;
        let mut f = self.files.lock();
        for pf in f.files.iter_mut() {
            if pf.file.intact().is_err() {
                // A truncated file takes no new storages (it goes once its last slot is back).
                continue;
            }
            let slot = match pf.free.pop() {
                Some(s) => Some(s),
                None if pf.next_unused < pf.file.slot_count() => {
                    pf.next_unused += 1;
                    Some(pf.next_unused - 1)
                }
                None => None,
            };
            if let Some(slot) = slot {
                let generation = pf.file.slot(slot)?.assign();
                pf.in_use += 1;
                return Ok(SlotRef {
                    file: Arc::clone(&pf.file),
                    file_index: pf.index,
                    slot,
                    generation,
                });
            }
        }
        let index = f.next_index;
        f.next_index += 1;
        let name = crate::shm::object_name(
            self.pid,
            self.nonce,
            super::wire::REF_FILE_TAG.trim_start_matches('-'),
            index,
        );
        let file = Arc::new(RefCounterFile::create(&name, self.slots_per_file)?);
        let generation = file.slot(0)?.assign();
        f.files.push(ProducerFile {
            file: Arc::clone(&file),
            index,
            free: Vec::new(),
            next_unused: 1,
            in_use: 1,
        });
        Ok(SlotRef {
            file,
            file_index: index,
            slot: 0,
            generation,
        })
    }

    /// Returns a slot; a file with no slot in use that is not the newest is unlinked and dropped.
    pub(crate) fn give_back_slot(&self, slot: &SlotRef) {
        let mut f = self.files.lock();
        let newest = f.next_index.saturating_sub(1);
        if let Some(at) = f.files.iter().position(|pf| pf.index == slot.file_index) {
            let pf = &mut f.files[at];
            pf.free.push(slot.slot);
            pf.in_use -= 1;
            if pf.in_use == 0 && pf.index != newest {
                // The file's name goes with its last reference (`SharedMemory` unlinks on drop):
                // possibly the storage being freed right now still holds one.
                f.files.swap_remove(at);
            }
        }
    }

    /// The producer's storage died: free it now if nobody counts on its slot, else keep its
    /// memory in limbo (decided under the limbo lock, see `limbo.rs`). Then drain.
    pub(crate) fn retire(&self, data: SentData) {
        let key = (data.slot.file_index, data.slot.slot);
        let file = Arc::clone(&data.slot.file);
        let freed = match file.intact().and_then(|()| file.slot(key.1)) {
            Ok(slot) => self.limbo.retire(key, data, slot),
            Err(err) if crate::shm::is_truncated(&err) => {
                // Counts lost: kept until `collect` finds its slot's lock free.
                tracing::warn!(%err, "a shared storage's ref-counter file was cut; it waits for its slot's lock");
                self.limbo.keep(key, data);
                None
            }
            Err(_) => Some(data),
        };
        if let Some(data) = freed {
            self.free_sent(data);
        }
        // Every producer-side free drains what consumers released meanwhile.
        self.drain();
    }

    /// Frees a shared storage for good: its event, its slot, then its memory.
    pub(crate) fn free_sent(&self, data: SentData) {
        if let Some(event) = data.event {
            if let Err(err) = self.driver.event_destroy(event) {
                tracing::warn!(%err, "destroying a shared storage's event failed");
            }
            self.live_events.fetch_sub(1, Ordering::Relaxed);
        }
        self.give_back_slot(&data.slot);
        drop(data.original);
    }

    /// Storages in limbo and their bytes.
    pub(crate) fn limbo_size(&self) -> (usize, u64) {
        if self.birth.ignored_in_child("measuring the limbo") {
            return (0, 0);
        }
        (
            self.limbo.len(),
            self.limbo.fold(0, |sum, d| sum + d.nbytes),
        )
    }

    fn producer_files(&self) -> Vec<(u64, Arc<RefCounterFile>)> {
        self.files
            .lock()
            .files
            .iter()
            .map(|pf| (pf.index, Arc::clone(&pf.file)))
            .collect()
    }

    /// Frees limbo entries whose slots consumers released since the last drain (ring hints; one
    /// scan of a file's entries if its ring overflowed). Cost ∝ releases.
    pub(crate) fn drain(&self) -> Drained {
        if self.birth.ignored_in_child("draining the limbo") {
            return Drained::default();
        }
        let mut freed = Vec::new();
        for (index, file) in self.producer_files() {
            if file.intact().is_err() {
                // Its counts and ring are lost: `collect` decides by the slots' locks.
                continue;
            }
            let released = file.drain_released();
            if released.overflowed {
                freed.extend(
                    self.limbo.take_where(|k, _| {
                        k.0 == index && file.slot(k.1).is_ok_and(|s| s.is_free())
                    }),
                );
            }
            for slot in released.slots {
                if let Ok(cell) = file.slot(slot) {
                    freed.extend(self.limbo.take_if_free((index, slot), cell));
                }
            }
        }
        let mut out = Drained::default();
        for data in freed {
            out.storages += 1;
            out.bytes += data.nbytes;
            self.free_sent(data);
        }
        out
    }

    /// [`Self::drain`], then reclaims limbo slots whose every holder is dead.
    pub(crate) fn collect(&self) -> Drained {
        if self.birth.ignored_in_child("collecting the limbo") {
            return Drained::default();
        }
        if let Err(err) = crate::shm::sweep_orphans() {
            tracing::debug!(%err, "sweeping orphaned shared-memory objects failed");
        }
        let mut out = self.drain();
        let mut dead_holders = std::collections::HashSet::new();
        let now = super::refcount::now_ms();
        let taken = self.limbo.take_where(|key, data| {
            let file = &data.slot.file;
            let slot = match file.intact().and_then(|()| file.slot(key.1)) {
                Ok(slot) => slot,
                // A cut file: whoever holds the storage holds its slot's lock (taken before any
                // count), and no handle of it can be opened any more.
                Err(err) if crate::shm::is_truncated(&err) => {
                    return file.is_locked(key.1).is_ok_and(|locked| !locked);
                }
                Err(_) => return false,
            };
            let expired = slot.reclaim_expired(now);
            if expired > 0 {
                tracing::info!(
                    handles = expired,
                    slot = key.1,
                    "reclaimed the counts of IPC handles that expired unopened"
                );
            }
            match slot.counts() {
                (0, 0) => true,
                (0, _) if data.slot.file.is_locked(key.1).is_ok_and(|locked| !locked) => {
                    // Every holder is dead: Linux dropped their locks with them.
                    slot.clear();
                    dead_holders.insert(*key);
                    true
                }
                _ => false,
            }
        });
        let dead: Vec<(SentData, bool)> = taken
            .into_iter()
            .map(|d| {
                let from_dead = dead_holders.contains(&(d.slot.file_index, d.slot.slot));
                (d, from_dead)
            })
            .collect();
        for (data, from_dead) in dead {
            out.storages += 1;
            out.bytes += data.nbytes;
            if from_dead {
                out.from_dead_consumers += 1;
                tracing::warn!(
                    bytes = data.nbytes,
                    slot = data.slot.slot,
                    "reclaimed shared memory held only by dead consumer processes"
                );
            }
            self.free_sent(data);
        }
        out
    }

    /// Allocator teardown: frees what it can and warns once about what stays in limbo.
    pub(crate) fn shutdown(&self) {
        if !self.birth.is_current() {
            return;
        }
        self.collect();
        let (count, bytes) = self.limbo_size();
        if count > 0 {
            tracing::warn!(
                storages = count,
                bytes,
                "cudalloc: shared storages still counted by consumer processes at exit; their memory stays allocated until the process exits"
            );
            // Consumers may still read this memory: it must not return to the cache (or the driver).
            // It is released with the process.
            let entries = self.limbo.drain_all();
            for data in entries {
                std::mem::forget(data);
            }
            // Consumers may still open handles of those storages: their pages stay served.
            if let Some(server) = self.page_server.lock().take() {
                server.serve_until_exit();
            }
        }
    }
}

impl Drop for IpcState {
    fn drop(&mut self) {
        // In a forked child, the storages in limbo and the page server are the parent's.
        crate::process::leak_in_child(self.birth, &mut self.limbo);
        crate::process::leak_in_child(self.birth, &mut self.page_server);
    }
}
