//! `DataPtr` (an owning device pointer with a typed owner) and `Storage` (the unit of aliasing).
//!
//! A [`DataPtr`] owns one device address. Its owner says how the memory goes back when the pointer
//! drops: a caching-allocator block returns to its shard; `Owner::None` owns nothing (empty or
//! borrowed memory). Later layers add owners (COW contexts, IPC sent and received data); because the
//! owner is typed, any of them can be wrapped by another.
//!
//! A [`Storage`] is shared by cloning: clones alias (same data, same identity). Reads never change
//! it. `mutable_data_ptr()` reads one atomic word holding the address and a COW tag in bit 0 (device
//! addresses are at least 512-byte aligned); with the tag clear — every storage until lazy clones
//! exist — that load is the whole cost.

use std::fmt;

use crate::alloc::{CachingAllocator, Shard};
use crate::cow::CowOwner;
use crate::driver::{DevicePtr, StreamId};
use crate::error::{Error, Result};
use crate::ipc::{IpcHandle, ReceivedOwner, SentOwner};
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex, Weak};

/// A caching-allocator block owned by a [`DataPtr`]: dropping it frees the block into its shard.
pub(crate) struct BlockOwner {
    shard: Arc<Shard>,
    block: usize,
}

impl BlockOwner {
    pub(crate) fn new(shard: Arc<Shard>, block: usize) -> Self {
        BlockOwner { shard, block }
    }

    pub(crate) fn record_use(&self, stream: StreamId) -> Result<()> {
        self.shard.record_use(self.block, stream)
    }

    /// The stream the block was allocated on.
    pub(crate) fn stream(&self) -> StreamId {
        self.shard.stream
    }

    /// Base and size of the block's segment.
    pub(crate) fn segment(&self) -> (u64, u64) {
        self.shard.segment_of(self.block)
    }
}

impl Drop for BlockOwner {
    fn drop(&mut self) {
        self.shard.free(self.block);
    }
}

/// Who is responsible for a [`DataPtr`]'s memory.
pub(crate) enum Owner {
    /// Nothing to release (empty storage).
    None,
    /// A block of a caching allocator.
    Block(BlockOwner),
    /// A block shared with other processes (keeps the block; may go to limbo when dropped).
    Sent(Box<SentOwner>),
    /// Memory of another process, held through a lease on its slot.
    Received(Box<ReceivedOwner>),
    /// One reference on a copy-on-write context.
    Cow(CowOwner),
}

/// An owning device pointer.
pub struct DataPtr {
    ptr: DevicePtr,
    device: usize,
    owner: Owner,
}

impl fmt::Debug for DataPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let owner = match &self.owner {
            Owner::None => "none",
            Owner::Block(_) => "block",
            Owner::Sent(_) => "ipc-sent",
            Owner::Received(_) => "ipc-received",
            Owner::Cow(_) => "cow",
        };
        f.debug_struct("DataPtr")
            .field("ptr", &self.ptr)
            .field("device", &self.device)
            .field("owner", &owner)
            .finish()
    }
}

impl DataPtr {
    pub(crate) fn new(ptr: DevicePtr, device: usize, owner: Owner) -> Self {
        DataPtr { ptr, device, owner }
    }

    /// A null pointer owning nothing (the data of an empty storage).
    pub fn empty(device: usize) -> Self {
        DataPtr {
            ptr: DevicePtr(0),
            device,
            owner: Owner::None,
        }
    }

    /// The device address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Whether this is the null pointer of an empty allocation.
    pub fn is_empty(&self) -> bool {
        self.ptr.0 == 0
    }

    /// The block behind this pointer (directly, or kept by a shared storage's owner).
    pub(crate) fn block_owner(&self) -> Option<&BlockOwner> {
        match &self.owner {
            Owner::Block(b) => Some(b),
            Owner::Sent(s) => s.data.as_ref().and_then(|d| d.original.block_owner()),
            Owner::None | Owner::Received(_) | Owner::Cow(_) => None,
        }
    }

