//! The COW context of device memory: the generic [`CowCell`] holding the original `DataPtr`, plus
//! what stream ordering needs (the stream current at lazy-clone time, the copiers' events).

use super::cell::{CowCell, Materialized};
use crate::driver::{DevicePtr, Driver, EventFlags, EventId, StreamId};
use crate::error::{Error, Result};
use crate::storage::{DataPtr, Owner, Storage};
use crate::sync::os::{Arc, Mutex};

/// Shared state of a set of COW storages.
#[derive(Debug)]
pub(crate) struct CowContext {
    cell: CowCell<DataPtr>,
    device: usize,
    clone_stream: StreamId,
    copier_events: Mutex<Vec<EventId>>,
    driver: Arc<dyn Driver>,
}

impl Drop for CowContext {
    fn drop(&mut self) {
        for e in self.copier_events.lock().drain(..) {
            if let Err(err) = self.driver.event_destroy(e) {
                tracing::warn!(%err, "destroying a COW copier event failed");
            }
        }
    }
}

/// The owner of a COW storage's `DataPtr`: one reference on the context.
#[derive(Debug)]
pub(crate) struct CowOwner {
    ctx: Arc<CowContext>,
    /// False once materialization gave the reference up (nothing to release on drop).
    armed: bool,
}

impl CowOwner {
    /// Runs `f` on the shared original data.
    pub(crate) fn with_original<R>(&self, f: impl FnOnce(Option<&DataPtr>) -> R) -> R {
        self.ctx.cell.with_data(f)
    }
}

impl Drop for CowOwner {
    fn drop(&mut self) {
        if self.armed {
            // The last reference frees the original (its block's free waits for copier streams).
            drop(self.ctx.cell.release());
        }
    }
}

/// A lazy clone of `storage` (converted to COW in place on its first lazy clone).
pub(crate) fn lazy_clone(storage: &Storage) -> Result<Storage> {
    let alloc = storage.allocator();
    let device = storage.device();
    if storage.nbytes() == 0 {
        return Storage::new(alloc, device, 0);
    }
    storage.with_data(|data| {
        let ptr = data.ptr();
        let ctx = match data.owner() {
            Owner::Cow(owner) => {
                owner.ctx.cell.add_ref();
                Arc::clone(&owner.ctx)
            }
            Owner::Sent(_) | Owner::Received(_) => return eager_clone(storage, data),
            _ => {
                let clone_stream = alloc.current_stream(device)?;
                let original = std::mem::replace(data, DataPtr::empty(device));
                let ctx = Arc::new(CowContext {
                    cell: CowCell::new(original, 2),
                    device,
                    clone_stream,
                    copier_events: Mutex::new(Vec::new()),
                    driver: Arc::clone(alloc.driver()),
                });
                *data = DataPtr::new(
                    ptr,
                    device,
                    Owner::Cow(CowOwner {
                        ctx: Arc::clone(&ctx),
                        armed: true,
                    }),
                );
                storage.set_cow_word(ptr, true);
                ctx
            }
        };
        let clone = Storage::from_data_ptr(
            alloc,
            DataPtr::new(ptr, device, Owner::Cow(CowOwner { ctx, armed: true })),
            storage.nbytes(),
        );
        clone.set_cow_word(ptr, true);
        Ok(clone)
    })
}

/// A lazy clone of memory shared with other processes is an eager, stream-ordered copy: the
/// memory is an alias of another process's storage, so it can change under a COW view (a consumer
/// writes it) and cannot be handed to a clone by a steal (the other processes would lose their
/// alias). PyTorch falls back the same way for storages whose data pointer is not its own.
fn eager_clone(storage: &Storage, data: &DataPtr) -> Result<Storage> {
    let alloc = storage.allocator();
    let stream = alloc.current_stream(storage.device())?;
    let nbytes = storage.nbytes();
    let copy = alloc.allocate_on(stream, nbytes)?;
    alloc
        .driver()
        .copy_device_to_device(stream, copy.ptr(), data.ptr(), nbytes)?;
    storage.record_stream_locked(data, stream)?;
    Ok(Storage::from_data_ptr(alloc, copy, nbytes))
}

/// Materializes a COW storage for writing on the current stream; returns the address to write.
pub(crate) fn materialize(storage: &Storage) -> Result<DevicePtr> {
    storage.with_data(|data| materialize_locked(storage, data))
}

