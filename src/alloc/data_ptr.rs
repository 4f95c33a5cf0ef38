//! `DataPtr`: one owning device pointer with a typed owner.
//!
//! The owner says how the memory goes back when the pointer drops. This layer knows two kinds: a
//! caching-allocator block (returned to its shard) and nothing (an empty storage). Upper layers —
//! copy-on-write contexts, memory shared with or received from other processes — attach their own
//! owners through the [`SharedOwner`] trait object, so the allocator never names them (DESIGN §1:
//! no module imports a layer above it). An upper layer recognizes its own owners by downcasting.
//!
//! | owner                      | dropping the `DataPtr`                                    |
//! |----------------------------|-----------------------------------------------------------|
//! | `None`                     | nothing                                                   |
//! | `Block`                    | the block is freed into its shard (after recorded streams) |
//! | `Shared(Box<dyn SharedOwner>)` | the upper layer's `Drop` (COW release, IPC limbo, lease release) |

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;

use super::shard::Shard;
use crate::driver::{DeviceAddr, StreamId};
use crate::error::{Error, Result};

/// A caching-allocator block owned by a [`DataPtr`]: dropping it frees the block into its shard.
///
/// It points at its shard without a reference count: the shard counts its handed-out blocks
/// under its own lock (`ShardState::owners`) and stays alive while any is out — in its device's
/// map while the allocator lives, then as an orphan released by the last free (`shard.rs`). So an
/// allocate + free pair touches no atomic outside the shard's lock.
pub(crate) struct BlockOwner {
    shard: NonNull<Shard>,
    block: usize,
}

// SAFETY: `Shard` is `Sync` (its state is behind a lock) and the pointer stays valid while the
// owner lives (the shard counts this owner in `owners`); the owner may be used and dropped on
// any thread.
unsafe impl Send for BlockOwner {}
// SAFETY: as for `Send`: shared access only reaches the shard through `&Shard`.
unsafe impl Sync for BlockOwner {}

impl BlockOwner {
    /// The owner of `block`, just handed out by `shard`.
    ///
    /// # Safety
    /// `block` must have been handed out by `shard` (counted in its `owners` by
    /// `ShardState::allocate`) and not be owned by any other `BlockOwner`.
    pub(crate) unsafe fn new(shard: &Shard, block: usize) -> Self {
        BlockOwner {
            shard: NonNull::from(shard),
            block,
        }
    }

    fn shard(&self) -> &Shard {
        // SAFETY: the shard counts this owner among its `owners`, so it is neither dropped nor
        // moved before `Drop for BlockOwner` below has released the block.
        unsafe { self.shard.as_ref() }
    }

    /// Its free waits for the work queued on `stream` so far.
    pub(crate) fn record_use(&self, stream: StreamId) -> Result<()> {
        self.shard().record_use(self.block, stream)
    }

    /// The stream the block was allocated on.
    pub(crate) fn stream(&self) -> StreamId {
        self.shard().stream
    }

    /// Base and size of the block's segment.
    pub(crate) fn segment(&self) -> (u64, u64) {
        self.shard().segment_of(self.block)
    }

    /// The pages under the block's first `len` bytes when it lies in an expandable segment.
    pub(crate) fn pages_under(&self, len: u64) -> Result<Option<super::PagesUnder>> {
        self.shard().pages_under(self.block, len)
    }
}

impl Drop for BlockOwner {
    fn drop(&mut self) {
        let orphan_released = self.shard().free(self.block);
        if orphan_released {
            // SAFETY: the allocator is gone and this was the shard's last handed-out block:
            // `free` reported (once, under the shard's lock) that the reference the allocator
            // leaked for its orphaned shards (`Arc::into_raw` in `DeviceCore::shutdown`) is ours
            // to release. No reference to the shard is used after this.
            unsafe { Shard::release_orphan(self.shard) };
        }
    }
}

/// An owner defined by a layer above the allocator (COW context, IPC sent or received data).
pub(crate) trait SharedOwner: Any + Send + Sync + fmt::Debug {
    /// A short name for logs (`"cow"`, `"ipc-sent"`, …).
    fn label(&self) -> &'static str;

