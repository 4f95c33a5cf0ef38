//! [`Storage`]: the unit of aliasing, and the one place that knows every kind of memory.
//!
//! Storages alias **iff** they are clones of one `Storage`. A storage holds its [`DataPtr`] under
//! a lock, an atomic *address word* (the address with a COW tag in bit 0, so the address of a plain
//! storage is one atomic load), and its [`Runtime`] (allocator + IPC state). The layers
//! below work on `DataPtr`s only; this module decides which `Storage` a receipt returns
//! (`registry.rs`) and orders the steps of sharing a COW storage (`sharing.rs`).
//!
//! States (the owner of its `DataPtr`) and transitions — every operation takes the storage's lock
//! for its whole transition, so no other thread sees a state in between:
//!
//! | state    | owner                       | address word        |
//! |----------|-----------------------------|---------------------|
//! | plain    | allocator block (or none)   | address, tag clear  |
//! | COW      | reference on a COW context  | shared address, tag set |
//! | shared   | IPC sent data (keeps the block) | address, tag clear |
//! | received | IPC lease on another process's memory | address, tag clear |
//!
//! | operation on a storage in state → | plain | COW | shared | received |
//! |---|---|---|---|---|
//! | `lazy_clone()` | → COW (context of 2); the clone is COW | +1 reference; the clone is COW | unchanged; the clone is a plain eager copy | unchanged; the clone is a plain eager copy |
//! | `mutable_data_ptr_on()` | unchanged (one load) | → plain: steal if last, else copy | unchanged | unchanged |
//! | `share_ipc()` | → shared (slot, event) | materialize (→ plain), → shared, copy completed | +1 pending on its slot | forwarded: +1 pending on the original slot |
//! | `from_ipc()` | — | — | same process: this storage | another process: → received (or the storage already open) |
//! | drop (last clone) | block freed | −1 reference (last frees) | limbo while counted, else freed | lease released after its streams |
//!
//! Copies to and from host memory (pageable and pinned) live in `copies.rs`; typed host kernels over storages
//! in `host_kernel.rs`.
//!
//! In a process forked from the storage's, every door that takes one of its locks is refused
//! ([`Error::ForkedChild`]) before the lock — a thread of the parent may have held it at the
//! fork: the locks are reached only through `Storage::data` and the ordering's `uses`, which
//! check first. The few doors that return no `Result` answer as for memory they know nothing
//! of (`allocation_stream`: `None`; `is_received`: `false`); a drop releases nothing there.
//!
//! A lazy clone of shared memory is an eager copy because the memory is an alias of other
//! processes' storages (see `cow/mod.rs`); sharing a COW storage materializes it first because a
//! consumer may write.

mod copies;
pub mod host_kernel;
pub mod kernel;
mod order;
mod registry;
mod sharing;
#[cfg(feature = "cudarc")]
pub mod views;

use std::fmt;

use crate::alloc::DataPtr;
use crate::driver::sanitizer::AccessKind;
use crate::driver::{DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::ipc::IpcHandle;
use crate::runtime::Runtime;
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex, MutexGuard, Weak};

/// Bit 0 of the address word: the storage is a COW view (set by lazy clones).
const COW_TAG: u64 = 1;

struct StorageInner {
    /// Address with the COW tag in bit 0.
    word: AtomicU64,
    nbytes: u64,
    device: usize,
    data: Mutex<DataPtr>,
    runtime: Arc<Runtime>,
    /// The streams that used it, for ordering its accesses (`order.rs`).
    uses: order::StreamUses,
}

/// The unit of aliasing: clones share the same data; distinct storages never alias (until lazy
/// clones, which share data copy-on-write).
#[derive(Clone)]
pub struct Storage {
    inner: Arc<StorageInner>,
}

/// A weak reference to a storage (caches of shared and received storages).
#[derive(Clone)]
pub(crate) struct WeakStorage(Weak<StorageInner>);

impl fmt::Debug for WeakStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WeakStorage(alive: {})", self.0.strong_count() > 0)
    }
}

