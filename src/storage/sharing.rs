//! The storage-level steps of lazy clones and sharing, each under the storage's lock (see the state
//! table in the [module docs](super)).

use std::collections::HashMap;

use super::{registry, Storage};
use crate::alloc::DataPtr;
use crate::driver::sanitizer::AccessKind;
use crate::driver::StreamId;
use crate::error::{Error, Result};
use crate::ipc::IpcHandle;
use crate::runtime::Runtime;
use crate::sync::os::Arc;

/// A lazy clone of `storage` (converting it to COW in place on its first lazy clone).
pub(super) fn lazy_clone(storage: &Storage, stream: StreamId) -> Result<Storage> {
    if storage.nbytes() == 0 {
        return Storage::new(storage.runtime(), storage.device(), 0);
    }
    storage.with_access(stream, AccessKind::Read, |data| {
        match cow_sibling(storage, data, true)? {
            Some(clone) => Ok(clone),
            None => eager_clone(storage, data),
        }
    })
}

/// A second holder of `storage`'s memory as it is now, for work outside stream order that must
/// not see it freed or moved (a NIXL transfer): a COW sibling (converting a plain storage to COW,
/// as a lazy clone does), or `None` for memory shared with other processes, which never moves (the
/// storage itself keeps it).
#[cfg(feature = "nixl")]
pub(super) fn pin_memory(storage: &Storage) -> Result<Option<Storage>> {
    if storage.nbytes() == 0 {
        return Ok(None);
    }
    // Not a clone anyone reads: the transfer engine writes the memory it pinned (no report).
    storage.with_data(|data| cow_sibling(storage, data, false))
}

/// A storage sharing `data` (the storage's, under its lock) copy-on-write, both tagged COW; `None`
/// when the memory cannot be shared that way (it is shared with other processes). `clone`: a
/// lazy clone the program reads (the sanitizer then reports writes into the shared memory), not
/// a pin.
fn cow_sibling(storage: &Storage, data: &mut DataPtr, clone: bool) -> Result<Option<Storage>> {
    let runtime = storage.runtime();
    let ptr = data.ptr();
    // The clone's bytes are the source's as the current stream sees them (it waited for the
    // source's last write: `Storage::lazy_clone`): other streams' accesses wait for it.
    let current = runtime.current_stream(storage.device())?;
    Ok(
        crate::cow::lazy_clone(runtime.allocator(), data, clone)?.map(|sibling| {
            storage.set_cow_word(ptr, true);
            let sibling = Storage::written_on(runtime, sibling, storage.nbytes(), Some(current));
            sibling.set_cow_word(ptr, true);
            sibling
        }),
    )
}

/// A lazy clone of memory shared with other processes is an eager copy on the current stream
/// (the memory is an alias of their storages: see `cow/mod.rs`). The copy is complete when this
/// returns: the caller asked for a lazy clone, which does no device work, so nothing it does next
/// on another stream (share the clone, read it, write the source) may race the copy. (The
/// interplay test found that race: a clone taken on one stream and shared on another reached the
/// consumer before its bytes.)
fn eager_clone(storage: &Storage, data: &DataPtr) -> Result<Storage> {
    let runtime = storage.runtime();
    let stream = runtime.current_stream(storage.device())?;
    let copy = runtime.clone_data(data, storage.nbytes(), stream)?;
    runtime.driver().stream_synchronize(stream)?;
    Ok(Storage::from_data_ptr(runtime, copy, storage.nbytes()))
}

/// An error while a capture of this runtime is under way: sharing records the event consumers
/// wait on, and receiving waits on the producer's — on a capturing stream the record would be a
/// point of the capture, not a real record, and the wait one on work outside it (which CUDA
/// refuses, invalidating the capture); on any stream, sharing a lazy clone synchronizes and
/// receiving opens memory, calls a global capture forbids (found by review). Memory of a
/// graph's pool may be shared once the capture has ended (`src/alloc/graph.rs`: replays keep
/// rewriting it).
fn refuse_while_capturing(runtime: &Runtime, stream: StreamId, what: &str) -> Result<()> {
    if !runtime.allocator().captures_under_way() {
        return Ok(());
    }
    let on_this_stream = runtime
        .driver()
        .graphs()
        .stream_capture_status(stream)?
        .capture_id();
    if let Some(id) = on_this_stream {
        return Err(Error::capture(format!(
            "a storage cannot be {what} on stream {}, which is being captured (capture {id}): \
             end the capture first",
            stream.raw()
        )));
    }
    Err(Error::capture(format!(
        "a storage cannot be {what} while a stream capture of this runtime is under way (it \
         would synchronize or open memory, which the capture forbids): end the capture first"
    )))
}

