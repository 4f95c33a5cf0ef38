//! Another process's event cell is untrusted input: the policy of a wait on it.
//!
//! An event opened from a handle ([`ForeignCell`]) lives in its producer's chunk file, which any
//! process of the same user can open and write. The producer itself never trusts that memory (its
//! own counters are private, `event.rs`); a consumer has nothing else to read, so every look at
//! the cell is checked, and every wait is bounded:
//!
//! * **The target comes from the handle**: the producer's driver writes the sequence number of the
//!   record it exported after into the event handle (`handle.rs`), and a consumer waits for that
//!   record (or a later one it made itself through the opened event) — never for the shared
//!   `recorded` field, so a scribbled `recorded` cannot move what a wait waits for.
//! * **Each look is checked for plausibility**: `completed` is read before `recorded`, so an
//!   honest cell (both only grow) shows `completed <= recorded` and `recorded >= target`.
//! * **Each wait has a deadline** ([`HostDriverBuilder::ipc_event_timeout`](super::HostDriverBuilder::ipc_event_timeout),
//!   `CUDALLOC_IPC_EVENT_TIMEOUT_S`, default 60 s), counted from when the wait starts.
//!
//! | what a look (or the wait) finds                         | verdict                     |
//! |---------------------------------------------------------|-----------------------------|
//! | `completed` below what this wait saw before             | `Implausible` (went back)   |
//! | `recorded < target`                                      | `Implausible` (rewound)     |
//! | `completed > recorded`                                   | `Implausible` (no record reached it) |
//! | `completed >= target`                                    | complete                    |
//! | `target - completed` > 2³² (no stream has that many records in flight) | `Implausible` |
//! | otherwise, and the producer has exited (its chunk's creator lock is free) | `ProducerExited` |
//! | otherwise, past the deadline                             | `Timeout`                   |
//! | otherwise                                                | in flight: sleep ≤ 50 ms on the futex, look again |
//!
//! Each verdict but "complete" and "in flight" is an [`Error::ForeignEvent`] naming the producer's
//! pid, the chunk, the slot and what the cell said. `stream_wait_event` looks once when it is
//! called (a verdict then is its error, and nothing is enqueued); the queued wait keeps looking,
//! and its error is a *fault* of the stream (`stream.rs`): the wait and the work queued behind it
//! fail (and the first blocking call after it reports it), the stream does not. Without a
//! deadline (`ipc_event_timeout(None)`, `CUDALLOC_IPC_EVENT_TIMEOUT_S=0`) a cell scribbled to look
//! in flight holds the stream until its producer exits. What no check can catch: a third party
//! that writes a `completed` and a `recorded` both past the target makes the wait end early — but
//! a process that can write the event cell can write the memory it guards just as well.

use std::time::{Duration, Instant};

use super::event::{
    cell_at, futex_wait, header, EventCell, CELLS_PER_CHUNK, CHUNK_MAGIC, CHUNK_VERSION, POLL,
};
use crate::error::{Error, ForeignEventFailure, Result};
use crate::shm::SharedMemory;
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::Arc;

/// More records in flight on one event than any stream can hold: a target this far ahead of
/// `completed` is a lie.
const MAX_IN_FLIGHT: u64 = 1 << 32;

/// A counted reference to one cell of another process's chunk.
#[derive(Clone, Debug)]
pub(crate) struct ForeignCell {
    chunk: Arc<SharedMemory>,
    slot: u32,
    /// The producer (named in errors; its liveness is the chunk's creator lock).
    pid: u32,
    /// The latest record this process knows of: the handle's, or a later one made here.
    target: Arc<AtomicU64>,
}

/// What one look at a foreign cell says about a wait for a target.
#[derive(Debug, PartialEq, Eq)]
enum Look {
    Complete,
    InFlight,
    Implausible(String),
}

/// The verdict on one look: `completed` and then `recorded` as read, `seen` the `completed` this
/// wait saw last (if any).
fn judge(target: u64, completed: u64, recorded: u64, seen: Option<u64>) -> Look {
    if let Some(seen) = seen.filter(|&seen| completed < seen) {
        return Look::Implausible(format!(
            "its completed count went back from {seen} to {completed}"
        ));
    }
    if recorded < target {
        return Look::Implausible(format!(
            "its recorded count {recorded} is below record {target}, which its producer made before exporting it"
        ));
    }
    if completed > recorded {
        return Look::Implausible(format!(
            "its completed count {completed} is past its recorded count {recorded}"
        ));
    }
    if completed >= target {
        return Look::Complete;
    }
    if target - completed > MAX_IN_FLIGHT {
        return Look::Implausible(format!(
            "record {target} is {} records ahead of its completed count {completed}",
            target - completed
        ));
    }
    Look::InFlight
}

impl ForeignCell {
    /// Maps cell `slot` of another process's chunk (`chunk`, named from a decoded handle of
    /// `owner_pid`) whose handle was exported after record `record`. Checks the chunk's header.
    pub(crate) fn open(
        chunk: Arc<SharedMemory>,
        slot: u32,
        owner_pid: u32,
        record: u64,
    ) -> Result<Self> {
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
        Ok(ForeignCell {
            chunk,
            slot,
            pid: owner_pid,
            target: Arc::new(AtomicU64::new(record)),
        })
    }

    fn cell(&self) -> &EventCell {
        cell_at(&self.chunk, self.slot)
    }