/// [`materialize`] with the storage's data lock already held (`data` is the storage's `DataPtr`),
/// so callers can materialize and go on (e.g. wrap the memory for sharing) in one critical
/// section. A storage that is not COW is left alone.
pub(crate) fn materialize_locked(storage: &Storage, data: &mut DataPtr) -> Result<DevicePtr> {
    let alloc = storage.allocator();
    let device = storage.device();
    let nbytes = storage.nbytes();
    let stream = alloc.current_stream(device)?;
    let driver = alloc.driver();
    {
        // Take the owner out (no refcount traffic); every early return puts it back.
        let shared_ptr = data.ptr();
        let mut owner = match std::mem::replace(data, DataPtr::empty(device)).into_owner() {
            Owner::Cow(owner) => owner,
            other => {
                // Materialized by another alias meanwhile.
                *data = DataPtr::new(shared_ptr, device, other);
                return Ok(shared_ptr);
            }
        };
        let ctx = &owner.ctx;
        let outcome = (|| {
            if stream != ctx.clone_stream {
                wait_for_stream(driver, ctx.device, ctx.clone_stream, stream)?;
            }
            ctx.cell
                .materialize(|original| copy_step(alloc, ctx, original, nbytes, stream))
        })();
        let new_data = match outcome {
            Ok(Materialized::Stole(original)) => {
                // The reference is given up: from here nothing may fail. Our stream waits for
                // every copier; if a wait cannot be enqueued, block on the event instead.
                for &e in ctx.copier_events.lock().iter() {
                    if let Err(err) = driver.stream_wait_event(stream, e) {
                        tracing::warn!(%err, "COW steal: waiting on the host instead");
                        let _ = driver.event_synchronize(e);
                    }
                }
                original
            }
            Ok(Materialized::Copied(copy)) => copy,
            Err(err) => {
                // Still a valid COW storage (the reference was not given up).
                *data = DataPtr::new(shared_ptr, device, Owner::Cow(owner));
                return Err(err);
            }
        };
        // `materialize` already gave our reference up: disarm the old owner before it drops.
        owner.armed = false;
        drop(owner);
        let ptr = new_data.ptr();
        *data = new_data;
        storage.set_cow_word(ptr, false);
        Ok(ptr)
    }
}

/// Copier: the whole fallible copy step, done before the reference is given up. Allocates the
/// copy on `stream`, enqueues the device copy there, marks the source as used by `stream` (its free
/// waits) and records an event after the copy (a later stealer waits on it). The event is created
/// before anything is enqueued; if the bookkeeping after the enqueue fails, the stream is
/// synchronized (so the abandoned copy cannot read the source after a stealer writes it) and the
/// error returned — the caller's storage stays COW.
fn copy_step(
    alloc: &crate::CachingAllocator,
    ctx: &CowContext,
    original: &DataPtr,
    nbytes: u64,
    stream: StreamId,
) -> Result<DataPtr> {
    let driver = alloc.driver();
    let copy = alloc.allocate_on(stream, nbytes)?;
    let event = driver.event_create(ctx.device, EventFlags::default())?;
    let ordered = driver
        .copy_device_to_device(stream, copy.ptr(), original.ptr(), nbytes)
        .and_then(|()| {
            let after_enqueue = alloc
                .record_stream(original, stream)
                .and_then(|()| driver.event_record(event, stream));
            if after_enqueue.is_err() {
                if let Err(err) = driver.stream_synchronize(stream) {
                    tracing::warn!(%err, "COW: synchronizing after a failed copy step failed");
                }
            }
            after_enqueue
        });
    match ordered {
        Ok(()) => {
            ctx.copier_events.lock().push(event);
            Ok(copy)
        }
        Err(err) => {
            if let Err(destroy) = driver.event_destroy(event) {
                tracing::warn!(%destroy, "COW: destroying an unused copier event failed");
            }
            Err(err)
        }
    }
}

fn wait_for_stream(
    driver: &Arc<dyn Driver>,
    device: usize,
    waited: StreamId,
    waiter: StreamId,
) -> Result<()> {
    let e = driver.event_create(device, EventFlags::default())?;
    let result = driver
        .event_record(e, waited)
        .and_then(|()| driver.stream_wait_event(waiter, e));
    let destroyed = driver.event_destroy(e);
    result.and(destroyed).map_err(|err| match err {
        Error::InvalidArgument(m) => Error::invalid(format!("COW stream ordering: {m}")),
        other => other,
    })
}
