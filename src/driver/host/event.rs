//! Host-backend events: cells of atomics in shared-memory files, so another process can map the
//! same cell and wait on it.
//!
//! Each process keeps a pool of *chunk* files (`cudalloc-<pid>-<nonce>-evt<n>`), each a 64-byte
//! header plus [`CELLS_PER_CHUNK`] 64-byte cells. A cell holds:
//!
//! | field       | written by                    | meaning                                        |
//! |-------------|-------------------------------|------------------------------------------------|
//! | `recorded`  | `event_record` (at call time) | sequence number of the latest record           |
//! | `completed` | the stream, when it reaches the record | highest finished record (`fetch_max`) |
//! | `wake`      | every completion              | futex word: bumped so sleepers re-check        |
//! | `waiters`   | sleepers                      | completions only issue `FUTEX_WAKE` when > 0   |
//!
//! The event is complete when `completed >= recorded`. A wait captures the target `recorded` at call
//! time, exactly like `cuStreamWaitEvent`: a later re-record does not change what an earlier wait
//! waits for. Sleepers use a shared (not private) futex on `wake`, which works across processes on a
//! `MAP_SHARED` file; they wake every 50 ms to re-check, and when the cell belongs to another process
//! that has died, the wait ends with a warning instead of hanging forever.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::shm::SharedMemory;
use crate::sync::os::atomic::{AtomicU32, AtomicU64, Ordering};
use crate::sync::os::Arc;

/// Cells per chunk file.
pub(crate) const CELLS_PER_CHUNK: u32 = 1024;
const CELL_SIZE: u64 = 64;
const CHUNK_MAGIC: u64 = u64::from_le_bytes(*b"cdalEVTS");
const CHUNK_VERSION: u32 = 1;
/// Bytes of one chunk file.
pub(crate) const CHUNK_BYTES: u64 = CELL_SIZE * (CELLS_PER_CHUNK as u64 + 1);

/// One event's shared state. Only atomics: any bit pattern is a valid value, so mapping another
/// process's file and viewing its bytes as cells is sound.
#[repr(C, align(64))]
pub(crate) struct EventCell {
    recorded: AtomicU64,
    completed: AtomicU64,
    wake: AtomicU32,
    waiters: AtomicU32,
}

/// The chunk header (first 64 bytes of the file).
#[repr(C, align(64))]
struct ChunkHeader {
    magic: AtomicU64,
    version: AtomicU32,
    cells: AtomicU32,
    owner_pid: AtomicU32,
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

/// A counted reference to one cell of a mapped chunk.
#[derive(Clone, Debug)]
pub(crate) struct CellRef {
    chunk: Arc<SharedMemory>,
    slot: u32,
    /// Own cells: the chunk's local counters (authoritative). `None` for another process's cell.
    local: Option<Arc<Vec<LocalCounters>>>,
    /// `Some(pid)` when another process owns the chunk (checked for liveness while waiting).
    foreign_owner: Option<u32>,
}

fn header(chunk: &SharedMemory) -> &ChunkHeader {
    // SAFETY: every chunk is at least CHUNK_BYTES long (checked at create/open), mmap returns
    // page-aligned memory, the header is only atomics (valid for any bytes), and the reference
    // lives no longer than the borrow of the mapping.
    unsafe { &*(chunk.as_ptr() as *const ChunkHeader) }
}

/// Cell `slot` of a chunk (`slot < CELLS_PER_CHUNK`, checked by every caller).
fn cell_at(chunk: &SharedMemory, slot: u32) -> &EventCell {
    debug_assert!(slot < CELLS_PER_CHUNK);
    let offset = CELL_SIZE * (u64::from(slot) + 1);
    // SAFETY: slot < CELLS_PER_CHUNK, so the 64-byte cell lies inside the mapping (CHUNK_BYTES
    // long, checked at create/open), which is page aligned and borrowed for the reference's life;
    // the cell is only atomics, valid for any bytes another process may have written.
    unsafe { &*(chunk.as_ptr().add(offset as usize) as *const EventCell) }
}

/// The message of a wait or query on an event whose owner process died before completing it.
fn owner_died(pid: u32) -> String {
    format!("the process {pid} that owns this interprocess event exited before completing it (the data it guards was never made ready)")
}

impl CellRef {
    fn cell(&self) -> &EventCell {
        cell_at(&self.chunk, self.slot)
    }

    fn local(&self) -> Option<&LocalCounters> {
        self.local
            .as_ref()
            .and_then(|counters| counters.get(self.slot as usize))
    }

