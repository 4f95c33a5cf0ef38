//! Storages order themselves (`stream_order:auto`, the default): every access through a storage
//! names its stream and whether it reads or writes, and the storage makes it wait for the earlier
//! accesses on other streams it conflicts with — cudarc's rule for its slices, kept per storage
//! for every reader and not only the last.
//!
//! | access on stream `s` | waits for (each on another stream than `s`) | then |
//! |---|---|---|
//! | read | the last writer, unless `s` already read since that write | `s` is a reader |
//! | write | the last writer and every reader since it | `s` is the writer, no readers |
//! | a lazy clone's first write (a copy, or the last reference's steal) | what the hand-over orders (`alloc/engine/handover.rs`) | `s` is the writer of the new memory |
//!
//! A wait is the allocator's one ordering rule ([`Runtime::order_after`](crate::Runtime::order_after)): an event
//! recorded on the earlier stream *now* — after the work the earlier access enqueued, since a
//! program enqueues its kernel before it touches the storage on another stream — and waited for
//! on `s`, across captures too. Every stream that reads or writes is recorded on the memory
//! (`record_stream` by construction): the free waits for it. The fresh memory of an allocation
//! counts as written on its allocation stream.
//!
//! Cost: one atomic load decides the common case, every access on the one stream that used the
//! storage so far; the lock and the waits come only when a second stream takes part.
//!
//! With `stream_order:manual` nothing here runs: PyTorch's rules, the program's `record_stream`
//! and waits, and the sanitizer reports what is missing.
//!
//! Work the storages enqueue themselves (typed host kernels, copies, the pattern kernels) takes
//! its accesses and is queued under the storages' locks ([`enqueue_ordered`]), so no other such
//! work falls between an access and its work; an access inside a capture is kept for the graph,
//! and each replay is ordered as one more access of those storages.
//!
//! A change of the storage's state that depends on an access — a lazy clone (the clone's bytes
//! are the source's as the access saw them), a share with another process, a lazy clone's
//! materialization — takes the access under the same data lock as the change
//! (`Storage::with_access`), so no such work falls between them either.
//!
//! The doors a user reaches first are inside the rule: `data_ptr()` and `mutable_data_ptr()`
//! are the `_on` doors with the current stream. Outside it, the program's to order as in manual
//! mode: work on unordered addresses (`unordered_data_ptr()`, `unordered_mutable_data_ptr()`,
//! `unsafe` on the host backend), captured raw work, and
//! streams of another device. A stream destroyed since its access is
//! not waited for (its work cannot be named any more). Addresses are taken right before the work
//! that uses them is enqueued — as every storage door does — since the wait covers the work
//! queued on the earlier stream when the later access is taken.
//!
//! [`Runtime::order_after`](crate::Runtime::order_after): crate::CachingAllocator

use super::Storage;
use crate::alloc::CapturedUse;
use crate::driver::sanitizer::AccessKind;
use crate::driver::{DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex};
use crate::StreamOrder;

/// No single stream used the storage (two did, or none yet).
const NO_STREAM: u64 = u64::MAX;

/// The streams that used a storage since its last write.
#[derive(Debug)]
pub(super) struct StreamUses {
    /// The stream every access since the last write was on (it wrote last, nobody else read),
    /// or [`NO_STREAM`].
    sole: AtomicU64,
    uses: Mutex<Uses>,
}

#[derive(Debug, Default)]
struct Uses {
    writer: Option<StreamId>,
    /// Streams that read since the last write (each waited for that write), other than it.
    readers: Vec<StreamId>,
}

impl StreamUses {
    /// Memory written (or handed out) last on `writer`.
    pub(super) fn new(writer: Option<StreamId>) -> Self {
        StreamUses {
            sole: AtomicU64::new(writer.map_or(NO_STREAM, |s| s.0)),
            uses: Mutex::new(Uses {
                writer,
                readers: Vec::new(),
            }),
        }
    }

    /// New memory, written on `stream` (a lazy clone's copy, or its steal).
    pub(super) fn reset(&self, stream: StreamId) {
        let mut uses = self.uses.lock();
        uses.writer = Some(stream);
        uses.readers.clear();
        self.sole.store(stream.0, Ordering::Release);
    }
}

impl Storage {
    /// Whether this storage's runtime orders storages (`stream_order:auto`).
    #[inline]
    pub(super) fn orders_itself(&self) -> bool {
        self.allocator().stream_order() == StreamOrder::Auto
    }

