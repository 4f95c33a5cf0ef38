//! Cross-process sharing: PyTorch's CUDA IPC protocol (ref-counter files, limbo, `ipc_collect`)
//! without its leaks.
//!
//! * `wire.rs` — the handle's byte format; `refcount.rs` — ref-counter files (slots, release ring,
//!   OFD locks); `state.rs` — the producer's files, limbo and drains; `producer.rs` — what a shared
//!   storage owns; `consumer.rs` — claims, leases, caches.
//!
//! Life of one share: [`Storage::share_ipc`](crate::Storage::share_ipc) returns an [`IpcHandle`]
//! that owns one `pending` count; [`IpcHandle::into_bytes`] sends the count with the bytes;
//! [`IpcHandle::from_bytes`] in the consumer takes it back into a handle (validating everything);
//! [`Storage::from_ipc`](crate::Storage::from_ipc) turns it into a lease — or gives it back at once
//! when the storage is already open here. A handle dropped without being opened gives its count back
//! (PyTorch leaks it). A received storage can be shared on to a third process: the new handle
//! counts on the original slot (PyTorch refuses).

mod consumer;
#[doc(hidden)]
pub mod limbo;
mod producer;
pub(crate) mod refcount;
pub(crate) mod state;
pub mod wire;

pub(crate) use consumer::ReceivedOwner;
pub(crate) use producer::SentOwner;
pub(crate) use state::IpcState;
pub use state::{Drained, DEFAULT_EVENT_BUDGET};
pub use wire::{WireHandle, WIRE_SIZE};

use self::consumer::{Claim, ConsumerCaches, Mapping};
use crate::error::{Error, Result};
use crate::storage::{DataPtr, Owner, Storage, WeakStorage};
use crate::sync::os::{Arc, Mutex};

/// A handle of a shared storage that owns one count on its slot (see the [module docs](self)).
#[derive(Debug)]
pub struct IpcHandle {
    wire: WireHandle,
    claim: Option<Claim>,
}

impl IpcHandle {
    /// The decoded fields.
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

    /// Builds a handle from fields received by other means (e.g. the `serde` feature): validated
    /// exactly like bytes.
    pub fn from_wire(wire: &WireHandle) -> Result<IpcHandle> {
        wire.validate()?;
        Self::from_bytes(&wire.encode())
    }

    /// Decodes bytes from another process: parses and validates them, opens (once per process)
    /// and checks the ref-counter file and the slot. The returned handle owns the count.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcHandle> {
        let wire = WireHandle::parse(bytes)?;
        if wire.is_empty() {
            return Ok(IpcHandle { wire, claim: None });
        }
        let file = consumer::open_ref_file(&wire.ref_file, wire.producer_pid)?;
        let generation = file.slot(wire.slot)?.generation();
        if generation != wire.generation {
            // The storage this handle named was freed and its slot serves another one: the handle
            // owns no count any more.
            return Err(refcount::Refused::Stale.into_error(wire.slot));
        }
        let ticket = ticket_of(&wire);
        Ok(IpcHandle {
            claim: Some(Claim::new(file, ticket)),
            wire,
        })
    }

    fn into_parts(self) -> (WireHandle, Option<Claim>) {
        (self.wire, self.claim)
    }
}

/// The count a handle's claim owns.
fn ticket_of(wire: &WireHandle) -> consumer::SlotTicket {
    consumer::SlotTicket {
        slot: wire.slot,
        generation: wire.generation,
        expires_ms: wire.expires_ms,
    }
}

