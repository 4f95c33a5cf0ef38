//! The COW context of device memory: the generic [`CowCell`] holding the original `DataPtr`, plus
//! what stream ordering needs (the stream current at lazy-clone time).
//!
//! A copier records its stream on the original (as `record_stream` would), and so does every
//! clone read on another stream. The last reference's steal is a change of owner without a free:
//! the allocator's hand-over (`alloc/engine/handover.rs`) makes the stealing stream wait for every stream
//! recorded on the original — copiers and readers of clones dropped since alike.

use super::cell::{CowCell, Materialized};
use crate::alloc::{take_shared, CachingAllocator, DataPtr, Owner, SharedOwner};
use crate::driver::{DeviceAddr, Sanitizer, StreamId};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::sync::os::{Arc, Mutex};

/// Shared state of a set of COW storages.
#[derive(Debug)]
pub(crate) struct CowContext {
    cell: CowCell<DataPtr>,
    clone_stream: StreamId,
    /// The process of the lazy clone: a forked child's copy releases nothing (`process`).
    birth: Birth,
    /// The stream sanitizer, told while lazy clones share the memory (a write into it is
    /// reported) and when they no longer do.
    sanitizer: Option<Arc<Sanitizer>>,
    /// Held (with the sanitizer on) across a change of the count and what the sanitizer is told
    /// of it, so a clone made while another reference lets go is never told last as "alone".
    telling: Mutex<()>,
}

impl CowContext {
    /// Tells the sanitizer (when on) whether the original's memory is shared now: by two or more
    /// references, or — `false` — by one alone (it may be written through any pointer of it).
    fn tell_sharing(&self, ptr: DeviceAddr, shared: bool) {
        if let Some(s) = &self.sanitizer {
            s.cow_shared(ptr.0, shared);
        }
    }

    /// After a reference was given up: the one left alone owns the memory's bytes.
    fn tell_if_alone(&self, ptr: DeviceAddr) {
        if self.sanitizer.is_some() {
            let _telling = self.telling.lock();
            if self.cell.refs() == 1 {
                self.tell_sharing(ptr, false);
            }
        }
    }

