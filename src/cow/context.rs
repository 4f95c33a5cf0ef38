//! The COW context of device memory: the generic [`CowCell`] holding the original `DataPtr`, plus
//! what stream ordering needs (the stream current at lazy-clone time, the copiers' events).

use super::cell::{CowCell, Materialized};
use crate::alloc::{take_shared, CachingAllocator, DataPtr, Owner, SharedOwner};
use crate::driver::{DeviceAddr, Driver, EventFlags, EventId, StreamId};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::{Arc, Mutex};

/// Shared state of a set of COW storages.
#[derive(Debug)]
pub(crate) struct CowContext {
    cell: CowCell<DataPtr>,
    device: usize,
    clone_stream: StreamId,
    copier_events: Mutex<Vec<EventId>>,
    driver: Arc<dyn Driver>,
    /// The process of the lazy clone: a forked child's copy releases nothing (`process`).
    birth: Birth,
}

impl Drop for CowContext {
    fn drop(&mut self) {
        crate::process::leak_in_child(self.birth, &mut self.copier_events);
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

impl Drop for CowOwner {
    fn drop(&mut self) {
        if self.armed && self.ctx.birth.is_current() {
            // The last reference frees the original (its block's free waits for copier streams).
            drop(self.ctx.cell.release());
        }
    }
}

impl SharedOwner for CowOwner {
    fn label(&self) -> &'static str {
        "cow"
    }

    fn record_stream(&self, stream: StreamId) -> Result<()> {
        // Recorded on the shared original: whoever frees it last waits for `stream`.
        self.ctx.cell.with_data(|original| match original {
            Some(d) => d.record_stream(stream),
            None => Ok(()),
        })
    }

    fn check_awake(&self, what: &str) -> Result<()> {
        self.ctx.cell.with_data(|original| match original {
            Some(d) => d.check_awake(what),
            None => Ok(()),
        })
    }
}

/// Whether `data` is a COW view (its owner is a reference on a COW context).
pub(crate) fn is_cow(data: &DataPtr) -> bool {
    data.shared_owner::<CowOwner>().is_some()
}

/// A lazy clone of the memory of `data` (a storage's `DataPtr`, its lock held): converts `data` to
/// a COW view in place on its first lazy clone (or adds one reference to its context) and returns
/// the clone's `DataPtr`. `None` when the memory cannot be shared copy-on-write — memory shared
/// with other processes (see the module docs): the caller makes an eager copy instead.
pub(crate) fn lazy_clone(alloc: &CachingAllocator, data: &mut DataPtr) -> Result<Option<DataPtr>> {
    let ptr = data.ptr();
    let device = data.device();
    let ctx = if let Some(owner) = data.shared_owner::<CowOwner>() {
        owner.ctx.cell.add_ref();
        Arc::clone(&owner.ctx)
    } else if matches!(data.owner(), Owner::Block(_)) {
        let clone_stream = alloc.current_stream(device)?;
        let original = std::mem::replace(data, DataPtr::empty(device));
        let ctx = Arc::new(CowContext {
            cell: CowCell::new(original, 2),
            birth: Birth::now(),
            device,
            clone_stream,
            copier_events: Mutex::new(Vec::new()),
            driver: Arc::clone(alloc.driver()),
        });
        *data = DataPtr::new(ptr, device, cow_owner(&ctx));
        ctx
    } else {
        return Ok(None);
    };
    Ok(Some(DataPtr::new(ptr, device, cow_owner(&ctx))))
}

fn cow_owner(ctx: &Arc<CowContext>) -> Owner {
    Owner::Shared(Box::new(CowOwner {
        ctx: Arc::clone(ctx),
        armed: true,
    }))
}

/// Materializes the COW view `data` (a storage's `DataPtr` of `nbytes`, its lock held) for
/// writing on `stream`: the copy (or the steal's waits) is enqueued there, so work queued on
/// `stream` afterwards is ordered after it. Returns the address to write. Memory that is not a
/// COW view is left alone. On error `data` is still a valid COW view (the reference was not
/// given up).
pub(crate) fn materialize(
    alloc: &CachingAllocator,
    data: &mut DataPtr,
    nbytes: u64,
    stream: StreamId,
) -> Result<DeviceAddr> {
    // The source's tag sleeps: nothing to copy from (`src/runtime/sleep.rs`).
    data.check_awake("materializing a lazy clone")?;
    let device = data.device();
    let shared_ptr = data.ptr();
    let driver = alloc.driver();
    // Take the owner out (no refcount traffic); every early return puts it back.
    let mut owner =
        match take_shared::<CowOwner>(std::mem::replace(data, DataPtr::empty(device)).into_owner())
        {
            Ok(owner) => owner,
            Err(other) => {
                // Not (or no longer) a COW view.
                *data = DataPtr::new(shared_ptr, device, other);
                return Ok(shared_ptr);
            }
        };
    let ctx = Arc::clone(&owner.ctx);
    // Inside a capture, work outside it cannot be waited for from the capturing stream (CUDA's
    // capture isolation): it is waited for on the host, with this thread's capture mode relaxed.
    let capturing = match alloc.stream_is_capturing(stream) {
        Ok(capturing) => capturing,
        Err(err) => {
            *data = DataPtr::new(shared_ptr, device, Owner::Shared(owner));
            return Err(err);
        }
    };
    // The copy step runs before the reference is given up; should it panic (the stream
    // sanitizer's panic mode), the storage gets its COW owner back before the panic goes on.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if stream != ctx.clone_stream {
            if capturing && !alloc.stream_is_capturing(ctx.clone_stream)? {
                relaxed(driver, || driver.stream_synchronize(ctx.clone_stream))?;
            } else {
                wait_for_stream(driver, ctx.clone_stream, stream)?;
            }
        }
        ctx.cell
            .materialize(|original| copy_step(alloc, &ctx, original, nbytes, stream, capturing))
    }));
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(panic) => {
            *data = DataPtr::new(shared_ptr, device, Owner::Shared(owner));
            std::panic::resume_unwind(panic);
        }
    };
    let new_data = match outcome {
        Ok(Materialized::Stole(original)) => {
            // The reference is given up: from here nothing may fail. Our stream waits for
            // every copier; if a wait cannot be enqueued, block on the event instead. Inside a
            // capture the copiers' events (recorded outside it) are waited for on the host.
            for &e in ctx.copier_events.lock().iter() {
                if capturing {
                    if let Err(err) = relaxed(driver, || driver.event_synchronize(e)) {
                        tracing::warn!(%err, "COW steal inside a capture: waiting for a copier failed");
                    }
                } else if let Err(err) = driver.stream_wait_event(stream, e) {
                    tracing::warn!(%err, "COW steal: waiting on the host instead");
                    let _ = driver.event_synchronize(e);
                }
            }
            original
        }
        Ok(Materialized::Copied(copy)) => copy,
        Err(err) => {
            // Still a valid COW storage (the reference was not given up).
            *data = DataPtr::new(shared_ptr, device, Owner::Shared(owner));
            return Err(err);
        }
    };
    // `materialize` already gave our reference up: disarm the old owner before it drops.
    owner.armed = false;
    drop(owner);
    let ptr = new_data.ptr();
    *data = new_data;
    Ok(ptr)
}

