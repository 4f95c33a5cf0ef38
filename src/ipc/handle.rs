//! [`IpcHandle`]: a handle of a shared storage that owns one count on its slot.

use super::consumer::{self, Claim, SlotTicket};
use super::refcount::{RefCounterFile, Refused};
use super::wire::WireHandle;
use crate::error::Result;
use crate::sync::os::Arc;

/// A handle of a shared storage that owns one count on its slot (see `src/ipc/mod.rs`).
#[derive(Debug)]
pub struct IpcHandle {
    wire: WireHandle,
    claim: Option<Claim>,
}

/// The count a handle's claim owns.
fn ticket_of(wire: &WireHandle) -> SlotTicket {
    SlotTicket {
        slot: wire.slot,
        generation: wire.generation,
        expires_ms: wire.expires_ms,
    }
}

impl IpcHandle {
    /// A handle that owns no count (an empty storage's).
    pub(crate) fn unclaimed(wire: WireHandle) -> Self {
        IpcHandle { wire, claim: None }
    }

    /// A handle owning the count just added to `wire`'s slot in `file`.
    pub(crate) fn claimed(file: Arc<RefCounterFile>, wire: WireHandle) -> Self {
        IpcHandle {
            claim: Some(Claim::new(file, ticket_of(&wire))),
            wire,
        }
    }

    /// The decoded fields.
    #[doc(hidden)]
    pub fn wire(&self) -> &WireHandle {
        &self.wire
    }

    /// The bytes to send; the count travels with them (decode them exactly once on the other side).
    pub fn into_bytes(mut self) -> Vec<u8> {
        if let Some(claim) = self.claim.take() {
            claim.forget();
        }
        self.wire.encode()
    }

    /// Decodes bytes from another process: parses and validates them, opens (once per process)
    /// and checks the ref-counter file and the slot. The returned handle owns the count.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcHandle> {
        let wire = WireHandle::parse(bytes)?;
        if wire.is_empty() {
            return Ok(IpcHandle { wire, claim: None });
        }
        let file = consumer::open_ref_file(&wire.ref_file, wire.producer_pid)?;
        file.intact()?;
        let generation = file.slot(wire.slot)?.generation();
        if generation != wire.generation {
            // The storage this handle named was freed and its slot serves another one: the handle
            // owns no count any more.
            return Err(Refused::Stale.into_error(wire.slot));
        }
        Ok(IpcHandle::claimed(file, wire))
    }

    /// The fields and the count.
    pub(crate) fn into_parts(self) -> (WireHandle, Option<Claim>) {
        (self.wire, self.claim)
    }
}