impl WeakStorage {
    pub(crate) fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }

    pub(crate) fn upgrade(&self) -> Option<Storage> {
        self.0.upgrade().map(|inner| Storage { inner })
    }
}

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Storage")
            .field("ptr", &self.unordered_data_ptr())
            .field("nbytes", &self.inner.nbytes)
            .field("device", &self.inner.device)
            .finish()
    }
}

impl Storage {
    /// Allocates `nbytes` on `device`'s current stream (0 bytes: a valid empty storage).
    pub fn new(runtime: &Arc<Runtime>, device: usize, nbytes: u64) -> Result<Self> {
        let data = runtime.allocate(device, nbytes)?;
        Ok(Self::from_data_ptr(runtime, data, nbytes))
    }

    /// Allocates `nbytes` for use on `stream` (its device), whatever stream is current — no
    /// [`StreamGuard`](crate::StreamGuard) needed. The memory is ordered for `stream`: work
    /// queued there may use it at once; another stream must wait for `stream` first.
    pub fn new_on(runtime: &Arc<Runtime>, stream: StreamId, nbytes: u64) -> Result<Self> {
        let data = runtime.allocate_on(stream, nbytes)?;
        Ok(Self::from_data_ptr(runtime, data, nbytes))
    }

    /// Wraps memory already owned by `data` (of at least `nbytes`: the callers' allocations —
    /// not public, since a larger `nbytes` would let a kernel see a neighbour's bytes).
    pub(crate) fn from_data_ptr(runtime: &Arc<Runtime>, data: DataPtr, nbytes: u64) -> Self {
        let written_on = data.allocation_stream();
        Self::written_on(runtime, data, nbytes, written_on)
    }

    /// Wraps `data`, whose bytes are ready on `stream` (an allocation's stream, a lazy clone's
    /// current stream, a receipt's): other streams' accesses wait for it (`order.rs`).
    fn written_on(
        runtime: &Arc<Runtime>,
        data: DataPtr,
        nbytes: u64,
        stream: Option<StreamId>,
    ) -> Self {
        Storage {
            inner: Arc::new(StorageInner {
                word: AtomicU64::new(data.ptr().0),
                nbytes,
                device: data.device(),
                uses: order::StreamUses::new(stream),
                data: Mutex::new(data),
                runtime: Arc::clone(runtime),
            }),
        }
    }

    /// The stream the memory was allocated on (`None` for memory not from this process's
    /// allocator: received from another process, or empty; and in a forked child).
    pub fn allocation_stream(&self) -> Option<StreamId> {
        self.data().ok()?.allocation_stream()
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> u64 {
        self.inner.nbytes
    }

    /// Device ordinal.
    pub fn device(&self) -> usize {
        self.inner.device
    }

    /// The runtime (allocator and IPC state) the storage belongs to.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.inner.runtime
    }

    /// The allocator that owns the memory.
    pub(crate) fn allocator(&self) -> &Arc<crate::alloc::CachingAllocator> {
        self.inner.runtime.allocator()
    }

    /// The address for reading on the current stream (PyTorch's `data_ptr`, ordered): as
    /// [`data_ptr_on`](Self::data_ptr_on) with the device's current stream, so a kernel
    /// launched there after this call reads what earlier work on any stream wrote. A kernel on
    /// another stream takes its address with [`data_ptr_on`](Self::data_ptr_on).
    #[inline]
    pub fn data_ptr(&self) -> Result<DeviceAddr> {
        self.data_ptr_on(self.stream()?)
    }

    /// The address as it is now, **ordered by nothing**: no stream waits for another, the
    /// storage's free does not wait for the work that uses it, a lazy clone's address is the
    /// memory it shares. For what needs the number and no access — comparing addresses, logging,
    /// a lookup —, or work the caller orders itself (`record_stream`, events). The ordered doors
    /// are [`data_ptr`](Self::data_ptr) and [`data_ptr_on`](Self::data_ptr_on).
    #[inline]
    pub fn unordered_data_ptr(&self) -> DeviceAddr {
        DeviceAddr(self.inner.word.load(Ordering::Acquire) & !COW_TAG)
    }

