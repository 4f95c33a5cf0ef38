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
use crate::driver::{DevicePtr, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex};

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

    pub(crate) fn block_owner(&self) -> Option<&BlockOwner> {
        match &self.owner {
            Owner::Block(b) => Some(b),
            Owner::None => None,
        }
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

    /// The address for writing. For a plain storage this is one atomic load.
    #[inline]
    pub fn mutable_data_ptr(&self) -> Result<DevicePtr> {
        let word = self.inner.word.load(Ordering::Acquire);
        if word & COW_TAG == 0 {
            return Ok(DevicePtr(word));
        }
        Err(Error::invalid(
            "copy-on-write storages are not materialized by this build",
        ))
    }

    /// Whether `self` and `other` are the same storage (aliases).
    pub fn is_alias_of(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Marks the storage's memory as used on `stream` (see [`CachingAllocator::record_stream`]).
    pub fn record_stream(&self, stream: StreamId) -> Result<()> {
        self.inner
            .allocator
            .record_stream(&self.inner.data.lock(), stream)
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