    /// Starts a new record; returns its sequence number (the stream later calls [`Self::complete`]).
    pub(crate) fn begin_record(&self) -> u64 {
        match self.local() {
            Some(local) => {
                let seq = local
                    .recorded
                    .fetch_add(1, Ordering::SeqCst)
                    .wrapping_add(1);
                self.cell().recorded.store(seq, Ordering::SeqCst);
                seq
            }
            None => self
                .cell()
                .recorded
                .fetch_add(1, Ordering::SeqCst)
                .wrapping_add(1),
        }
    }

    /// Marks record `seq` finished and wakes sleepers.
    pub(crate) fn complete(&self, seq: u64) {
        if let Some(local) = self.local() {
            local.completed.fetch_max(seq, Ordering::SeqCst);
        }
        let cell = self.cell();
        cell.completed.fetch_max(seq, Ordering::SeqCst);
        cell.wake.fetch_add(1, Ordering::SeqCst);
        if cell.waiters.load(Ordering::SeqCst) > 0 {
            futex_wake_all(&cell.wake);
        }
    }

    /// The sequence number a wait issued now must reach.
    pub(crate) fn current_target(&self) -> u64 {
        match self.local() {
            Some(local) => local.recorded.load(Ordering::SeqCst),
            None => self.cell().recorded.load(Ordering::SeqCst),
        }
    }

    /// Whether every record up to `target` has finished.
    pub(crate) fn reached(&self, target: u64) -> bool {
        let completed = match self.local() {
            Some(local) => local.completed.load(Ordering::SeqCst),
            None => self.cell().completed.load(Ordering::SeqCst),
        };
        completed >= target
    }

    /// Whether the latest record has finished; an error when the event belongs to another process
    /// that died before finishing it.
    pub(crate) fn is_complete(&self) -> std::result::Result<bool, String> {
        if self.reached(self.current_target()) {
            return Ok(true);
        }
        self.check_owner_alive().map(|()| false)
    }

    fn check_owner_alive(&self) -> std::result::Result<(), String> {
        match self.foreign_owner {
            Some(pid) if !self.chunk.creator_alive() => Err(owner_died(pid)),
            _ => Ok(()),
        }
    }

    /// Blocks until `target` is reached; an error when the foreign owner died first.
    pub(crate) fn wait_until(&self, target: u64) -> std::result::Result<(), String> {
        let cell = self.cell();
        while !self.reached(target) {
            cell.waiters.fetch_add(1, Ordering::SeqCst);
            let seen = cell.wake.load(Ordering::SeqCst);
            if !self.reached(target) {
                futex_wait(&cell.wake, seen, Duration::from_millis(50));
            }
            cell.waiters.fetch_sub(1, Ordering::SeqCst);
            if !self.reached(target) {
                self.check_owner_alive()?;
            }
        }
        Ok(())
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: `word` is a live, 4-byte aligned atomic (in shared memory or the heap); FUTEX_WAIT
    // (shared, not private, so it works across processes) only reads it and sleeps; `ts` outlives
    // the call. Spurious returns and EAGAIN are fine: callers re-check their condition.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; it does not access memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
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
            local: Some(Arc::clone(locals)),
            foreign_owner: None,
        };
        Ok((cell, chunk, slot))
    }

    /// Returns a cell to the free list.
    pub(crate) fn give_back(&mut self, chunk: u32, slot: u32) {
        self.free.push((chunk, slot));
    }
}

/// Maps another process's chunk (`name`, from a decoded handle) and refers to `slot` in it.
pub(crate) fn open_foreign_cell(
    chunk: Arc<SharedMemory>,
    slot: u32,
    owner_pid: u32,
) -> Result<CellRef> {
    let h = header(&chunk);
    let (magic, version, cells, pid) = (
        h.magic.load(Ordering::SeqCst),
        h.version.load(Ordering::SeqCst),
        h.cells.load(Ordering::SeqCst),
        h.owner_pid.load(Ordering::SeqCst),
    );
    if magic != CHUNK_MAGIC
        || version != CHUNK_VERSION
        || cells != CELLS_PER_CHUNK
        || pid != owner_pid
    {
        return Err(Error::bad_handle(format!(
            "event chunk {} has a foreign header (magic {magic:#x}, version {version}, cells {cells}, pid {pid})",
            chunk.name()
        )));
    }
    if slot >= CELLS_PER_CHUNK {
        return Err(Error::bad_handle(format!(
            "event slot {slot} out of range 0..{CELLS_PER_CHUNK}"
        )));
    }
    Ok(CellRef {
        chunk,
        slot,
        local: None,
        foreign_owner: Some(owner_pid),
    })
}
