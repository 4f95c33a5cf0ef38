//! Cross-process sharing: PyTorch's CUDA IPC protocol (ref-counter files, limbo, `ipc_collect`)
//! without its leaks.
//!
//! * `wire.rs` — the handle's byte format; `refcount.rs` — ref-counter files (slots, release ring,
//!   OFD locks); `state.rs` — the producer's files, limbo and drains; `producer.rs` — what a shared
//!   storage owns; `consumer.rs` — claims, leases, mappings; `handle.rs` — [`IpcHandle`].
//! * Memory of expandable segments is not one driver allocation but pages: `page_protocol.rs` —
//!   the request/answer messages; `page_server.rs` — the producer's registry of shared pages and
//!   who may fetch them (the page secret); `page_thread.rs` — the thread that serves them, its
//!   start and stop; `page_connections.rs` — the thread serving their chunk
//!   descriptors over a Unix socket (`SCM_RIGHTS`), every connection at once, bounded by
//!   [`PageSocketLimits`]; `page_mappings.rs` — the consumer's mappings of exactly the pages under
//!   a storage.
//!
//! Why a socket and not PyTorch's `pidfd_getfd`: that call needs ptrace permission over the
//! producer, which unprivileged containers (and Yama's default scope) deny; a socket in `/dev/shm`
//! works wherever the ref-counter files do, and the producer decides what it hands out (only pages
//! of storages it shares, to peers of its own user that carry the storage's page secret while a
//! count is held on it). Why only the storage's pages: PyTorch's consumer
//! reserves the producer's whole segment range per imported segment and maps all of it; mapping the
//! pages under the storage bounds the consumer's address space by what it uses.
//!
//! This layer works on [`DataPtr`]s: `share` wraps a `DataPtr`'s block for sharing and makes a
//! handle, `open` turns a handle into a `DataPtr` of another process's memory. Which `Storage`
//! a receipt returns (the original one in the producer's process, the already-open one in a
//! consumer) is the storage layer's business (`storage/registry.rs`).
//!
//! Life of one share: [`Storage::share_ipc`](crate::Storage::share_ipc) returns an [`IpcHandle`]
//! that owns one `pending` count; [`IpcHandle::into_bytes`] sends the count with the bytes;
//! [`IpcHandle::from_bytes`] in the consumer takes it back into a handle (validating everything);
//! [`Storage::from_ipc`](crate::Storage::from_ipc) turns it into a lease — or gives it back at once
//! when the storage is already open here. A handle dropped without being opened gives its count back
//! (PyTorch leaks it). A received storage can be shared on to a third process: the new handle
//! counts on the original slot (PyTorch refuses).

mod consumer;
mod handle;
#[doc(hidden)]
pub mod lease_table;
#[doc(hidden)]
pub mod limbo;
mod page_connections;
mod page_mappings;
mod page_protocol;
mod page_server;
mod page_thread;
mod producer;
pub(crate) mod refcount;
pub(crate) mod state;
mod wire;

pub use crate::shm::sweep_orphans;
pub use handle::IpcHandle;
pub use page_protocol::PageSocketLimits;
pub use state::Drained;
pub(crate) use state::IpcState;
pub(crate) use state::DEFAULT_EVENT_BUDGET;
#[doc(hidden)]
pub use wire::{WireHandle, WirePages, PAGE_SECRET_SIZE, WIRE_SIZE};

use self::consumer::{Mapping, ReceivedMapping, ReceivedOwner};
use self::page_mappings::PageMapping;
use self::producer::SentOwner;
use crate::alloc::{CachingAllocator, DataPtr, Owner};
use crate::driver::StreamId;
use crate::error::{Error, Result};
use crate::sync::os::{Arc, Mutex};

/// Identity of a shared storage in its producer's process: (ref-counter file name, slot,
/// generation). A handle names it; the storage layer maps it to the live `Storage`.
pub(crate) type SharedKey = (String, u32, u32);

/// What [`share`] produced.
pub(crate) struct Shared {
    /// The handle (one count on the slot).
    pub handle: IpcHandle,
    /// Set on the first share of the memory (it was wrapped just now).
    pub first_share: Option<SharedKey>,
}

/// The key of `wire`'s storage.
pub(crate) fn shared_key(wire: &WireHandle) -> SharedKey {
    (wire.ref_file.clone(), wire.slot, wire.generation)
}