    /// The address for reading on `stream`: with `stream_order:auto` (the default) `stream` first
    /// waits for the last write on another stream, and the storage's free waits for `stream`
    /// (`storage/order.rs`). Never materializes. One atomic load when `stream` is the only one
    /// that used the storage.
    #[inline]
    pub fn data_ptr_on(&self, stream: StreamId) -> Result<DeviceAddr> {
        self.access(stream, AccessKind::Read)?;
        Ok(self.unordered_data_ptr())
    }

    /// The registered regions holding this storage's bytes, for a transfer that *reads* them
    /// (never materializes a lazy clone): each is a region's token (its [`SegmentId`]) plus an
    /// offset and a length — one region for a storage in a whole segment, one per page it spans
    /// in an expandable one (`src/alloc/registration.rs`). An error for a received storage (its
    /// memory is another process's to register) or an empty one.
    ///
    /// [`SegmentId`]: crate::registration::SegmentId
    pub fn registered_regions(&self) -> Result<Vec<crate::registration::RegisteredRegion>> {
        self.regions_at(self.unordered_data_ptr())
    }

    /// As [`registered_regions`](Self::registered_regions), for a transfer that *writes* the
    /// storage: a lazy clone is materialized first, as by
    /// [`unordered_mutable_data_ptr`](Self::unordered_mutable_data_ptr) (a transfer engine's
    /// work is outside stream order).
    pub fn registered_regions_mut(&self) -> Result<Vec<crate::registration::RegisteredRegion>> {
        let addr = self.unordered_mutable_data_ptr()?;
        self.regions_at(addr)
    }

    /// Keeps the storage's memory as it is now alive and in place for work outside stream order
    /// (a transfer engine's): the returned pin holds it even if the storage is written (and so
    /// materialized elsewhere) or dropped meanwhile. `None` when the storage alone keeps it.
    #[cfg(feature = "nixl")]
    pub(crate) fn pin_memory(&self) -> Result<Option<Storage>> {
        sharing::pin_memory(self)
    }

    fn regions_at(&self, addr: DeviceAddr) -> Result<Vec<crate::registration::RegisteredRegion>> {
        if self.inner.nbytes == 0 {
            return Err(Error::invalid("an empty storage has no registered region"));
        }
        self.check_awake("a lookup of registered regions")?;
        if self.is_received() {
            return Err(Error::invalid(
                "a received storage is another process's memory: that process registers it",
            ));
        }
        self.allocator()
            .registered_regions(self.inner.device, addr, self.inner.nbytes)
    }

    /// The address for writing on the current stream (PyTorch's `mutable_data_ptr`, ordered):
    /// as [`mutable_data_ptr_on`](Self::mutable_data_ptr_on) with the device's current stream —
    /// a lazy clone's copy is queued there, and the stream waits for every earlier access of the
    /// storage on other streams. A kernel on another stream takes its address with
    /// [`mutable_data_ptr_on`](Self::mutable_data_ptr_on).
    #[inline]
    pub fn mutable_data_ptr(&self) -> Result<DeviceAddr> {
        self.mutable_data_ptr_on(self.stream()?)
    }