    /// Orders an access of `kind` on `stream` after the conflicting earlier ones on other streams
    /// (see the module docs); nothing under `stream_order:manual`.
    #[inline]
    pub(super) fn access(&self, stream: StreamId, kind: AccessKind) -> Result<()> {
        if self.inner.uses.sole.load(Ordering::Acquire) == stream.0 || !self.orders_itself() {
            return Ok(());
        }
        self.access_slow(stream, kind)
    }

    #[cold]
    fn access_slow(&self, stream: StreamId, kind: AccessKind) -> Result<()> {
        // A stream of another device is the program's to order (as in manual mode): events and
        // `record_stream` are per device.
        if self.allocator().driver().stream_device(stream)? != self.inner.device {
            return Ok(());
        }
        self.this_process()?;
        let used = self.order_locked(&mut self.inner.uses.uses.lock(), stream, kind)?;
        // Outside the lock of the uses: `record_stream` takes the storage's data lock, which a
        // lazy clone's first write holds while it resets the uses.
        if used {
            self.used_on(stream)?;
        }
        Ok(())
    }

    /// The rule of the module docs with the uses' lock held: waits and new uses; whether `stream`
    /// is a new use to record for the free.
    fn order_locked(&self, uses: &mut Uses, stream: StreamId, kind: AccessKind) -> Result<bool> {
        let writer = uses.writer.filter(|&w| w != stream);
        match kind {
            AccessKind::Read => {
                if uses.writer == Some(stream) || uses.readers.contains(&stream) {
                    return Ok(false);
                }
                if let Some(w) = writer {
                    self.wait_for(stream, w)?;
                }
                uses.readers.push(stream);
                self.inner.uses.sole.store(NO_STREAM, Ordering::Release);
            }
            AccessKind::Write => {
                for &earlier in writer.iter().chain(&uses.readers) {
                    if earlier != stream {
                        self.wait_for(stream, earlier)?;
                    }
                }
                uses.writer = Some(stream);
                uses.readers.clear();
                self.inner.uses.sole.store(stream.0, Ordering::Release);
            }
        }
        Ok(true)
    }

    /// Runs `change` on the storage's memory under its data lock, after taking the access of
    /// `kind` on `stream` under the same lock and recording `stream` for the free: no work the
    /// storages enqueue (which takes the data lock, [`enqueue_ordered`]) falls between the access
    /// and the change that depends on it (a lazy clone, a share, a materialization). Found by a
    /// hostile round: with the access taken first and the lock after, a kernel queued between
    /// them was neither waited for nor kept off the memory a lazy clone then shared.
    pub(super) fn with_access<R>(
        &self,
        stream: StreamId,
        kind: AccessKind,
        change: impl FnOnce(&mut crate::alloc::DataPtr) -> Result<R>,
    ) -> Result<R> {
        self.with_data(|data| {
            let ordered = self.orders_itself()
                && self.allocator().driver().stream_device(stream)? == self.inner.device
                && self.order_locked(&mut self.inner.uses.uses.lock(), stream, kind)?;
            if ordered && data.allocation_stream() != Some(stream) {
                data.record_stream(stream)?;
            }
            change(data)
        })
    }

    /// Makes `stream` wait for `earlier`; a stream destroyed since is skipped (its work was done
    /// before it went: the allocator's one rule, `alloc/engine/handover.rs`).
    fn wait_for(&self, stream: StreamId, earlier: StreamId) -> Result<()> {
        self.allocator().order_after(stream, earlier)
    }

    /// The memory's free waits for `stream` (`record_stream` by construction; nothing for its own
    /// allocation stream), under one take of the data lock.
    pub(super) fn used_on(&self, stream: StreamId) -> Result<()> {
        self.with_data(|data| {
            if data.allocation_stream() == Some(stream) {
                Ok(())
            } else {
                data.record_stream(stream)
            }
        })
    }
}

/// An operand's memory as one piece of work sees it under the storages' locks.
#[derive(Clone, Copy, Debug)]
pub(super) struct Placement {
    /// The storage's address (after a written lazy clone's materialization).
    pub(super) addr: DeviceAddr,
    /// Whether every access to these bytes is one the storages order: the storage orders
    /// itself, and the memory is a default-pool block this process's allocator owns directly —
    /// not shared copy-on-write, not shared with or received from another process, not in a
    /// private pool (whose freed blocks a graph's replays may write after an eager owner got
    /// them). Typed host kernels see such memory itself (`host_kernel.rs`).
    pub(super) ordered_bytes: bool,
}

