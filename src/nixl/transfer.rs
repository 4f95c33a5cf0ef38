//! [`Transfer`]: one posted NIXL transfer, and how it is an access the stream sanitizer sees.
//!
//! NIXL knows nothing of streams: it reads and writes the bytes when it is posted, from its own
//! threads. So a transfer is ordered by the host, as CUDA code does around NIXL:
//!
//! | step | real order | what the sanitizer is told (when on) |
//! |---|---|---|
//! | post on `stream` | the host synchronizes `stream`: its work so far is done before NIXL touches the bytes | a transfer actor (a stream of the agent's, used by one transfer at a time) waits for `stream`, then accesses the local bytes (reads them for a write, writes them for a read), checked like a kernel |
//! | in flight | NIXL moves the bytes | other streams touching those bytes without ordering race with the actor |
//! | [`Transfer::wait`] returns | the host saw the completion | the host knows the actor: whatever is enqueued after is ordered after the transfer |
//! | peer's transfer noticed ([`NixlAgent::received`](super::NixlAgent::received)) | the host saw the peer's notification | an actor writes the bytes; `stream` waits for it |
//!
//! A transfer keeps its local memory alive and in place (the storages, and a pin of the memory as
//! it was at the post: a storage written meanwhile moves, the pin does not), and the agent's core:
//! the registrar stays attached while any transfer lives, so nothing is deregistered under one.
//! Dropped before it completed, it waits for the end (a peer that died fails it within
//! milliseconds); if NIXL still reports it in flight after [`DROP_DEADLINE`], its memory and the
//! registrations are leaked rather than freed under a transfer.

use std::time::{Duration, Instant};

use nixl_sys::{XferRequest, XferStatus};

use super::core::Core;
use crate::driver::sanitizer::Touch;
use crate::driver::{Sanitizer, StreamId};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::storage::Storage;
use crate::sync::os::{Arc, Mutex};

/// How long a dropped, unfinished transfer is waited for before its storages are leaked.
pub const DROP_DEADLINE: Duration = Duration::from_secs(30);

/// The sanitizer's side of an agent: its transfer actors (streams used by one transfer at a time).
#[derive(Debug)]
pub(crate) struct Actors {
    /// The process the actors' streams belong to: a forked child's copy destroys none.
    pub birth: Birth,
    pub sanitizer: Arc<Sanitizer>,
    pub driver: Arc<dyn crate::driver::Driver>,
    pub free: Mutex<Vec<StreamId>>,
    pub all: Mutex<Vec<StreamId>>,
}

impl Actors {
    pub(crate) fn take(&self, device: usize) -> Result<StreamId> {
        let reuse = {
            let mut free = self.free.lock();
            let at = free.iter().position(|s| s.device() == device);
            at.map(|at| free.swap_remove(at))
        };
        if let Some(actor) = reuse {
            return Ok(actor);
        }
        let actor = self.driver.stream_create(device)?;
        self.all.lock().push(actor);
        Ok(actor)
    }

    /// The host saw `actor`'s transfer complete; the actor is free again.
    pub(crate) fn finish(&self, actor: StreamId) {
        self.sanitizer.host_synchronized(actor);
        self.free.lock().push(actor);
    }

    /// `actor` found a hazard: its stream is failed (sticky), so it never serves again (it is
    /// destroyed with the agent).
    pub(crate) fn discard(&self, actor: StreamId) {
        tracing::debug!(
            ?actor,
            "a transfer actor failed by the sanitizer is retired"
        );
    }
}

impl Drop for Actors {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            // A forked child's copy: the streams are the parent's, and the lists' locks may
            // have been held by a parent thread at the fork.
            return;
        }
        for actor in self.all.lock().drain(..) {
            if let Err(err) = self.driver.stream_destroy(actor) {
                tracing::debug!(%err, ?actor, "destroying a transfer actor's stream at teardown failed");
            }
        }
    }
}