    /// One more reference (a lazy clone); `tell`: the sanitizer is told the memory is shared.
    fn add_ref(&self, ptr: DeviceAddr, tell: bool) {
        if self.sanitizer.is_none() {
            self.cell.add_ref();
            return;
        }
        let _telling = self.telling.lock();
        self.cell.add_ref();
        if tell {
            self.tell_sharing(ptr, true);
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
            match self.ctx.cell.release() {
                Some(original) => drop(original),
                None => {
                    let ptr = self.ctx.cell.with_data(|d| d.map(DataPtr::ptr));
                    if let Some(ptr) = ptr {
                        self.ctx.tell_if_alone(ptr);
                    }
                }
            }
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
/// `tell`: a lazy clone the program reads, so the sanitizer reports writes into the shared memory
/// (a transfer engine's pin of the memory is not).
pub(crate) fn lazy_clone(
    alloc: &CachingAllocator,
    data: &mut DataPtr,
    tell: bool,
) -> Result<Option<DataPtr>> {
    let ptr = data.ptr();
    let device = data.device();
    if let Some(owner) = data.shared_owner::<CowOwner>() {
        owner.ctx.add_ref(ptr, tell);
        let ctx = Arc::clone(&owner.ctx);
        return Ok(Some(DataPtr::new(ptr, device, cow_owner(&ctx))));
    }
    let ctx = if matches!(data.owner(), Owner::Block(_)) {
        let clone_stream = alloc.current_stream(device)?;
        let original = std::mem::replace(data, DataPtr::empty(device));
        let ctx = Arc::new(CowContext {
            cell: CowCell::new(original, 2),
            birth: Birth::now(),
            clone_stream,
            sanitizer: alloc.driver().sanitizer(),
            telling: Mutex::new(()),
        });
        *data = DataPtr::new(ptr, device, cow_owner(&ctx));
        ctx
    } else {
        return Ok(None);
    };
    if tell {
        ctx.tell_sharing(ptr, true);
    }
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
/// `stream` afterwards is ordered after it. Returns the address to write, and whether anything
/// was queued (a copy, or waits for other streams: `false` for a steal whose memory only `stream`
/// used). Memory that is not a COW view is left alone. On error `data` is still a valid COW view
/// (the reference was not given up).
pub(crate) fn materialize(
    alloc: &CachingAllocator,
    data: &mut DataPtr,
    nbytes: u64,
    stream: StreamId,
) -> Result<(DeviceAddr, bool)> {
    // The source's tag sleeps: nothing to copy from (`src/runtime/sleep.rs`).
    data.check_awake("materializing a lazy clone")?;
    let device = data.device();
    let shared_ptr = data.ptr();
    // Take the owner out (no refcount traffic); every early return puts it back.
    let mut owner =
        match take_shared::<CowOwner>(std::mem::replace(data, DataPtr::empty(device)).into_owner())
        {
            Ok(owner) => owner,
            Err(other) => {
                // Not (or no longer) a COW view.
                *data = DataPtr::new(shared_ptr, device, other);
                return Ok((shared_ptr, false));
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
        // After the source's writes on the stream current at lazy-clone time, across captures
        // too (the allocator's one rule for ordering streams: `alloc/engine/handover.rs`).
        alloc
            .order_after(stream, ctx.clone_stream)
            .map_err(|err| match err {
                Error::InvalidArgument(m) => Error::invalid(format!("COW stream ordering: {m}")),
                other => other,
            })?;
        // The last reference steals the memory only where every stream that used it can be
        // waited for; else it copies and the original is freed (its free waits for them). The
        // hand-over reads the recorded streams again when it steals: another reference may
        // record one and let go between this check and the decrement.
        let steal = ctx.cell.with_data(|original| {
            original
                .and_then(DataPtr::block_owner)
                .is_none_or(|block| block.can_hand_over_in_place(stream))
        });
        ctx.cell.materialize_or_copy(steal, |original| {
            copy_step(alloc, original, nbytes, stream, capturing)
        })
    }));
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(panic) => {
            *data = DataPtr::new(shared_ptr, device, Owner::Shared(owner));
            std::panic::resume_unwind(panic);
        }
    };
    let (new_data, queued) = match outcome {
        Ok(Materialized::Stole(original)) => {
            // The reference is given up: from here nothing may fail. A change of owner without
            // a free: our stream waits for every stream that used the memory (`alloc/engine/handover.rs`).
            let handed = original
                .block_owner()
                .is_some_and(|block| block.hand_over_in_place(stream));
            ctx.tell_sharing(shared_ptr, false);
            (original, handed || stream != ctx.clone_stream)
        }
        Ok(Materialized::Copied(copy)) => {
            ctx.tell_if_alone(shared_ptr);
            (copy, true)
        }
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
    Ok((ptr, queued))
}

/// Copier: the whole fallible copy step, done before the reference is given up. Allocates the
/// copy on `stream`, enqueues the device copy there and marks the source as used by `stream` (its
/// free, or a stealer, waits for it: `alloc/engine/handover.rs`). If marking fails after the enqueue, the
/// stream is synchronized (so the abandoned copy cannot read the source after a stealer writes
/// it) and the error returned — the caller's storage stays COW. `capturing`: `stream` is being
/// captured (asked once by `materialize`): the copy is recorded into the graph (its memory from
/// the graph's pool), not run, and each replay reads the source as it is then — the source is
/// the graph's input.
fn copy_step(
    alloc: &CachingAllocator,
    original: &DataPtr,
    nbytes: u64,
    stream: StreamId,
    capturing: bool,
) -> Result<DataPtr> {
    let driver = alloc.driver();
    let copy = alloc.allocate_on(stream, nbytes)?;
    crate::driver::sanitizer::labelled(
        "the copy-on-write copy of a lazy clone's first write",
        // SAFETY: the copy-on-write copy: `copy` is a fresh block no one else holds, `original` is read only (memory lazy clones share is never written: writes materialize first).
        || unsafe { driver.copy_device_to_device(stream, copy.ptr(), original.ptr(), nbytes) },
    )?;
    if let Err(err) = alloc.record_stream(original, stream) {
        if !capturing {
            if let Err(err) = driver.stream_synchronize(stream) {
                tracing::warn!(%err, "COW: synchronizing after a failed copy step failed");
            }
        }
        return Err(err);
    }
    Ok(copy)
}