/// One piece of work the storages enqueue themselves — a typed host kernel, a copy — on `stream`
/// over `operands` (storages with their modes, in the caller's order; one storage may appear
/// more than once): the accesses are taken and the work is enqueued under the operands' locks,
/// so no other such work on those storages falls between an access and its enqueue (an access
/// waits for an event recorded on the earlier stream at the access: work enqueued there after it
/// would not be waited for — found by review, two threads' kernels overlapping on one storage).
///
/// First a written lazy clone is materialized, each under its own lock, as by
/// `mutable_data_ptr_on` (its copy ordered by the hand-over; the allocation may run observers and
/// callbacks, never under these locks). Then the data locks (in address order; a written operand
/// lazily cloned again meanwhile is materialized again) and the uses locks (in the same order):
/// each access of a storage that orders itself (the rule above; a stream of another device is the
/// program's to order). Then `enqueue` runs with the operands' placements, in the caller's
/// order. Last, still under the locks, `stream` is recorded for each ordered storage's free, and
/// on a stream an allocator is capturing the accesses are kept for the capture's graph, whose
/// replays are ordered with them ([`CapturedUse`]).
///
/// The lock-free path of [`Storage::access`] (one stream so far) serves the raw doors
/// (`data_ptr_on`, `mutable_data_ptr_on`), whose work the caller enqueues later, outside any
/// storage — the `unsafe` escape hatch, ordered by the caller against this work.
pub(super) fn enqueue_ordered<R>(
    operands: &[(&Storage, AccessKind)],
    stream: StreamId,
    enqueue: impl FnOnce(&[Placement]) -> Result<R>,
) -> Result<R> {
    locked(operands, stream, None, enqueue)
}

/// A storage's access inside a capture, kept by the capture's graph (which keeps the storage):
/// each replay is one more access, ordered as [`enqueue_ordered`]'s.
#[derive(Debug)]
struct StorageUse {
    storage: Storage,
    kind: AccessKind,
    /// The address the capture saw: a replay touches it, whatever the storage holds now.
    addr: DeviceAddr,
}

impl CapturedUse for StorageUse {
    fn order_replay(
        &self,
        uses: &[Arc<dyn CapturedUse>],
        stream: StreamId,
        launch: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let ours: Vec<&StorageUse> = uses
            .iter()
            .filter_map(|u| u.as_any().downcast_ref::<StorageUse>())
            .collect();
        let operands: Vec<(&Storage, AccessKind)> =
            ours.iter().map(|u| (&u.storage, u.kind)).collect();
        let expected: Vec<DeviceAddr> = ours.iter().map(|u| u.addr).collect();
        locked(&operands, stream, Some(&expected), |_| launch())
    }