/// Shares `storage` (see [`Storage::share_ipc`]).
pub(crate) fn share(storage: &Storage) -> Result<IpcHandle> {
    let alloc = storage.allocator();
    let ipc = alloc.ipc();
    let device = storage.device();
    let stream = alloc.current_stream(device)?;
    let pid = std::process::id();
    let device32 = u32::try_from(device).map_err(|_| Error::invalid("device ordinal too large"))?;
    storage.with_data(|data| {
        if storage.nbytes() == 0 {
            return Ok(IpcHandle {
                wire: WireHandle::empty(ipc.backend, device32, pid),
                claim: None,
            });
        }
        if let Owner::Cow(_) = data.owner() {
            // A consumer may write: the shared memory must be this storage's own. Materialized
            // under the same lock as the wrapping below, so a concurrent lazy clone cannot turn it
            // back into a COW view in between. The copy is enqueued on `stream`; nothing the
            // caller did asked for it, so it is made complete before any stream can touch the new
            // memory (a later write on another stream must not be overwritten by it).
            crate::cow::materialize_locked(storage, data)?;
            ipc.driver.stream_synchronize(stream)?;
        }
        if let Owner::Block(_) = data.owner() {
            let segment = data.segment().ok_or_else(|| Error::invalid("no segment"))?;
            let original = std::mem::replace(data, DataPtr::empty(device));
            let ptr = original.ptr();
            match ipc.wrap(original, segment, storage.nbytes()) {
                Ok(sent) => {
                    if let Some(d) = sent.data.as_ref() {
                        state::remember_shared(&d.slot, storage.downgrade());
                    }
                    *data = DataPtr::new(ptr, device, Owner::Sent(Box::new(sent)));
                }
                Err(failed) => {
                    let (err, original) = *failed;
                    *data = original;
                    return Err(err);
                }
            }
        }
        match data.owner() {
            Owner::Sent(sent) => {
                let d = sent
                    .data
                    .as_ref()
                    .ok_or_else(|| Error::invalid("shared storage already released"))?;
                let event = match d.event {
                    Some(e) => {
                        ipc.driver.event_record(e, stream)?;
                        Some(ipc.driver.ipc_export_event(e)?.0)
                    }
                    None => {
                        ipc.driver.stream_synchronize(stream)?;
                        None
                    }
                };
                let file = Arc::clone(&d.slot.file);
                let expires_ms = ipc.handle_expiry();
                file.slot(d.slot.slot)?.add_pending_until(expires_ms);
                let wire = WireHandle {
                    backend: ipc.backend,
                    device: device32,
                    producer_pid: pid,
                    slot: d.slot.slot,
                    memory: d.memory,
                    segment_size: d.segment_size,
                    offset: d.offset,
                    nbytes: d.nbytes,
                    ref_file: file.name().to_owned(),
                    event,
                    generation: d.slot.generation,
                    expires_ms,
                };
                Ok(IpcHandle {
                    claim: Some(Claim::new(file, ticket_of(&wire))),
                    wire,
                })
            }
            Owner::Received(recv) => {
                // Forwarding: count on the original slot; our writes are made visible by
                // synchronizing instead of sending an event of ours.
                ipc.driver.stream_synchronize(stream)?;
                let lease = recv
                    .lease
                    .as_ref()
                    .ok_or_else(|| Error::invalid("received storage already released"))?;
                let expires_ms = ipc.handle_expiry();
                lease.file.slot(lease.slot)?.add_pending_until(expires_ms);
                let wire = WireHandle {
                    event: None,
                    expires_ms,
                    ..recv.wire.clone()
                };
                Ok(IpcHandle {
                    claim: Some(Claim::new(Arc::clone(&lease.file), ticket_of(&wire))),
                    wire,
                })
            }
            Owner::Block(_) | Owner::None | Owner::Cow(_) => Err(Error::invalid(
                "only memory from a caching allocator (or received through IPC) can be shared",
            )),
        }
    })
}

/// Opens a handle (see [`Storage::from_ipc`]).
pub(crate) fn receive(alloc: &Arc<crate::CachingAllocator>, handle: IpcHandle) -> Result<Storage> {
    let ipc = alloc.ipc();
    let (wire, claim) = handle.into_parts();
    let device = usize::try_from(wire.device).map_err(|_| Error::bad_handle("device ordinal"))?;
    if device >= alloc.device_count() {
        return Err(Error::bad_handle(format!(
            "device {device} does not exist here"
        )));
    }
    if wire.is_empty() {
        return Storage::new(alloc, device, 0);
    }
    if wire.producer_pid == std::process::id() {
        let original = state::same_process(&wire.ref_file, wire.slot, wire.generation);
        if let Some(c) = claim {
            c.give_back();
        }
        return original;
    }
    if wire.backend != ipc.backend {
        return Err(Error::bad_handle(format!(
            "handle from the {} backend cannot be opened by the {} backend",
            wire.backend, ipc.backend
        )));
    }
    let claim = claim.ok_or_else(|| Error::bad_handle("handle carries no count"))?;
    let key = (wire.memory, wire.offset);
    // The cache lock is held across the whole receipt: check and insert are one step.
    let mut received = ipc.consumer().received.lock();
    received.retain(|_, w| w.is_alive());
    if let Some(live) = received.get(&key).and_then(WeakStorage::upgrade) {
        claim.give_back();
        return Ok(live);
    }
    let mapping = Mapping::open(&ipc.driver, &wire)?;
    let lease = claim.into_lease()?;
    let stream = alloc.current_stream(device)?;
    if let Some(event) = &wire.event {
        let e = ipc
            .driver
            .ipc_open_event(device, &crate::driver::IpcEventHandle(*event))?;
        let waited = ipc.driver.stream_wait_event(stream, e).map_err(|err| {
            Error::bad_handle(format!(
                "the data of this handle is not ready and cannot become ready: the producer \
                 (pid {}) exited before its writes completed ({err})",
                wire.producer_pid
            ))
        });
        let destroyed = ipc.driver.event_destroy(e);
        waited.and(destroyed)?;
    }
    let ptr = mapping.base.offset(wire.offset)?;
    let nbytes = wire.nbytes;
    let owner = ReceivedOwner {
        wire,
        streams: Mutex::new(vec![stream]),
        driver: Arc::clone(&ipc.driver),
        lease: Some(lease),
        _mapping: mapping,
    };
    let storage = Storage::from_data_ptr(
        alloc,
        DataPtr::new(ptr, device, Owner::Received(Box::new(owner))),
        nbytes,
    );
    received.insert(key, storage.downgrade());
    Ok(storage)
}

/// Segments of other processes open through `driver` now.
pub(crate) fn open_segments(driver: &Arc<dyn crate::Driver>) -> usize {
    Mapping::open_count(driver)
}

impl IpcState {
    fn consumer(&self) -> &ConsumerCaches {
        &self.consumer
    }
}