/// Copier: the whole fallible copy step, done before the reference is given up. Allocates the
/// copy on `stream`, enqueues the device copy there, marks the source as used by `stream` (its free
/// waits) and records an event after the copy (a later stealer waits on it). The event is created
/// before anything is enqueued; if the bookkeeping after the enqueue fails, the stream is
/// synchronized (so the abandoned copy cannot read the source after a stealer writes it) and the
/// error returned — the caller's storage stays COW. `capturing`: `stream` is being captured (asked
/// once by `materialize`), so the copy is the graph's and records no event.
fn copy_step(
    alloc: &CachingAllocator,
    ctx: &CowContext,
    original: &DataPtr,
    nbytes: u64,
    stream: StreamId,
    capturing: bool,
) -> Result<DataPtr> {
    let driver = alloc.driver();
    let copy = alloc.allocate_on(stream, nbytes)?;
    if capturing {
        // The copy is recorded into the graph (its memory from the graph's pool), not run: no
        // eager work will read the source for it, so a stealer has nothing to wait for — and an
        // event recorded here would be a point of the capture, which a stealer's wait outside it
        // would join. Each replay reads the source as it is then: the source is the graph's input.
        driver.copy_device_to_device(stream, copy.ptr(), original.ptr(), nbytes)?;
        alloc.record_stream(original, stream)?;
        return Ok(copy);
    }
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

/// Runs `f` with this thread's capture interaction mode relaxed (a host wait for work outside a
/// capture, which a global capture would otherwise forbid), restoring it after.
fn relaxed<R>(driver: &Arc<dyn Driver>, f: impl FnOnce() -> R) -> R {
    let before = driver.exchange_capture_mode(crate::driver::CaptureMode::Relaxed);
    let out = f();
    driver.exchange_capture_mode(before);
    out
}

fn wait_for_stream(driver: &Arc<dyn Driver>, waited: StreamId, waiter: StreamId) -> Result<()> {
    driver
        .stream_wait_stream(waiter, waited)
        .map_err(|err| match err {
            Error::InvalidArgument(m) => Error::invalid(format!("COW stream ordering: {m}")),
            other => other,
        })
}