    /// The address for writing, **ordered by nothing** but the storage's own copy: a plain
    /// storage's address is one atomic load; a COW storage is materialized first (see
    /// `src/cow/mod.rs`) on the current stream, and that copy is *complete* when this returns
    /// (inside a stream capture the copy becomes part of the graph instead, and nothing
    /// blocks). No stream waits for the storage's other accesses and its free does not wait for
    /// the writer: the caller orders its work itself (`record_stream`, events). The ordered
    /// doors are [`mutable_data_ptr`](Self::mutable_data_ptr) and
    /// [`mutable_data_ptr_on`](Self::mutable_data_ptr_on). On error of the copy (out of memory)
    /// the storage stays a valid COW storage; an error of the synchronization after it (a
    /// failed stream) is returned with the storage already private.
    #[inline]
    pub fn unordered_mutable_data_ptr(&self) -> Result<DeviceAddr> {
        let word = self.inner.word.load(Ordering::Acquire);
        if word & COW_TAG == 0 {
            return Ok(DeviceAddr(word));
        }
        let stream = self.stream()?;
        let (ptr, queued) = self.with_data(|data| self.materialize_locked(data, stream))?;
        // Nothing queued (a steal of memory only `stream` used): nothing to wait for. Inside a
        // capture the copy is a node of the graph, run by each replay before the captured work
        // after it: there is nothing to wait for either (and waiting is forbidden).
        if queued && !self.allocator().stream_is_capturing(stream)? {
            self.runtime().driver().stream_synchronize(stream)?;
        }
        Ok(ptr)
    }

    /// The address for writing on `stream`: a COW storage's copy (or its steal's waits) is
    /// enqueued on `stream`, so work queued there afterwards sees the private copy, without
    /// blocking. With `stream_order:auto` (the default) `stream` first waits for every earlier
    /// read and write of the storage on other streams, and the storage's free waits for
    /// `stream` (`storage/order.rs`); with `manual`, another stream must wait for `stream`
    /// before touching the storage. Two atomic loads when the storage is not COW and `stream` is
    /// the only one that used it.
    #[inline]
    pub fn mutable_data_ptr_on(&self, stream: StreamId) -> Result<DeviceAddr> {
        let word = self.inner.word.load(Ordering::Acquire);
        if word & COW_TAG == 0 {
            self.access(stream, AccessKind::Write)?;
            return Ok(DeviceAddr(word));
        }
        // Orders the copy after the writes before the lazy clone (`cow`), then the new memory is
        // written on `stream` alone (`materialize_locked`).
        self.with_access(stream, AccessKind::Read, |data| {
            self.materialize_locked(data, stream)
        })
        .map(|(ptr, _)| ptr)
    }

    /// Materializes a COW storage with its lock held (`data` is its `DataPtr`) on `stream` and
    /// publishes the new address; a storage that is not COW is left alone. Also says whether
    /// work was queued on `stream` (`cow::materialize`).
    fn materialize_locked(
        &self,
        data: &mut DataPtr,
        stream: StreamId,
    ) -> Result<(DeviceAddr, bool)> {
        let was_cow = crate::cow::is_cow(data);
        let (ptr, queued) =
            crate::cow::materialize(self.allocator(), data, self.inner.nbytes, stream)?;
        self.set_cow_word(ptr, false);
        if was_cow {
            // Memory of its own now (a copy, or the steal's), written on `stream`: the uses of
            // the shared memory are the hand-over's (`order.rs`). Every caller goes through here.
            self.inner.uses.reset(stream);
        }
        Ok((ptr, queued))
    }

    /// A lazy clone: a new storage sharing this one's data copy-on-write (converting this storage
    /// to COW on its first lazy clone). Not an alias: writes to either stay private.
    pub fn lazy_clone(&self) -> Result<Storage> {
        // A read on the current stream, taken with the clone: the copy of the first write
        // follows it (`cow`).
        sharing::lazy_clone(self, self.stream()?)
    }

    /// Whether the storage shares its data copy-on-write.
    pub fn is_cow(&self) -> bool {
        self.inner.word.load(Ordering::Acquire) & COW_TAG != 0
    }

    /// Sets or clears the COW tag; clearing also publishes the (possibly new) address. Called with
    /// the storage's data lock held, `ptr` being the new address.
    fn set_cow_word(&self, ptr: DeviceAddr, cow: bool) {
        let tag = if cow { COW_TAG } else { 0 };
        self.inner.word.store(ptr.0 | tag, Ordering::Release);
    }

