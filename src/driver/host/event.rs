//! Host-backend events: cells of atomics in shared-memory files, so another process can map the
//! same cell and wait on it.
//!
//! Each process keeps a pool of *chunk* files (`cudalloc-<pid>-<nonce>-evt<n>`), each a 64-byte
//! header plus [`CELLS_PER_CHUNK`] 64-byte cells. A cell holds:
//!
//! | field       | written by                    | meaning                                        |
//! |-------------|-------------------------------|------------------------------------------------|
//! | `recorded`  | `event_record` (at call time) | sequence number of the latest record (`fetch_max`) |
//! | `completed` | the stream, when it reaches the record | highest finished record (`fetch_max`) |
//! | `wake`      | every completion              | futex word: bumped so sleepers re-check        |
//! | `waiters`   | sleepers                      | completions only issue `FUTEX_WAKE` when > 0   |
//!
//! Both counters only grow while only cudalloc writes them (a reused cell keeps counting), so
//! `completed <= recorded` always holds for an honest cell. The event is complete when
//! `completed >= target`. A wait captures its target at call time, exactly like
//! `cuStreamWaitEvent`: a later re-record does not change what an earlier wait waits for.
//!
//! | whose cell | its target                                    | its counters                     |
//! |------------|-----------------------------------------------|----------------------------------|
//! | this process's ([`CellRef`]) | the latest record made here  | [`LocalCounters`]: private, authoritative; the shared cell is only published to |
//! | another process's (`ForeignCell` (`foreign_event.rs`)) | the record its handle was exported after (or a later one made here through it) | the shared cell: untrusted input, checked at every look (`foreign_event.rs`) |
//!
//! Sleepers use a shared (not private) futex on `wake`, which works across processes on a
//! `MAP_SHARED` file; they wake at least every 50 ms to re-check. A foreign wait ends — with a
//! typed error, not a hang — when the producer exits, when the cell turns implausible, or at its
//! deadline (`foreign_event.rs` states the policy).

use std::time::Duration;

use rustix::thread::futex;

use crate::error::{Error, Result};
use crate::shm::SharedMemory;
use crate::sync::os::atomic::{AtomicU32, AtomicU64, Ordering};
use crate::sync::os::Arc;

/// Cells per chunk file.
pub(crate) const CELLS_PER_CHUNK: u32 = 1024;
const CELL_SIZE: u64 = 64;
pub(super) const CHUNK_MAGIC: u64 = u64::from_le_bytes(*b"cdalEVTS");
pub(super) const CHUNK_VERSION: u32 = 1;
/// Bytes of one chunk file.
pub(crate) const CHUNK_BYTES: u64 = CELL_SIZE * (CELLS_PER_CHUNK as u64 + 1);

/// One event's shared state. Only atomics: any bit pattern is a valid value, so mapping another
/// process's file and viewing its bytes as cells is sound.
#[repr(C, align(64))]
pub(crate) struct EventCell {
    pub(super) recorded: AtomicU64,
    pub(super) completed: AtomicU64,
    pub(super) wake: AtomicU32,
    pub(super) waiters: AtomicU32,
}

impl EventCell {
    /// Publishes the completion of record `seq` and wakes sleepers (of any process).
    pub(super) fn publish_completion(&self, seq: u64) {
        self.completed.fetch_max(seq, Ordering::SeqCst);
        self.wake.fetch_add(1, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            futex_wake_all(&self.wake);
        }
    }
}

/// The chunk header (first 64 bytes of the file).
#[repr(C, align(64))]
pub(super) struct ChunkHeader {
    pub(super) magic: AtomicU64,
    pub(super) version: AtomicU32,
    pub(super) cells: AtomicU32,
    pub(super) owner_pid: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<EventCell>() == CELL_SIZE as usize);
const _: () = assert!(std::mem::size_of::<ChunkHeader>() == CELL_SIZE as usize);

/// This process's own copy of one of its cells' counters. Another process that opened the chunk
/// (to wait on an exported event) can write anything into the shared cell; the owner's records,
/// completions, queries and waits use only this copy, so a scribbled chunk can mislead foreign
/// waiters at worst — never hang or fool the owner (`empty_cache`, teardown, COW ordering).
#[derive(Debug, Default)]
pub(crate) struct LocalCounters {
    recorded: AtomicU64,
    completed: AtomicU64,
}

/// A counted reference to one of this process's cells.
#[derive(Clone, Debug)]
pub(crate) struct CellRef {
    chunk: Arc<SharedMemory>,
    slot: u32,
    /// The chunk's local counters (authoritative for this process).
    local: Arc<Vec<LocalCounters>>,
}

pub(super) fn header(chunk: &SharedMemory) -> &ChunkHeader {
    // SAFETY: every chunk is at least CHUNK_BYTES long (checked at create/open), mmap returns
    // page-aligned memory, the header is only atomics (valid for any bytes), and the reference
    // lives no longer than the borrow of the mapping.
    unsafe { &*(chunk.as_ptr() as *const ChunkHeader) }
}