    fn covers(&self, other: &dyn CapturedUse) -> bool {
        other
            .as_any()
            .downcast_ref::<StorageUse>()
            .is_some_and(|o| {
                o.storage.is_alias_of(&self.storage)
                    && o.addr == self.addr
                    && (self.kind == AccessKind::Write || o.kind == AccessKind::Read)
            })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The operands of one piece of work: up to eight without an allocation.
type Few<T> = smallvec::SmallVec<[T; 8]>;

/// [`enqueue_ordered`], or with `replay` (the addresses a capture saw, one per operand) a graph's
/// replay: nothing is materialized, and a storage that no longer holds the captured address, or
/// that a lazy clone now shares while the replay writes it, refuses the replay.
fn locked<R>(
    operands: &[(&Storage, AccessKind)],
    stream: StreamId,
    replay: Option<&[DeviceAddr]>,
    enqueue: impl FnOnce(&[Placement]) -> Result<R>,
) -> Result<R> {
    // Unique storages in address order, each with the strongest mode asked of it.
    let mut unique: Few<(&Storage, AccessKind)> = Few::new();
    for &(storage, kind) in operands {
        match unique.iter_mut().find(|(s, _)| s.is_alias_of(storage)) {
            Some((_, k)) if kind == AccessKind::Write => *k = AccessKind::Write,
            Some(_) => {}
            None => unique.push((storage, kind)),
        }
    }
    unique.sort_by_key(|(s, _)| s.key());
    let index_of = |storage: &Storage| {
        unique
            .iter()
            .position(|(s, _)| s.is_alias_of(storage))
            .unwrap_or_default()
    };
    // A written lazy clone is materialized first, each under its own lock as by
    // `mutable_data_ptr_on` (its copy ordered after the source's writes): the allocation may
    // run observers and free-memory callbacks, which may touch these storages — never with
    // their locks held (found by review: an observer reading another operand deadlocked). Then
    // the data locks; a written operand a lazy clone made copy-on-write again in between is
    // materialized again.
    let mut data: Few<_> = Few::new();
    for attempt in 0.. {
        if replay.is_none() {
            for (storage, kind) in &unique {
                if *kind == AccessKind::Write && storage.is_cow() {
                    storage.mutable_data_ptr_on(stream)?;
                }
            }
        }
        data = unique
            .iter()
            .map(|(s, _)| s.data())
            .collect::<Result<Few<_>>>()?;
        let cow_again = replay.is_none()
            && unique
                .iter()
                .zip(&data)
                .any(|((_, kind), d)| *kind == AccessKind::Write && crate::cow::is_cow(d));
        if !cow_again {
            break;
        }
        data.clear();
        if attempt == 8 {
            return Err(Error::invalid(
                "a storage written here was lazily cloned again at every attempt to give it memory \
                 of its own: the work was not queued",
            ));
        }
    }
    if let Some(expected) = replay {
        for ((storage, kind), &addr) in operands.iter().zip(expected) {
            let data = &data[index_of(storage)];
            if data.ptr() != addr {
                return Err(Error::invalid(format!(
                    "a storage the graph's capture used at {addr} holds {} now (a lazy clone's \
                     first write gave it new memory — inside the capture too: make a lazy \
                     clone's first write before capturing work that reads it): the replay would \
                     touch memory it no longer owns",
                    data.ptr()
                )));
            }
            if *kind == AccessKind::Write && crate::cow::is_cow(data) {
                return Err(Error::invalid(format!(
                    "the graph writes the storage at {addr}, which lazy clones share now: the \
                     replay would change the clones"
                )));
            }
        }
    }
    let mut ordered: Few<bool> = unique.iter().map(|_| false).collect();
    // Held until the work is enqueued and recorded (see `enqueue_ordered`).
    let mut uses: Few<_> = unique
        .iter()
        .map(|(s, _)| s.inner.uses.uses.lock())
        .collect();
    // The stream's device, asked of the driver once (and only when a storage orders itself).
    let mut stream_device = None;
    for (((storage, kind), uses), ordered) in unique.iter().zip(&mut uses).zip(&mut ordered) {
        if !storage.orders_itself() {
            continue;
        }
        let device = match stream_device {
            Some(device) => device,
            None => *stream_device.insert(storage.allocator().driver().stream_device(stream)?),
        };
        if device == storage.inner.device {
            *ordered = storage.order_locked(uses, stream, *kind)?;
        }
    }
    let placements: Few<Placement> = operands
        .iter()
        .map(|(storage, _)| {
            let data = &data[index_of(storage)];
            Placement {
                addr: data.ptr(),
                ordered_bytes: storage.orders_itself()
                    && data.own_block().is_some_and(|b| b.in_default_pool()),
            }
        })
        .collect();
    let out = enqueue(&placements)?;
    for (data, _) in data.iter().zip(&ordered).filter(|(_, &o)| o) {
        if data.allocation_stream() != Some(stream) {
            data.record_stream(stream)?;
        }
    }
    if replay.is_none() {
        note_if_captured(&unique, &data, stream)?;
    }
    drop(uses);
    Ok(out)
}

/// On a capturing stream, keeps each access for the capture's graph, in the allocator that began
/// the capture (another runtime's too). A capture begun on the driver alone keeps nothing: its
/// replays are raw (`unsafe`) and the caller's to order.
fn note_if_captured(
    unique: &[(&Storage, AccessKind)],
    data: &[crate::sync::os::MutexGuard<'_, crate::alloc::DataPtr>],
    stream: StreamId,
) -> Result<()> {
    let Some(&(first, _)) = unique.first() else {
        return Ok(());
    };
    if !crate::alloc::any_capture_under_way() {
        return Ok(());
    }
    let status = first
        .allocator()
        .driver()
        .graphs()
        .stream_capture_status(stream)?;
    let Some(capture) = status.capture_id() else {
        return Ok(());
    };
    for ((storage, kind), data) in unique.iter().zip(data) {
        let used: Arc<dyn CapturedUse> = Arc::new(StorageUse {
            storage: (*storage).clone(),
            kind: *kind,
            addr: data.ptr(),
        });
        if !crate::alloc::note_captured_use(capture, used) {
            tracing::debug!(
                capture,
                "an access inside a capture no allocator began: its replays are not ordered"
            );
        }
    }
    Ok(())
}