    /// Whether `self` and `other` are the same storage (aliases).
    pub fn is_alias_of(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The storage's identity as a number (its aliases share it): the order its locks are taken
    /// in when one piece of work holds several (`order.rs`).
    fn key(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Marks the storage's memory as used on `stream` (see [`Runtime::record_stream`](crate::Runtime::record_stream)).
    /// For a received storage, the lease is released only after `stream`'s work is done.
    pub fn record_stream(&self, stream: StreamId) -> Result<()> {
        self.data()?.record_stream(stream)
    }

    /// Shares this storage with other processes: the returned handle owns one count on the
    /// storage's slot (see `src/ipc/mod.rs`). Sharing a received storage forwards it.
    pub fn share_ipc(&self) -> Result<IpcHandle> {
        // Consumers read after an event of the current stream: it follows the last write (the
        // read access is taken with the share, under the storage's lock).
        sharing::share(self)
    }

    /// Opens a handle from another process (or returns the original storage in the producer's own
    /// process, or the already-open storage in this one). The storage waits for the producer's
    /// event on the current stream before any work queued after this call.
    pub fn from_ipc(runtime: &Arc<Runtime>, handle: IpcHandle) -> Result<Storage> {
        sharing::receive(runtime, handle)
    }

    /// Whether the memory came from another process (`false` in a forked child).
    pub fn is_received(&self) -> bool {
        self.data().is_ok_and(|data| crate::ipc::is_received(&data))
    }

    pub(crate) fn downgrade(&self) -> WeakStorage {
        WeakStorage(Arc::downgrade(&self.inner))
    }

    /// `Ok` in the storage's process; [`Error::ForkedChild`] in a forked child — asked before
    /// any of the storage's locks is taken.
    #[inline]
    pub(crate) fn this_process(&self) -> Result<()> {
        self.allocator().check_process("this storage")
    }

    /// The storage's `DataPtr`, locked, after [`Self::this_process`]: the one way to its lock.
    #[inline]
    fn data(&self) -> Result<MutexGuard<'_, DataPtr>> {
        self.this_process()?;
        Ok(self.inner.data.lock())
    }

    /// Runs `f` on the storage's `DataPtr` under its lock (after [`Self::this_process`]).
    pub(crate) fn with_data<R>(&self, f: impl FnOnce(&mut DataPtr) -> Result<R>) -> Result<R> {
        f(&mut *self.data()?)
    }

    fn stream(&self) -> Result<StreamId> {
        self.inner.runtime.current_stream(self.inner.device)
    }

    /// [`Error::Asleep`] when the storage's memory belongs to a tag that sleeps: `what` is
    /// refused before it touches unmapped memory (`src/runtime/sleep.rs`).
    pub(crate) fn check_awake(&self, what: &str) -> Result<()> {
        self.data()?.check_awake(what)
    }

    /// Enqueues the fill kernel over the whole storage on the current stream.
    pub fn fill_pattern(&self, seed: u64) -> Result<()> {
        if self.inner.nbytes == 0 {
            return Ok(());
        }
        self.check_awake("the fill kernel")?;
        let stream = self.stream()?;
        let kernels = self.inner.runtime.driver().kernels();
        order::enqueue_ordered(&[(self, AccessKind::Write)], stream, |addrs| {
            let dst = addrs.first().map_or(DeviceAddr(0), |p| p.addr);
            // SAFETY: the storage's own bytes, taken under its locks for `stream` (`order.rs`).
            unsafe { kernels.fill_pattern(stream, dst, self.inner.nbytes, seed) }
        })
    }

    /// Runs the verify kernel over the whole storage on the current stream.
    pub fn count_pattern_mismatches(&self, seed: u64) -> Result<u64> {
        if self.inner.nbytes == 0 {
            return Ok(0);
        }
        self.check_awake("the verify kernel")?;
        let stream = self.stream()?;
        let kernels = self.inner.runtime.driver().kernels();
        order::enqueue_ordered(&[(self, AccessKind::Read)], stream, |addrs| {
            let src = addrs.first().map_or(DeviceAddr(0), |p| p.addr);
            // SAFETY: as in `fill_pattern`.
            unsafe { kernels.count_pattern_mismatches(stream, src, self.inner.nbytes, seed) }
        })
    }
}
