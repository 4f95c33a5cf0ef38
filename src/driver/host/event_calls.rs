//! The host driver's event calls (`Driver::event_*`, `stream_wait_event`, `ipc_*_event`): which
//! cell an event has, and which policy each call applies to it.
//!
//! | call                 | this process's event ([`CellRef`](super::event::CellRef)) | another process's ([`ForeignCell`]) |
//! |----------------------|----------------------------------|-----------------------------------------------|
//! | `event_record`       | a new record, completed by the stream (control work: it runs behind a fault too) | the same, on the shared cell |
//! | `event_query`        | local counters                   | one checked look; an exited producer or an implausible cell is an error |
//! | `event_synchronize`  | waits on local counters          | a checked wait with the deadline               |
//! | `stream_wait_event`  | control work on the stream        | a checked look now, then a checked wait with the deadline; its failure is a fault of the stream (`stream.rs`) |
//! | `ipc_export_event`   | the handle names the cell and its latest record | refused (export from the owner)     |
//! | `ipc_open_event`     | refused (use the event)          | maps the chunk (once per process), checks its header |

use super::event::CellRef;
use super::foreign_event::ForeignCell;
use super::handle::{self, HandleKind, HostHandle};
use super::HostDriver;
use crate::driver::{EventFlags, EventId, IpcEventHandle, StreamId};
use crate::error::{Error, Result};
use crate::shm::SharedMemory;
use crate::sync::os::{Arc, Weak};

/// An event's cell: this process's own, or another process's (opened from a handle).
#[derive(Clone, Debug)]
pub(crate) enum HostCell {
    Own(CellRef),
    Foreign(ForeignCell),
}

impl HostCell {
    /// Starts a new record; returns its sequence number for [`Self::complete`].
    pub(crate) fn begin_record(&self) -> u64 {
        match self {
            HostCell::Own(cell) => cell.begin_record(),
            HostCell::Foreign(cell) => cell.begin_record(),
        }
    }

    /// Marks record `seq` finished and wakes sleepers.
    pub(crate) fn complete(&self, seq: u64) {
        match self {
            HostCell::Own(cell) => cell.complete(seq),
            HostCell::Foreign(cell) => cell.complete(seq),
        }
    }
}

/// One event of the driver: a cell of this process's pool, or of another process's chunk.
#[derive(Debug)]
pub(super) struct HostEvent {
    device: usize,
    interprocess: bool,
    cell: HostCell,
    /// (chunk, slot) when this process owns the cell; `None` for events opened from a handle.
    owned_slot: Option<(u32, u32)>,
}

impl HostDriver {
    pub(super) fn host_event_create(&self, device: usize, flags: EventFlags) -> Result<EventId> {
        self.this_process()?;
        self.check_device(device)?;
        let (pid, nonce) = (self.pid, self.nonce);
        let (cell, chunk, slot) = self
            .event_pool
            .lock()
            .take(|index| handle::object_name(HandleKind::Event, pid, nonce, u64::from(index)))?;
        let id = self.fresh_id();
        let event = HostEvent {
            device,
            interprocess: flags.interprocess,
            cell: HostCell::Own(cell),
            owned_slot: Some((chunk, slot)),
        };
        self.events.insert(id, Arc::new(event));
        Ok(EventId(id))
    }

    pub(super) fn host_event_destroy(&self, event: EventId) -> Result<()> {
        self.this_process()?;
        let e = self.events.remove(event.0)?;
        self.captures.forget_point(event);
        if let Some((chunk, slot)) = e.owned_slot {
            self.event_pool.lock().give_back(chunk, slot);
        }
        Ok(())
    }

    pub(super) fn host_event_record(&self, event: EventId, stream: StreamId) -> Result<()> {
        self.this_process()?;
        let e = self.event(event)?;
        let s = self.stream(stream)?;
        if e.device != s.device() {
            return Err(Error::invalid(format!(
                "event {} is on device {} but stream {} is on device {}",
                event.0,
                e.device,
                stream.0,
                s.device()
            )));
        }
        if let Some(point) = self.captures.record_point(event, stream) {
            // A point of the capture: nothing is recorded now (`capture.rs`).
            return point;
        }
        let seq = e.cell.begin_record();
        let cell = e.cell.clone();
        // Control work: it runs (and completes the event) even behind a failed foreign wait; on
        // an idle stream at once.
        if let Err(err) = s.control_now_or_enqueue(Box::new(move || cell.complete(seq))) {
            e.cell.complete(seq);
            return Err(err);
        }
        Ok(())
    }