/// One posted transfer (see the module docs). Not `Send`: NIXL's request handle stays with the
/// thread that made it.
pub struct Transfer {
    pub(crate) core: Arc<Core>,
    pub(crate) request: Option<XferRequest>,
    pub(crate) local: Vec<Storage>,
    /// Second holders of the local memory as it was at the post (`Storage::pin_memory`).
    pub(crate) pins: Vec<Storage>,
    pub(crate) actor: Option<(Arc<Actors>, StreamId)>,
    pub(crate) peer: String,
    pub(crate) what: &'static str,
    pub(crate) bytes: u64,
    pub(crate) done: bool,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("what", &self.what)
            .field("peer", &self.peer)
            .field("bytes", &self.bytes)
            .field("done", &self.done)
            .finish()
    }
}

impl Transfer {
    /// Bytes moved by this transfer.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the transfer completed (without blocking). An error if NIXL failed it (a peer
    /// that died, a connection lost): the bytes are then undefined.
    pub fn poll(&mut self) -> Result<bool> {
        if self.done {
            return Ok(true);
        }
        self.core.alive()?;
        let Some(request) = &self.request else {
            return Ok(true);
        };
        match self.core.agent.get_xfer_status(request) {
            Ok(XferStatus::Success) => {
                self.complete();
                Ok(true)
            }
            Ok(XferStatus::InProgress) => Ok(false),
            Err(err) => {
                self.complete();
                Err(Error::transfer(format!(
                    "{} of {} bytes with {} failed: {err}",
                    self.what, self.bytes, self.peer
                )))
            }
        }
    }

    /// Waits until the transfer completed, at most `timeout` (then a [`Error::Transfer`] says so
    /// and the transfer stays in flight: wait again or drop it).
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        while !self.poll()? {
            if Instant::now() >= deadline {
                return Err(Error::transfer(format!(
                    "{} of {} bytes with {} still in flight after {timeout:?}",
                    self.what, self.bytes, self.peer
                )));
            }
            backoff(&mut spins);
        }
        Ok(())
    }

    /// The transfer ended (or never started): its actor is free, its peer may be reloaded.
    pub(crate) fn complete(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        if let Some((actors, actor)) = self.actor.take() {
            actors.finish(actor);
        }
        self.core.peers.end(&self.peer);
    }
}

/// Polling NIXL: spin briefly, then yield, then sleep a little longer each time (at most 1 ms).
pub(crate) fn backoff(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    match *spins {
        0..=64 => std::hint::spin_loop(),
        65..=128 => std::thread::yield_now(),
        n => std::thread::sleep(Duration::from_micros(u64::from((n - 128).min(1000)))),
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if self.done || self.request.is_none() {
            return;
        }
        if self.core.alive().is_err() {
            // A forked child's copy: the parent's NIXL runs the transfer; nothing here may touch
            // the request or the actor (the storages free nothing in a child).
            std::mem::forget(self.request.take());
            std::mem::forget(self.actor.take());
            return;
        }
        match self.wait(DROP_DEADLINE) {
            Ok(()) => {}
            Err(err) if self.done => {
                tracing::warn!(%err, "a dropped transfer failed");
            }
            Err(err) => {
                tracing::error!(%err, "a dropped transfer is still in flight: its memory and registrations are leaked, never freed under it");
                for storage in self.local.drain(..).chain(self.pins.drain(..)) {
                    std::mem::forget(storage);
                }
                // The registrations too: the agent's core never goes, so nothing is deregistered.
                std::mem::forget(Arc::clone(&self.core));
                // The request too: releasing it would tell NIXL to drop a transfer it still runs.
                if let Some(request) = self.request.take() {
                    std::mem::forget(request);
                }
            }
        }
    }
}

/// The sanitizer's touches of a transfer's local ranges.
pub(crate) fn touches(ranges: &[(u64, u64)], writes_local: bool) -> Vec<Touch> {
    ranges
        .iter()
        .map(|&(addr, len)| {
            if writes_local {
                Touch::write(addr, len)
            } else {
                Touch::read(addr, len)
            }
        })
        .collect()
}