/// Cell `slot` of a chunk (`slot < CELLS_PER_CHUNK`, checked by every caller).
pub(super) fn cell_at(chunk: &SharedMemory, slot: u32) -> &EventCell {
    debug_assert!(slot < CELLS_PER_CHUNK);
    let offset = CELL_SIZE * (u64::from(slot) + 1);
    // SAFETY: slot < CELLS_PER_CHUNK, so the 64-byte cell lies inside the mapping (CHUNK_BYTES
    // long, checked at create/open), which is page aligned and borrowed for the reference's life;
    // the cell is only atomics, valid for any bytes another process may have written.
    unsafe { &*(chunk.as_ptr().add(offset as usize) as *const EventCell) }
}

impl CellRef {
    fn cell(&self) -> &EventCell {
        cell_at(&self.chunk, self.slot)
    }

    fn local(&self) -> Option<&LocalCounters> {
        self.local.get(self.slot as usize)
    }

    /// Starts a new record; returns its sequence number (the stream later calls [`Self::complete`]).
    pub(crate) fn begin_record(&self) -> u64 {
        let Some(local) = self.local() else {
            return 0;
        };
        let seq = local
            .recorded
            .fetch_add(1, Ordering::SeqCst)
            .wrapping_add(1);
        // `fetch_max`: two threads recording at once must not publish their numbers backwards.
        self.cell().recorded.fetch_max(seq, Ordering::SeqCst);
        seq
    }

    /// Marks record `seq` finished and wakes sleepers.
    pub(crate) fn complete(&self, seq: u64) {
        if let Some(local) = self.local() {
            local.completed.fetch_max(seq, Ordering::SeqCst);
        }
        self.cell().publish_completion(seq);
    }

    /// The sequence number a wait issued now must reach.
    pub(crate) fn current_target(&self) -> u64 {
        self.local()
            .map_or(0, |local| local.recorded.load(Ordering::SeqCst))
    }

    /// Whether every record up to `target` has finished.
    pub(crate) fn reached(&self, target: u64) -> bool {
        self.local()
            .is_none_or(|local| local.completed.load(Ordering::SeqCst) >= target)
    }

    /// Blocks until `target` is reached (this process's own streams complete it).
    pub(crate) fn wait_until(&self, target: u64) {
        let cell = self.cell();
        while !self.reached(target) {
            cell.waiters.fetch_add(1, Ordering::SeqCst);
            let seen = cell.wake.load(Ordering::SeqCst);
            if !self.reached(target) {
                futex_wait(&cell.wake, seen, POLL);
            }
            cell.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Longest sleep of a waiter between two looks at its cell.
pub(super) const POLL: Duration = Duration::from_millis(50);

pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = futex::Timespec {
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // Shared, not private, so it works across processes. Spurious returns, EAGAIN and timeouts
    // are fine: callers re-check their condition.
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

pub(super) fn futex_wake_all(word: &AtomicU32) {
    // The count woken is not needed, and a valid address gives no error.
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

/// This process's chunks and their free cells.
#[derive(Debug, Default)]
pub(crate) struct EventPool {
    chunks: Vec<(Arc<SharedMemory>, Arc<Vec<LocalCounters>>)>,
    free: Vec<(u32, u32)>,
}

impl EventPool {
    /// Takes a free cell, creating a chunk named by `name_of(chunk_index)` when none is free.
    /// Returns the cell and its (chunk, slot) address.
    ///
    /// A destroyed event's cell is reused only once its last record has completed (CUDA lets a
    /// record finish after `cuEventDestroy`): a new event must start complete, and resetting the
    /// counters of a cell with a record in flight would complete that record early for everyone
    /// still waiting on it.
    pub(crate) fn take(
        &mut self,
        name_of: impl FnOnce(u32) -> String,
    ) -> Result<(CellRef, u32, u32)> {
        let ready = self.free.iter().rposition(|&(chunk, slot)| {
            self.chunks[chunk as usize]
                .1
                .get(slot as usize)
                .is_some_and(|l| {
                    l.completed.load(Ordering::SeqCst) >= l.recorded.load(Ordering::SeqCst)
                })
        });
        let (chunk, slot) = match ready {
            Some(at) => self.free.swap_remove(at),
            None => {
                let index = u32::try_from(self.chunks.len())
                    .map_err(|_| Error::invalid("too many event chunks"))?;
                let chunk = SharedMemory::create(&name_of(index), CHUNK_BYTES)?;
                let h = header(&chunk);
                h.magic.store(CHUNK_MAGIC, Ordering::SeqCst);
                h.version.store(CHUNK_VERSION, Ordering::SeqCst);
                h.cells.store(CELLS_PER_CHUNK, Ordering::SeqCst);
                h.owner_pid.store(std::process::id(), Ordering::SeqCst);
                let locals = (0..CELLS_PER_CHUNK)
                    .map(|_| LocalCounters::default())
                    .collect();
                self.chunks.push((Arc::new(chunk), Arc::new(locals)));
                self.free
                    .extend((1..CELLS_PER_CHUNK).rev().map(|slot| (index, slot)));
                (index, 0)
            }
        };
        let (shm, locals) = &self.chunks[chunk as usize];
        let cell = CellRef {
            chunk: Arc::clone(shm),
            slot,
            local: Arc::clone(locals),
        };
        Ok((cell, chunk, slot))
    }

    /// Returns a cell to the free list.
    pub(crate) fn give_back(&mut self, chunk: u32, slot: u32) {
        self.free.push((chunk, slot));
    }
}