    /// The allocator block this owner keeps allocated, if any.
    fn block(&self) -> Option<&BlockOwner> {
        None
    }

    /// Makes the release of this memory wait for the work queued on `stream` so far.
    fn record_stream(&self, stream: StreamId) -> Result<()>;
}

/// Who is responsible for a [`DataPtr`]'s memory.
pub(crate) enum Owner {
    /// Nothing to release (empty storage).
    None,
    /// A block of a caching allocator.
    Block(BlockOwner),
    /// An owner of an upper layer.
    Shared(Box<dyn SharedOwner>),
}

/// An owning device pointer.
pub struct DataPtr {
    ptr: DeviceAddr,
    device: usize,
    owner: Owner,
}

impl fmt::Debug for DataPtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let owner = match &self.owner {
            Owner::None => "none",
            Owner::Block(_) => "block",
            Owner::Shared(s) => s.label(),
        };
        f.debug_struct("DataPtr")
            .field("ptr", &self.ptr)
            .field("device", &self.device)
            .field("owner", &owner)
            .finish()
    }
}

impl DataPtr {
    pub(crate) fn new(ptr: DeviceAddr, device: usize, owner: Owner) -> Self {
        DataPtr { ptr, device, owner }
    }

    /// A null pointer owning nothing (the data of an empty storage).
    pub fn empty(device: usize) -> Self {
        DataPtr {
            ptr: DeviceAddr(0),
            device,
            owner: Owner::None,
        }
    }

    /// The device address.
    pub fn ptr(&self) -> DeviceAddr {
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

    /// The block behind this pointer (directly, or kept by an upper layer's owner).
    pub(crate) fn block_owner(&self) -> Option<&BlockOwner> {
        match &self.owner {
            Owner::Block(b) => Some(b),
            Owner::Shared(s) => s.block(),
            Owner::None => None,
        }
    }

    pub(crate) fn into_owner(self) -> Owner {
        self.owner
    }

    pub(crate) fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The upper-layer owner of type `T`, if that is what owns this memory.
    pub(crate) fn shared_owner<T: SharedOwner>(&self) -> Option<&T> {
        match &self.owner {
            Owner::Shared(s) => (&**s as &dyn Any).downcast_ref::<T>(),
            _ => None,
        }
    }

    /// Base and size of the allocator segment holding this memory.
    pub(crate) fn segment(&self) -> Option<(u64, u64)> {
        self.block_owner().map(BlockOwner::segment)
    }

    /// The pages under the first `len` bytes when the memory lies in an expandable segment of its
    /// allocator (`None` otherwise).
    pub(crate) fn pages_under(&self, len: u64) -> Result<Option<super::PagesUnder>> {
        match self.block_owner() {
            Some(b) => b.pages_under(len),
            None => Ok(None),
        }
    }

    /// The stream the memory was allocated on, when it came from a caching allocator.
    pub fn allocation_stream(&self) -> Option<StreamId> {
        self.block_owner().map(BlockOwner::stream)
    }

    /// Marks the memory as used on `stream`: its release waits for the work queued there so far.
    pub(crate) fn record_stream(&self, stream: StreamId) -> Result<()> {
        match &self.owner {
            Owner::Block(b) => b.record_use(stream),
            Owner::Shared(s) => s.record_stream(stream),
            Owner::None if self.is_empty() => Ok(()),
            Owner::None => Err(Error::invalid(
                "record_stream: this pointer was not allocated by a caching allocator",
            )),
        }
    }
}

/// Takes the upper-layer owner of type `T` out of `owner`, or gives `owner` back unchanged.
pub(crate) fn take_shared<T: SharedOwner>(owner: Owner) -> std::result::Result<Box<T>, Owner> {
    match owner {
        Owner::Shared(s) if (&*s as &dyn Any).is::<T>() => {
            let any: Box<dyn Any> = s;
            // Cannot fail (the type was just checked); were it to, the owner is released.
            any.downcast::<T>().map_err(|_| Owner::None)
        }
        other => Err(other),
    }
}