/// Shares `storage` (see [`Storage::share_ipc`]).
pub(super) fn share(storage: &Storage) -> Result<IpcHandle> {
    let runtime = storage.runtime();
    let stream = runtime.current_stream(storage.device())?;
    refuse_while_capturing(runtime, stream, "shared with another process")?;
    storage.with_access(stream, AccessKind::Read, |data| {
        if crate::cow::is_cow(data) {
            // A consumer may write: the shared memory must be this storage's own. Materialized
            // under the same lock as the wrapping below, so a concurrent lazy clone cannot turn it
            // back into a COW view in between. The copy is enqueued on `stream`; nothing the
            // caller did asked for it, so it is made complete before any stream can touch the new
            // memory (a later write on another stream must not be overwritten by it).
            let (_, queued) = storage.materialize_locked(data, stream)?;
            if queued {
                runtime.driver().stream_synchronize(stream)?;
            }
        }
        let shared = crate::ipc::share(runtime.ipc(), data, storage.nbytes(), stream)?;
        if let Some(key) = shared.first_share {
            registry::remember_shared(key, storage);
        }
        Ok(shared.handle)
    })
}

/// Opens a handle (see [`Storage::from_ipc`]).
pub(super) fn receive(runtime: &Arc<Runtime>, handle: IpcHandle) -> Result<Storage> {
    let wire = handle.wire();
    let device = usize::try_from(wire.device).map_err(|_| Error::bad_handle("device ordinal"))?;
    if device >= runtime.device_count() {
        return Err(Error::bad_handle(format!(
            "device {device} does not exist here"
        )));
    }
    if wire.is_empty() {
        return Storage::new(runtime, device, 0);
    }
    if wire.producer_pid == std::process::id() {
        // The producer's own process: the original storage, and the count goes back at once.
        let original = registry::shared(&crate::ipc::shared_key(wire)).ok_or_else(|| {
            Error::bad_handle("the shared storage no longer exists in this process")
        });
        let (_, claim) = handle.into_parts();
        if let Some(c) = claim {
            c.give_back();
        }
        return original;
    }
    let key = (runtime.id(), crate::ipc::shared_key(wire));
    let nbytes = wire.nbytes;
    // Held across the whole receipt: check and insert are one step.
    let mut guard = registry::received();
    let received = guard.get_or_insert_with(HashMap::new);
    if let Some(live) = received.get(&key).and_then(super::WeakStorage::upgrade) {
        // Memory open here already: the producer may have written since the first receipt (its
        // new event says when). The current stream waits for it, as at a first receipt, and the
        // storage counts as written there: its next accesses on other streams wait for that
        // stream (found by review: a second receipt returned the storage without the wait).
        let stream = runtime.current_stream(device)?;
        refuse_while_capturing(runtime, stream, "received from another process")?;
        let (wire, claim) = handle.into_parts();
        let alive = || claim.as_ref().is_none_or(|c| c.producer_alive());
        crate::ipc::wait_for_producer(
            runtime.ipc(),
            &wire,
            device,
            stream,
            live.unordered_data_ptr(),
            &alive,
        )?;
        live.access(stream, AccessKind::Write)?;
        if let Some(c) = claim {
            c.give_back();
        }
        return Ok(live);
    }
    received.retain(|_, w| w.is_alive());
    let stream = runtime.current_stream(device)?;
    refuse_while_capturing(runtime, stream, "received from another process")?;
    let data = crate::ipc::open(runtime.ipc(), runtime.allocator(), handle, device)?;
    // Ready on the receipt's stream (it waits for the producer's event): other streams wait
    // for it (`order.rs`).
    let storage = Storage::written_on(runtime, data, nbytes, Some(stream));
    received.insert(key, storage.downgrade());
    Ok(storage)
}