    pub(crate) fn into_owner(self) -> Owner {
        self.owner
    }

    pub(crate) fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Base and size of the allocator segment holding this memory.
    pub(crate) fn segment(&self) -> Option<(u64, u64)> {
        self.block_owner().map(BlockOwner::segment)
    }

    /// The stream the memory was allocated on, when it came from a caching allocator.
    pub fn allocation_stream(&self) -> Option<StreamId> {
        self.block_owner().map(BlockOwner::stream)
    }
}

/// Bit 0 of the address word: the storage is a COW view (set by lazy clones).
const COW_TAG: u64 = 1;

struct StorageInner {
    /// Address with the COW tag in bit 0.
    word: AtomicU64,
    nbytes: u64,
    device: usize,
    data: Mutex<DataPtr>,
    allocator: Arc<CachingAllocator>,
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
            .field("ptr", &self.data_ptr())
            .field("nbytes", &self.inner.nbytes)
            .field("device", &self.inner.device)
            .finish()
    }
}

impl Storage {
    /// Allocates `nbytes` on `device`'s current stream (0 bytes: a valid empty storage).
    pub fn new(allocator: &Arc<CachingAllocator>, device: usize, nbytes: u64) -> Result<Self> {
        let data = allocator.allocate(device, nbytes)?;
        Ok(Self::from_data_ptr(allocator, data, nbytes))
    }

