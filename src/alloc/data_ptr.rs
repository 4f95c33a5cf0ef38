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
use std::num::NonZeroU32;
use std::ptr::NonNull;

use super::block::Allocated;
use super::block::BlockId;
use super::front::{self, FrontEntry};

use super::engine::Shard;
use crate::driver::{DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicU32, Ordering};

/// A caching-allocator block owned by a [`DataPtr`]: dropping it frees the block into its shard.
///
/// It points at its shard without a reference count: the shard counts its handed-out blocks
/// under its own lock (`ShardState::owners`) and stays alive while any is out — in its device's
/// map while the allocator lives, then as an orphan released by the last free (`shard.rs`). So an
/// allocate + free pair touches no atomic outside the shard's lock. It also remembers the size
/// class of the request it served, so a thread front cache can take the block over without the
/// shard (`front.rs`). Sixteen bytes, like the reference-counted pointer and index it replaced: a
/// `DataPtr` stays 40 bytes (measured: every 8 bytes more cost the cached pair ~25 %).
pub(crate) struct BlockOwner {
    shard: NonNull<Shard>,
    block: u32,
    /// Size class of the request (`front::class_of`); 0 when the block may not go to a front
    /// cache (a request over 2 TiB, or another stream was recorded: its free must wait for
    /// that stream's events).
    class: AtomicU32,
}

// SAFETY: `Shard` is `Sync` (its state is behind a lock) and the pointer stays valid while the
// owner lives (the shard counts this owner in `owners`); the owner may be used and dropped on
// any thread.
unsafe impl Send for BlockOwner {}
// SAFETY: as for `Send`: shared access only reaches the shard through `&Shard`.
unsafe impl Sync for BlockOwner {}

impl BlockOwner {
    /// The owner of a block just handed out by `shard` (from its pools or a front cache); `None`
    /// when its index does not fit the owner's 32 bits (four billion blocks in one stream).
    ///
    /// # Safety
    /// `block` must have been handed out by `shard` (counted in its `owners` by
    /// `ShardState::allocate`) and not be owned by any other `BlockOwner` or front cache.
    pub(crate) unsafe fn new(shard: &Shard, block: &Allocated) -> Option<Self> {
        Some(BlockOwner {
            shard: NonNull::from(shard),
            block: u32::try_from(block.block).ok()?,
            class: AtomicU32::new(
                front::class_of(block.rounded)
                    .filter(|_| block.front)
                    .map_or(0, NonZeroU32::get),
            ),
        })
    }

    fn shard(&self) -> &Shard {
        // SAFETY: the shard counts this owner among its `owners`, so it is neither dropped nor
        // moved before `Drop for BlockOwner` below has released the block.
        unsafe { self.shard.as_ref() }
    }

    fn block(&self) -> BlockId {
        self.block as BlockId
    }

    /// Its free waits for the work queued on `stream` so far.
    pub(crate) fn record_use(&self, stream: StreamId) -> Result<()> {
        let shard = self.shard();
        if stream != shard.stream() {
            // Not for a front cache any more: the free has to record events.
            self.class.store(0, Ordering::Relaxed);
        }
        shard.record_use(self.block(), stream)
    }

    /// Whether its bytes can go to a new owner using them on `to` without a free between
    /// (`engine/handover.rs`).
    pub(crate) fn can_hand_over_in_place(&self, to: StreamId) -> bool {
        matches!(
            self.shard().plan_steal(self.block(), to),
            super::engine::handover::StealPlan::HandOver(_)
        )
    }

    /// Its bytes go to a new owner that uses them on `to` next, without a free between
    /// (`engine/handover.rs`): `to` is ordered after every stream the block was used on.
    /// Whether that ordered `to` after another stream.
    pub(crate) fn hand_over_in_place(&self, to: StreamId) -> bool {
        self.shard().hand_over_in_place(self.block(), to)
    }

    /// Whether the block is the default pool's: memory no graph's replay writes (`graph.rs`).
    pub(crate) fn in_default_pool(&self) -> bool {
        self.shard().serves_default_pool()
    }

    /// The stream the block was allocated on.
    pub(crate) fn stream(&self) -> StreamId {
        self.shard().stream()
    }

    /// Base and size of the block's segment.
    pub(crate) fn segment(&self) -> (u64, u64) {
        self.shard().segment_of(self.block())
    }

    /// The pages under the block's first `len` bytes when it lies in an expandable segment.
    pub(crate) fn pages_under(&self, len: u64) -> Result<Option<super::PagesUnder>> {
        self.shard().pages_under(self.block(), len)
    }