/// Shares the memory of `data` (a storage's `DataPtr` of `nbytes`, its lock held; not a COW
/// view): on the first share its block is wrapped in a [`SentOwner`] (a slot, an event); every
/// share records the event on `stream` (or synchronizes it) and adds one `pending` count. Memory
/// received from another process is forwarded: the handle counts on the original slot.
pub(crate) fn share(
    ipc: &Arc<IpcState>,
    data: &mut DataPtr,
    nbytes: u64,
    stream: StreamId,
) -> Result<Shared> {
    ipc.check_process()?;
    let device = data.device();
    let pid = std::process::id();
    let device32 = u32::try_from(device).map_err(|_| Error::invalid("device ordinal too large"))?;
    if nbytes == 0 {
        return Ok(Shared {
            handle: IpcHandle::unclaimed(WireHandle::empty(ipc.backend, device32, pid)),
            first_share: None,
        });
    }
    if let Some(sanitizer) = ipc.driver.sanitizer() {
        // The consumer reads these bytes after `stream`'s event (or the synchronization below):
        // bytes another stream wrote that `stream` did not wait for are reported here, in the
        // producer. Only checked, not recorded: the consumer's accesses happen in its process,
        // ordered by its release, which this process's streams cannot see.
        let touch = crate::driver::sanitizer::Touch::read(data.ptr().0, nbytes);
        sanitizer.check_ordered(stream, "sharing with another process", &[touch])?;
    }
    // Memory of a sleeping tag is not shared (`runtime/sleep.rs`); checked again below, once
    // the share counts, against a sleep that began meanwhile.
    data.check_awake("sharing a storage")?;
    let mut first_share = None;
    if let Owner::Block(_) = data.owner() {
        let segment = data.segment().ok_or_else(|| Error::invalid("no segment"))?;
        let pages = data.pages_under(nbytes)?;
        let original = std::mem::replace(data, DataPtr::empty(device));
        let ptr = original.ptr();
        match ipc.wrap(original, segment, nbytes, pages) {
            Ok(sent) => {
                first_share = sent.data.as_ref().map(|d| {
                    (
                        d.slot.file.name().to_owned(),
                        d.slot.slot,
                        d.slot.generation,
                    )
                });
                *data = DataPtr::new(ptr, device, Owner::Shared(Box::new(sent)));
            }
            Err(failed) => {
                let (err, original) = *failed;
                *data = original;
                return Err(err);
            }
        }
    }
    let handle = if let Some(sent) = data.shared_owner::<SentOwner>() {
        let d = sent
            .data
            .as_ref()
            .ok_or_else(|| Error::invalid("shared storage already released"))?;
        let event = match d.event {
            Some(e) => {
                ipc.driver.event_record(e, stream)?;
                Some(ipc.driver.ipc().ipc_export_event(e)?.0)
            }
            None => {
                ipc.driver.stream_synchronize(stream)?;
                None
            }
        };
        let file = Arc::clone(&d.slot.file);
        let expires_ms = ipc.handle_expiry();
        file.intact()?;
        file.slot(d.slot.slot)?.add_pending_until(expires_ms);
        IpcHandle::claimed(
            file,
            WireHandle {
                backend: ipc.backend,
                device: device32,
                producer_pid: pid,
                slot: d.slot.slot,
                memory: d.memory,
                segment_size: d.segment_size,
                offset: d.offset,
                nbytes: d.nbytes,
                ref_file: d.slot.file.name().to_owned(),
                event,
                generation: d.slot.generation,
                expires_ms,
                pages: d.pages,
            },
        )
    } else if let Some(recv) = data.shared_owner::<ReceivedOwner>() {
        // Forwarding: count on the original slot; our writes are made visible by synchronizing
        // instead of sending an event of ours.
        ipc.driver.stream_synchronize(stream)?;
        let lease = recv
            .lease
            .as_ref()
            .ok_or_else(|| Error::invalid("received storage already released"))?;
        let expires_ms = ipc.handle_expiry();
        lease.file.slot(lease.slot)?.add_pending_until(expires_ms);
        IpcHandle::claimed(
            Arc::clone(&lease.file),
            WireHandle {
                event: None,
                expires_ms,
                ..recv.wire.clone()
            },
        )
    } else {
        return Err(Error::invalid(
            "only memory from a caching allocator (or received through IPC) can be shared",
        ));
    };
    // A sleep that began after the check above: either it sees this share's count (and refuses
    // to sleep) or this sees its flag (and the handle is dropped, giving the count back).
    data.check_awake("sharing a storage")?;
    Ok(Shared {
        handle,
        first_share,
    })
}