    /// Wraps memory already owned by `data` (of at least `nbytes`).
    pub fn from_data_ptr(allocator: &Arc<CachingAllocator>, data: DataPtr, nbytes: u64) -> Self {
        Storage {
            inner: Arc::new(StorageInner {
                word: AtomicU64::new(data.ptr().0),
                nbytes,
                device: data.device(),
                data: Mutex::new(data),
                allocator: Arc::clone(allocator),
            }),
        }
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> u64 {
        self.inner.nbytes
    }

    /// Device ordinal.
    pub fn device(&self) -> usize {
        self.inner.device
    }

    /// The allocator that owns the memory.
    pub fn allocator(&self) -> &Arc<CachingAllocator> {
        &self.inner.allocator
    }

    /// The address for reading. Never materializes.
    #[inline]
    pub fn data_ptr(&self) -> DevicePtr {
        DevicePtr(self.inner.word.load(Ordering::Acquire) & !COW_TAG)
    }

    /// The address for writing. For a plain storage this is one atomic load; a COW storage is
    /// materialized first (see [`crate::cow`]): on error (out of memory for the copy) it stays a
    /// valid COW storage.
    #[inline]
    pub fn mutable_data_ptr(&self) -> Result<DevicePtr> {
        let word = self.inner.word.load(Ordering::Acquire);
        if word & COW_TAG == 0 {
            return Ok(DevicePtr(word));
        }
        crate::cow::materialize(self)
    }

    /// A lazy clone: a new storage sharing this one's data copy-on-write (converting this storage
    /// to COW on its first lazy clone). Not an alias: writes to either stay private.
    pub fn lazy_clone(&self) -> Result<Storage> {
        crate::cow::lazy_clone(self)
    }

    /// Whether the storage shares its data copy-on-write.
    pub fn is_cow(&self) -> bool {
        self.inner.word.load(Ordering::Acquire) & COW_TAG != 0
    }

    /// Sets or clears the COW tag; clearing also publishes the (possibly new) address. Called with
    /// the storage's data lock held, `ptr` being the new address.
    pub(crate) fn set_cow_word(&self, ptr: DevicePtr, cow: bool) {
        let tag = if cow { COW_TAG } else { 0 };
        self.inner.word.store(ptr.0 | tag, Ordering::Release);
    }

    /// Whether `self` and `other` are the same storage (aliases).
    pub fn is_alias_of(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Marks the storage's memory as used on `stream` (see [`CachingAllocator::record_stream`]).
    /// For a received storage, the lease is released only after `stream`'s work is done.
    pub fn record_stream(&self, stream: StreamId) -> Result<()> {
        let data = self.inner.data.lock();
        self.record_stream_locked(&data, stream)
    }

    /// [`Self::record_stream`] with the storage's data lock held (`data` is its `DataPtr`).
    pub(crate) fn record_stream_locked(&self, data: &DataPtr, stream: StreamId) -> Result<()> {
        match &data.owner {
            Owner::Received(r) => {
                let mut streams = r.streams.lock();
                if !streams.contains(&stream) {
                    streams.push(stream);
                }
                Ok(())
            }
            Owner::Cow(c) => c.with_original(|original| match original {
                Some(d) => self.inner.allocator.record_stream(d, stream),
                None => Ok(()),
            }),
            _ => self.inner.allocator.record_stream(data, stream),
        }
    }

    /// Shares this storage with other processes: the returned handle owns one count on the
    /// storage's slot (see [`crate::ipc`]). Sharing a received storage forwards it.
    pub fn share_ipc(&self) -> Result<IpcHandle> {
        crate::ipc::share(self)
    }

    /// Opens a handle from another process (or returns the original storage in the producer's own
    /// process, or the already-open storage in this one). The storage waits for the producer's
    /// event on the current stream before any work queued after this call.
    pub fn from_ipc(allocator: &Arc<CachingAllocator>, handle: IpcHandle) -> Result<Storage> {
        crate::ipc::receive(allocator, handle)
    }

    /// Whether the memory came from another process.
    pub fn is_received(&self) -> bool {
        matches!(self.inner.data.lock().owner, Owner::Received(_))
    }

    pub(crate) fn downgrade(&self) -> WeakStorage {
        WeakStorage(Arc::downgrade(&self.inner))
    }

    /// Runs `f` on the storage's `DataPtr` under its lock.
    pub(crate) fn with_data<R>(&self, f: impl FnOnce(&mut DataPtr) -> R) -> R {
        f(&mut self.inner.data.lock())
    }

    fn check_len(&self, len: usize) -> Result<()> {
        if len as u64 > self.inner.nbytes {
            return Err(Error::invalid(format!(
                "{len} bytes do not fit a storage of {} bytes",
                self.inner.nbytes
            )));
        }
        Ok(())
    }

    fn stream(&self) -> Result<StreamId> {
        self.inner.allocator.current_stream(self.inner.device)
    }

    /// Copies `src` to the start of the storage on the current stream (returns when done).
    pub fn copy_from_host(&self, src: &[u8]) -> Result<()> {
        self.check_len(src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let dst = self.mutable_data_ptr()?;
        self.inner
            .allocator
            .driver()
            .copy_host_to_device(self.stream()?, dst, src)
    }

    /// Copies the start of the storage into `dst` on the current stream (returns when done).
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.check_len(dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.inner
            .allocator
            .driver()
            .copy_device_to_host(self.stream()?, dst, self.data_ptr())
    }

    /// Enqueues the fill kernel over the whole storage on the current stream.
    pub fn fill_pattern(&self, seed: u64) -> Result<()> {
        if self.inner.nbytes == 0 {
            return Ok(());
        }
        let dst = self.mutable_data_ptr()?;
        self.inner
            .allocator
            .driver()
            .fill_pattern(self.stream()?, dst, self.inner.nbytes, seed)
    }

    /// Runs the verify kernel over the whole storage on the current stream.
    pub fn count_pattern_mismatches(&self, seed: u64) -> Result<u64> {
        if self.inner.nbytes == 0 {
            return Ok(0);
        }
        self.inner.allocator.driver().count_pattern_mismatches(
            self.stream()?,
            self.data_ptr(),
            self.inner.nbytes,
            seed,
        )
    }
}
