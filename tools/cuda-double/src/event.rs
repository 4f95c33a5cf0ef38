//! Events: a cell of two counters, in process memory or — for `CU_EVENT_INTERPROCESS` events — in
//! a region another process can open.
//!
//! | cell field     | written by                                   | meaning                    |
//! |----------------|----------------------------------------------|----------------------------|
//! | `recorded`     | `cuEventRecord` (any process holding it)     | number of the latest record |
//! | `completed`    | the recording stream's worker (`fetch_max`)  | highest record reached     |
//! | `recorder_pid` | `cuEventRecord`                              | who must complete it       |
//!
//! Only the most recent record counts (CUDA's semantics): an event is complete when
//! `completed >= recorded`, and a never-recorded event is complete. `cuStreamWaitEvent` and
//! `cuEventSynchronize` capture `recorded` when called and wait for `completed` to reach it.
//!
//! Waits poll with backoff (there is no cross-process condition variable); that is the double
//! emulating a device, not a test synchronizing. If the process that recorded the event has died,
//! its work will never run again, so the record counts as complete — the double's model of a
//! context torn down with its process (CUDA documents nothing here). Values read from a shared
//! cell are untrusted: they only decide when a wait ends, never an index or a size.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::region::{process_alive, Region};

/// The counters of an event (see the module docs).
#[repr(C)]
#[derive(Debug, Default)]
pub struct Cell {
    recorded: AtomicU64,
    completed: AtomicU64,
    recorder_pid: AtomicU32,
}

/// Where an event's cell lives.
#[derive(Debug)]
pub enum CellStore {
    /// In this process.
    Local(Box<Cell>),
    /// In a region (interprocess events); the cell follows the header.
    Shared(Region),
}

/// Offset of the cell in an interprocess event's header page.
const CELL_OFFSET: usize = 256;

/// An event.
#[derive(Debug)]
pub struct Event {
    /// Its handle.
    pub handle: usize,
    /// Its context's handle.
    pub ctx: usize,
    /// Its device.
    pub device: usize,
    /// Its context's epoch when it was made.
    pub epoch: u64,
    /// `CU_EVENT_*` flags it was created with (opened events: interprocess | disable timing).
    pub flags: u32,
    /// Whether it was opened from another process's handle.
    pub imported: bool,
    /// Its cell.
    pub store: CellStore,
}

impl Event {
    /// The event's cell.
    pub fn cell(&self) -> &Cell {
        match &self.store {
            CellStore::Local(cell) => cell,
            // SAFETY: an interprocess event's region has a page-aligned header page of 4096
            // bytes; the cell (24 bytes, 8-aligned) sits at CELL_OFFSET inside it, zeroed at
            // creation and only accessed through atomics; the region lives as long as `self`.
            CellStore::Shared(region) => unsafe {
                &*region.header_page().add(CELL_OFFSET).cast::<Cell>()
            },
        }
    }
}

impl Cell {
    /// Starts a record; returns its number for the worker to complete.
    pub fn record(&self) -> u64 {
        self.recorder_pid
            .store(std::process::id(), Ordering::Release);
        self.recorded.fetch_add(1, Ordering::AcqRel).wrapping_add(1)
    }

    /// The worker reached record `n`.
    pub fn complete(&self, n: u64) {
        self.completed.fetch_max(n, Ordering::AcqRel);
    }

    /// The record a wait must reach now.
    pub fn target(&self) -> u64 {
        self.recorded.load(Ordering::Acquire)
    }

    /// Whether record `target` has been reached (or can never be, its recorder being dead).
    pub fn reached(&self, target: u64) -> bool {
        if self.completed.load(Ordering::Acquire) >= target {
            return true;
        }
        let recorder = self.recorder_pid.load(Ordering::Acquire);
        recorder != std::process::id() && !process_alive(recorder)
    }

    /// Waits until record `target` is reached.
    pub fn wait(&self, target: u64) {
        let mut pause = Duration::from_micros(2);
        let mut polls = 0u32;
        while !self.reached(target) {
            if polls < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_micros(500));
            }
            polls = polls.saturating_add(1);
        }
    }
}