    /// An [`Error::Asleep`] when the block's tag sleeps (`sleep.rs`): `what` was refused.
    #[inline]
    pub(crate) fn check_awake(&self, what: &str) -> Result<()> {
        let shard = self.shard();
        if shard.is_sleeping() {
            return Err(shard.asleep_error(what));
        }
        Ok(())
    }

    /// Bytes a thread may keep in its front cache of this block's shard (0: not this block).
    #[inline]
    fn front_limit(&mut self) -> u64 {
        if *self.class.get_mut() == 0 {
            return 0;
        }
        let shard = self.shard();
        if !shard.birth().is_current() {
            // A forked child's block: dropped as it is, which leaks it (below).
            return 0;
        }
        shard.front_limit()
    }

    /// Hands the block at `ptr` to this thread's front cache of its shard, if it has room within
    /// `limit` bytes ([`Self::front_limit`]); gives the owner back otherwise.
    fn keep_in_front(mut self, ptr: u64, limit: u64) -> Option<Self> {
        let Some(class) = NonZeroU32::new(*self.class.get_mut()) else {
            return Some(self);
        };
        let entry = FrontEntry {
            block: self.block(),
            ptr,
            class,
        };
        let shard = self.shard();
        if super::engine::thread::keep_in_front(shard, entry, limit, || {
            shard.leave_to_front(ptr, entry.bytes())
        }) {
            // The front cache owns the block now (it is still counted among the shard's owners).
            std::mem::forget(self);
            return None;
        }
        Some(self)
    }
}

impl Drop for BlockOwner {
    fn drop(&mut self) {
        if !self.shard().birth().is_current() {
            // A forked child's copy of the parent's block: the parent frees it (`process`).
            return;
        }
        // SAFETY: this owner's block is handed out by the shard and given up here, once.
        unsafe { Shard::free_and_release(self.shard, self.block()) };
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

    /// An [`Error::Asleep`] when the memory this owner keeps belongs to a sleeping tag
    /// (through [`SharedOwner::block`] unless the owner keeps it elsewhere).
    fn check_awake(&self, what: &str) -> Result<()> {
        match self.block() {
            Some(b) => b.check_awake(what),
            None => Ok(()),
        }
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

    pub(crate) fn into_owner(mut self) -> Owner {
        std::mem::replace(&mut self.owner, Owner::None)
    }

    /// The block when the pointer owns one directly (not through an upper layer's owner).
    pub(crate) fn own_block(&self) -> Option<&BlockOwner> {
        match &self.owner {
            Owner::Block(b) => Some(b),
            _ => None,
        }
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

    /// An [`Error::Asleep`] when the memory belongs to a tag that sleeps (or is on its way to
    /// or from sleep): a library call about to use it (`what`) is refused instead of touching
    /// unmapped memory.
    #[inline]
    pub(crate) fn check_awake(&self, what: &str) -> Result<()> {
        match &self.owner {
            Owner::Block(b) => b.check_awake(what),
            Owner::Shared(s) => s.check_awake(what),
            Owner::None => Ok(()),
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

impl Drop for DataPtr {
    #[inline]
    fn drop(&mut self) {
        // A plain block may go to this thread's front cache (`front.rs`) instead of its shard;
        // every other owner is dropped as it is.
        if let Owner::Block(block) = &mut self.owner {
            let limit = block.front_limit();
            if limit > 0 {
                if let Owner::Block(block) = std::mem::replace(&mut self.owner, Owner::None) {
                    drop(block.keep_in_front(self.ptr.0, limit));
                }
            }
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

#[cfg(test)]
mod layout_tests {
    //! The cache-line isolation and the 40-byte `DataPtr` that issue 14's figures rest on: a
    //! change that breaks either fails here, not in a noisy benchmark.
    use super::*;
    use crate::alloc::block::Block;
    use crate::alloc::front::FrontCache;

    #[test]
    fn hot_state_owns_its_cache_lines_and_a_data_ptr_stays_small() {
        assert!(std::mem::align_of::<Shard>() >= 128);
        assert!(std::mem::align_of::<FrontCache>() >= 128);
        assert_eq!(std::mem::align_of::<Block>(), 128);
        assert_eq!(std::mem::size_of::<Block>() % 128, 0);
        assert_eq!(std::mem::size_of::<BlockOwner>(), 16);
        assert_eq!(std::mem::size_of::<DataPtr>(), 40);
    }
}