/// Opens a handle of another process (already checked: not empty, not ours, a count to claim)
/// on `alloc`'s device: maps the segment (once per driver), takes the lease, makes the current
/// stream wait for the producer's event. Returns the memory as a `DataPtr`.
pub(crate) fn open(
    ipc: &IpcState,
    alloc: &CachingAllocator,
    handle: IpcHandle,
    device: usize,
) -> Result<DataPtr> {
    if handle.wire().backend != ipc.backend {
        return Err(Error::bad_handle(format!(
            "handle from the {} backend cannot be opened by the {} backend",
            handle.wire().backend,
            ipc.backend
        )));
    }
    let (wire, claim) = handle.into_parts();
    let claim = claim.ok_or_else(|| Error::bad_handle("handle carries no count"))?;
    let pid = wire.producer_pid;
    let mapping = match wire.pages {
        Some(pages) => {
            PageMapping::open(&ipc.driver, &wire, pages, device).map(ReceivedMapping::Pages)
        }
        None => Mapping::open(&ipc.driver, &wire).map(ReceivedMapping::Segment),
    }
    .map_err(|err| producer_gone(claim.producer_alive(), pid, "its memory was opened", err))?;
    if let Some(file) = claim.file() {
        ipc.keep_recent(Arc::clone(file));
    }
    let lease = claim.into_lease()?;
    let stream = alloc.current_stream(device)?;
    let start = mapping.base().offset(wire.offset)?;
    wait_for_producer(ipc, &wire, device, stream, start, &|| {
        lease.producer_alive()
    })?;
    let ptr = mapping.base().offset(wire.offset)?;
    let owner = ReceivedOwner {
        wire,
        streams: Mutex::new(vec![stream]),
        driver: Arc::clone(&ipc.driver),
        lease: Some(lease),
        mapping: Some(mapping),
        birth: crate::process::Birth::now(),
    };
    Ok(DataPtr::new(ptr, device, Owner::Shared(Box::new(owner))))
}

/// Makes `stream` wait for the producer's event of `wire`, if it carries one (its writes to the
/// bytes at `start`, which the producer made before recording it), and tells the sanitizer so.
/// At a first receipt and at every later receipt of memory already open here: the producer may
/// have written again since. `alive` says whether the producer still runs (for the error).
pub(crate) fn wait_for_producer(
    ipc: &IpcState,
    wire: &WireHandle,
    device: usize,
    stream: crate::driver::StreamId,
    start: crate::driver::DeviceAddr,
    alive: &dyn Fn() -> bool,
) -> Result<()> {
    let Some(event) = &wire.event else {
        return Ok(());
    };
    let pid = wire.producer_pid;
    let not_ready = |err| producer_gone(alive(), pid, "its writes completed", err);
    let e = ipc
        .driver
        .ipc()
        .ipc_open_event(device, &crate::driver::IpcEventHandle(*event))
        .map_err(not_ready)?;
    // The producer wrote these bytes before its event: a stream that uses them must wait for it
    // (`stream` does, just below).
    let sanitizer = ipc.driver.sanitizer();
    let epoch = sanitizer.as_ref().map(|s| s.remote_event(e, pid));
    let waited = ipc.driver.stream_wait_event(stream, e).map_err(not_ready);
    let destroyed = ipc.driver.event_destroy(e);
    waited.and(destroyed)?;
    if let (Some(sanitizer), Some(epoch)) = (sanitizer, epoch) {
        sanitizer.remote_write(start.0, wire.nbytes, pid, epoch);
    }
    Ok(())
}

/// `err` of opening a handle — or, when its producer is dead, an error that says so: its objects
/// may already be swept, its page socket gone, its event never to complete.
fn producer_gone(alive: bool, pid: u32, before: &str, err: Error) -> Error {
    if alive {
        return err;
    }
    Error::bad_handle(format!(
        "this handle cannot be opened: its producer (pid {pid}) exited before {before} ({err})"
    ))
}

/// Whether `data` is memory received from another process.
pub(crate) fn is_received(data: &DataPtr) -> bool {
    data.shared_owner::<ReceivedOwner>().is_some()
}

/// Memory of other processes mapped through `driver` now: whole segments and page spans.
pub(crate) fn open_segments(driver: &Arc<dyn crate::backend::Driver>) -> usize {
    Mapping::open_count(driver) + PageMapping::mapped(driver).0
}

/// Bytes of address space that `driver` holds for memory of other processes: the sizes of the
/// whole segments opened and of the page spans mapped.
pub(crate) fn imported_address_space(driver: &Arc<dyn crate::backend::Driver>) -> u64 {
    Mapping::open_bytes(driver) + PageMapping::mapped(driver).1
}