    /// The error of a failed look or wait.
    fn failure(&self, failure: ForeignEventFailure, detail: String) -> Error {
        Error::ForeignEvent {
            pid: self.pid,
            chunk: self.chunk.name().to_owned(),
            failure,
            message: format!("slot {}: {detail}", self.slot),
        }
    }

    /// Starts a record made in this process through the opened event; returns its number.
    pub(crate) fn begin_record(&self) -> u64 {
        let seq = self
            .cell()
            .recorded
            .fetch_add(1, Ordering::SeqCst)
            .wrapping_add(1);
        self.target.fetch_max(seq, Ordering::SeqCst);
        seq
    }

    /// Marks record `seq` (made here) finished and wakes sleepers.
    pub(crate) fn complete(&self, seq: u64) {
        self.cell().publish_completion(seq);
    }

    /// The record a wait issued now must reach.
    pub(crate) fn target(&self) -> u64 {
        self.target.load(Ordering::SeqCst)
    }

    fn look(&self, target: u64, seen: Option<u64>) -> (Look, u64) {
        let cell = self.cell();
        let completed = cell.completed.load(Ordering::SeqCst);
        let recorded = cell.recorded.load(Ordering::SeqCst);
        (judge(target, completed, recorded, seen), completed)
    }

    /// One look for `target`: complete (`true`), in flight (`false`), or the error of an
    /// implausible cell or an exited producer.
    pub(crate) fn check(&self, target: u64) -> Result<bool> {
        match self.look(target, None).0 {
            Look::Complete => Ok(true),
            Look::Implausible(why) => Err(self.failure(ForeignEventFailure::Implausible, why)),
            Look::InFlight if self.producer_exited() => Err(self.exited_error(target, None)),
            Look::InFlight => Ok(false),
        }
    }

    /// Whether the producer is gone: the creator lock of its chunk is free (it exited — zombies
    /// included, their files are closed — or dropped the driver that owned the chunk), seen from
    /// any pid namespace and immune to pid reuse. A child the producer forked keeps that lock
    /// until it exits too (`SharedMemory::creator_alive`): the wait then ends at its deadline.
    fn producer_exited(&self) -> bool {
        !self.chunk.creator_alive()
    }

    fn exited_error(&self, target: u64, stream: Option<u64>) -> Error {
        self.failure(
            ForeignEventFailure::ProducerExited,
            format!(
                "its producer exited before completing record {target} (or dropped the driver owning the event): the data it guards was never made ready{}",
                behind(stream)
            ),
        )
    }

    /// Blocks until `target` is complete; an error when the cell turns implausible, the producer
    /// exits, or `deadline` (from now) passes first. `stream`: the stream this wait holds (named
    /// in the error).
    pub(crate) fn wait(
        &self,
        target: u64,
        deadline: Option<Duration>,
        stream: Option<u64>,
    ) -> Result<()> {
        let started = Instant::now();
        let cell = self.cell();
        let mut seen = None;
        loop {
            let (look, completed) = self.look(target, seen);
            match look {
                Look::Complete => return Ok(()),
                Look::Implausible(why) => {
                    return Err(self.failure(
                        ForeignEventFailure::Implausible,
                        format!("{why}{}", behind(stream)),
                    ))
                }
                Look::InFlight => {}
            }
            seen = Some(completed);
            if self.producer_exited() {
                return Err(self.exited_error(target, stream));
            }
            let left = match deadline {
                Some(limit) => match limit.checked_sub(started.elapsed()) {
                    Some(left) if !left.is_zero() => left,
                    _ => {
                        return Err(self.failure(
                            ForeignEventFailure::Timeout,
                            format!(
                                "record {target} was not completed within {limit:?} (completed count {completed}; the deadline is CUDALLOC_IPC_EVENT_TIMEOUT_S){}",
                                behind(stream)
                            ),
                        ))
                    }
                },
                None => POLL,
            };
            // Wrapping counts: a scribbled `waiters` only costs the producer spurious wakes.
            cell.waiters.fetch_add(1, Ordering::SeqCst);
            let wake = cell.wake.load(Ordering::SeqCst);
            if self.look(target, seen).0 == Look::InFlight {
                futex_wait(&cell.wake, wake, left.min(POLL));
            }
            cell.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// What a failed wait of `stream` means for the work behind it.
fn behind(stream: Option<u64>) -> String {
    match stream {
        Some(id) => format!("; the work queued behind this wait on stream {id} did not run"),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn honest_cells_are_in_flight_or_complete() {
        assert_eq!(judge(3, 2, 3, None), Look::InFlight);
        assert_eq!(judge(3, 2, 5, Some(1)), Look::InFlight);
        assert_eq!(judge(3, 3, 3, Some(2)), Look::Complete);
        assert_eq!(judge(3, 4, 9, None), Look::Complete);
        assert_eq!(judge(0, 0, 0, None), Look::Complete, "never recorded");
    }

    #[test]
    fn scribbled_cells_are_implausible() {
        let implausible = |look: Look| matches!(look, Look::Implausible(_));
        assert!(implausible(judge(3, 1, 3, Some(2))), "completed went back");
        assert!(
            implausible(judge(3, 0, 2, None)),
            "recorded below the target"
        );
        assert!(
            implausible(judge(3, 1 << 40, 3, None)),
            "completed past recorded"
        );
        assert!(
            implausible(judge(u64::MAX, 0, u64::MAX, None)),
            "target far ahead"
        );
        assert!(
            !implausible(judge(3, 0, u64::MAX, None)),
            "a huge recorded is harmless"
        );
    }
}