    pub(super) fn host_event_query(&self, event: EventId) -> Result<bool> {
        self.this_process()?;
        let e = self.event(event)?;
        self.captures.check_event(event, "event_query")?;
        match &e.cell {
            HostCell::Own(cell) => Ok(cell.reached(cell.current_target())),
            HostCell::Foreign(cell) => cell.check(cell.target()),
        }
    }

    pub(super) fn host_event_synchronize(&self, event: EventId) -> Result<()> {
        self.this_process()?;
        let e = self.event(event)?;
        self.captures.check_event(event, "event_synchronize")?;
        match &e.cell {
            HostCell::Own(cell) => {
                cell.wait_until(cell.current_target());
                Ok(())
            }
            HostCell::Foreign(cell) => {
                cell.wait(cell.target(), self.config.ipc_event_timeout, None)
            }
        }
    }

    pub(super) fn host_stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()> {
        self.this_process()?;
        let e = self.event(event)?;
        let s = self.stream(stream)?;
        if let Some(joined) = self.captures.wait(stream, event) {
            // A fork, a join or an ordering inside a capture (`capture.rs`).
            return joined;
        }
        match &e.cell {
            HostCell::Own(cell) => {
                let target = cell.current_target();
                if cell.reached(target) {
                    return Ok(());
                }
                let cell = cell.clone();
                s.enqueue_control(Box::new(move || cell.wait_until(target)))
                    .map(|_| ())
            }
            HostCell::Foreign(cell) => {
                // A look now: complete is nothing to wait for; an exited producer or an
                // implausible cell is this call's error. In flight: a bounded, checked wait whose
                // failure fails it and the work queued behind it, not the stream.
                let target = cell.target();
                if cell.check(target)? {
                    return Ok(());
                }
                let (cell, deadline, id) = (cell.clone(), self.config.ipc_event_timeout, s.id());
                s.enqueue_foreign_wait(Box::new(move || cell.wait(target, deadline, Some(id))))
                    .map(|_| ())
            }
        }
    }

    pub(super) fn host_ipc_export_event(&self, event: EventId) -> Result<IpcEventHandle> {
        self.this_process()?;
        let e = self.event(event)?;
        let (chunk, slot) = match (e.interprocess, e.owned_slot) {
            (true, Some(addr)) => addr,
            (false, _) => {
                return Err(Error::invalid(format!(
                    "event {} was not created with the interprocess flag",
                    event.0
                )))
            }
            (true, None) => {
                return Err(Error::invalid(
                    "an event opened from a handle cannot be re-exported",
                ))
            }
        };
        let record = match &e.cell {
            HostCell::Own(cell) => cell.current_target(),
            HostCell::Foreign(_) => {
                return Err(Error::invalid(
                    "an event opened from a handle cannot be re-exported",
                ))
            }
        };
        let device =
            u16::try_from(e.device).map_err(|_| Error::invalid("device ordinal too large"))?;
        let h = HostHandle {
            kind: HandleKind::Event,
            device,
            pid: self.pid,
            nonce: self.nonce,
            object: u64::from(chunk),
            extra: u64::from(slot),
            record,
        };
        Ok(IpcEventHandle(h.encode()))
    }

    pub(super) fn host_ipc_open_event(
        &self,
        device: usize,
        handle: &IpcEventHandle,
    ) -> Result<EventId> {
        self.this_process()?;
        self.check_device(device)?;
        let h = HostHandle::decode(HandleKind::Event, &handle.0)?;
        if h.pid == self.pid {
            return Err(Error::invalid(
                "an IPC event handle cannot be opened in the process that exported it; use the original event",
            ));
        }
        let slot =
            u32::try_from(h.extra).map_err(|_| Error::bad_handle("event slot out of range"))?;
        let name = h.object_name();
        let chunk = {
            let mut chunks = self.foreign_chunks.lock();
            chunks.retain(|_, weak| weak.strong_count() > 0);
            match chunks.get(&name).and_then(Weak::upgrade) {
                Some(chunk) => chunk,
                None => {
                    let chunk =
                        Arc::new(SharedMemory::open(&name, Some(super::event::CHUNK_BYTES))?);
                    chunks.insert(name, Arc::downgrade(&chunk));
                    chunk
                }
            }
        };
        let cell = ForeignCell::open(chunk, slot, h.pid, h.record)?;
        let id = self.fresh_id();
        let e = HostEvent {
            device,
            interprocess: true,
            cell: HostCell::Foreign(cell),
            owned_slot: None,
        };
        self.events.insert(id, Arc::new(e));
        Ok(EventId(id))
    }
}
