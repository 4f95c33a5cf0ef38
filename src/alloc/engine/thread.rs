//! Per-thread state of every allocator: the current stream per device and a small cache of the
//! shards this thread used last, so the hot path finds its shard with one thread-local access — no
//! shared map, no lock, no atomic.
//!
//! The cache holds plain pointers keyed by (allocator id, stream). That is sound without any
//! reference count because of two facts the allocator guarantees:
//!
//! * a shard stays in its device (its map, the retired list once its memory pool dropped or its
//!   stream was destroyed, the buried list once empty) for the allocator's whole life — only the
//!   allocator's `Drop` removes shards. A buried shard is recycled for the next new stream under
//!   a new serial (`Shard::recycle`), and a slot whose serial no longer matches its shard's is a
//!   miss, so a slot never serves another stream's shard;
//! * allocator ids come from a process-wide counter and are never reused.
//!
//! So an entry is only ever read by a call on the allocator that cached it (`&self` proves that
//! allocator alive, hence the shard), and entries of dropped allocators can never match again;
//! they are overwritten as the cache rotates. The cache has no destructor and a constant
//! initializer, so reaching it is a plain thread-local access. Keys are (allocator, stream) and
//! (allocator, "current stream of device d"); the latter is dropped whenever the thread's current
//! stream changes.
//!
//! The free path finds a slot by its shard (it does not know the allocator); a dropped
//! allocator's shard memory is often reused by the next allocator's shard, so slots and front
//! caches also compare the shard's never-reused serial (`Shard::serial`) — without it a thread's
//! retired cache of the old shard was taken for the new one's and the new allocator's frees were
//! never cached on that thread (`tests/thread_cache.rs`, failed at the fourth allocator).
//!
//! With `thread_cache_mb`, each slot also notes this thread's front cache of its shard
//! (`front.rs`). The thread keeps its front caches in `FRONTS`, whose destructor (thread exit)
//! clears every slot's front pointer first and then retires the caches, so a pointer in a slot is
//! always to a live cache of this thread.

use std::cell::RefCell;
use std::num::NonZeroU32;
use std::ptr::NonNull;

use super::Shard;
use crate::alloc::block::BlockId;
use crate::alloc::front::{FrontCache, FrontEntry};
use crate::alloc::pool_id::{MemPoolId, MemPoolOptions};
use crate::driver::StreamId;
use crate::sync::os::Arc;

/// Entries of the shard cache.
const SHARD_SLOTS: usize = 8;

/// What a cached shard is the shard of.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotKey {
    /// A stream.
    Stream(StreamId),
    /// This thread's current stream of a device (dropped when the current stream changes), as of
    /// a generation of the allocator's library default streams (a new default misses it).
    Current(usize, u64),
}

/// One cached shard (a null pointer marks an empty slot), with this thread's front cache of it
/// when one was made (`front.rs`; null otherwise).
#[derive(Clone, Copy)]
struct ShardSlot {
    alloc: u64,
    key: SlotKey,
    shard: *const Shard,
    /// The shard's serial when cached (a later shard may reuse a dropped one's address).
    serial: u64,
    front: *const FrontCache,
}

const EMPTY_SLOT: ShardSlot = ShardSlot {
    alloc: 0,
    key: SlotKey::Current(usize::MAX, u64::MAX),
    shard: std::ptr::null(),
    serial: 0,
    front: std::ptr::null(),
};

/// One of this thread's front caches and the shard it holds blocks of. The shard's address is
/// only used to give those blocks back: while the cache holds any, they keep the shard alive.
struct ThreadFront {
    shard: NonNull<Shard>,
    cache: Arc<FrontCache>,
}

/// This thread's front caches. They are also registered with their shards (which flush, retire
/// and read them); this list keeps them for the thread and retires them when it exits.
struct ThreadFronts(Vec<ThreadFront>);

impl Drop for ThreadFronts {
    fn drop(&mut self) {
        // Forget the slots' pointers first: frees during the rest of this thread's teardown go
        // straight to their shards. (`try_with` fails only once the cache itself is gone.)
        let _ = SHARDS.try_with(|cache| {
            for slot in cache.borrow_mut().0.iter_mut() {
                slot.front = std::ptr::null();
            }
        });
        for front in self.0.drain(..) {
            // SAFETY: `front.cache` was registered with `front.shard` (`start_front`); the blocks
            // it holds keep that shard alive, and with none held the pointer is not used.
            unsafe { Shard::flush_front(front.shard, &front.cache, true) };
        }
    }
}

struct ThreadState {
    /// ((allocator id, device), current stream)
    current: Vec<((u64, usize), StreamId)>,
    /// ((allocator id, device), this thread's default stream) with `default_stream:per_thread`.
    per_thread: Vec<((u64, usize), StreamId)>,
    /// The memory pools this thread allocates from (`use_mem_pool`), innermost last:
    /// ((allocator id, device), scope token, pool, its options).
    pools: Vec<((u64, usize), u64, MemPoolId, MemPoolOptions)>,
}

thread_local! {
    static STATE: RefCell<ThreadState> = const {
        RefCell::new(ThreadState {
            current: Vec::new(),
            per_thread: Vec::new(),
            pools: Vec::new(),
        })
    };
    /// The shard cache; slot `next` is overwritten next.
    static SHARDS: RefCell<([ShardSlot; SHARD_SLOTS], usize)> =
        const { RefCell::new(([EMPTY_SLOT; SHARD_SLOTS], 0)) };
    static FRONTS: RefCell<ThreadFronts> = const { RefCell::new(ThreadFronts(Vec::new())) };
}

/// This thread's current stream of `device` for allocator `alloc`, if one was set.
#[inline]
pub(crate) fn current_stream(alloc: u64, device: usize) -> Option<StreamId> {
    STATE.with(|s| {
        s.borrow()
            .current
            .iter()
            .find(|(k, _)| *k == (alloc, device))
            .map(|(_, st)| *st)
    })
}

/// Sets the current stream; returns the previous one.
pub(crate) fn set_current_stream(
    alloc: u64,
    device: usize,
    stream: Option<StreamId>,
) -> Option<StreamId> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let key = (alloc, device);
        forget_current_shards(alloc, device);
        let previous = s.current.iter().find(|(k, _)| *k == key).map(|(_, st)| *st);
        s.current.retain(|(k, _)| *k != key);
        if let Some(stream) = stream {
            s.current.push((key, stream));
        }
        previous
    })
}

/// The memory pool this thread allocates from on `device` for allocator `alloc` (the innermost
/// scope's), if any.
pub(crate) fn current_pool(alloc: u64, device: usize) -> Option<(MemPoolId, MemPoolOptions)> {
    STATE.with(|s| {
        s.borrow()
            .pools
            .iter()
            .rev()
            .find(|(k, ..)| *k == (alloc, device))
            .map(|&(_, _, pool, options)| (pool, options))
    })
}

/// Makes `pool` the one this thread allocates from on `device` (for allocator `alloc`) until
/// [`leave_pool`] with the returned token. The thread's cached shards of the device are
/// forgotten: they were the previous pool's.
pub(crate) fn enter_pool(
    alloc: u64,
    device: usize,
    pool: MemPoolId,
    options: MemPoolOptions,
) -> u64 {
    static NEXT_TOKEN: crate::sync::os::atomic::AtomicU64 =
        crate::sync::os::atomic::AtomicU64::new(1);
    let token = NEXT_TOKEN.fetch_add(1, crate::sync::os::atomic::Ordering::Relaxed);
    forget_device_shards(alloc, device);
    STATE.with(|s| {
        s.borrow_mut()
            .pools
            .push(((alloc, device), token, pool, options))
    });
    token
}

/// Ends the pool scope `token` (scopes may end in any order).
pub(crate) fn leave_pool(alloc: u64, device: usize, token: u64) {
    forget_device_shards(alloc, device);
    // At thread exit the scopes are gone with the thread's state: nothing to end.
    let _ = STATE.try_with(|s| s.borrow_mut().pools.retain(|&(_, t, ..)| t != token));
}

/// This thread's own default stream of `device` for allocator `alloc`, if made.
pub(crate) fn per_thread_stream(alloc: u64, device: usize) -> Option<StreamId> {
    STATE.with(|s| {
        s.borrow()
            .per_thread
            .iter()
            .find(|(k, _)| *k == (alloc, device))
            .map(|(_, st)| *st)
    })
}

/// Remembers this thread's own default stream of `device` for allocator `alloc`.
pub(crate) fn set_per_thread_stream(alloc: u64, device: usize, stream: StreamId) {
    STATE.with(|s| s.borrow_mut().per_thread.push(((alloc, device), stream)));
}

/// The shard this thread cached for (`alloc`, `stream`), if any. The pointer is valid while
/// allocator `alloc` lives (see the module docs); only that allocator may dereference it.
#[inline]
pub(crate) fn cached_shard(alloc: u64, stream: StreamId) -> Option<*const Shard> {
    lookup(alloc, SlotKey::Stream(stream))
}

/// Remembers `shard` as this thread's shard of (`alloc`, `stream`).
pub(crate) fn cache_shard(alloc: u64, stream: StreamId, shard: *const Shard) {
    remember(alloc, SlotKey::Stream(stream), shard)
}

/// The shard of this thread's current stream of `device` for allocator `alloc`, if cached since
/// the current stream last changed and at default-stream generation `generation` (same validity
/// as [`cached_shard`]).
#[inline]
pub(crate) fn current_shard(alloc: u64, device: usize, generation: u64) -> Option<*const Shard> {
    lookup(alloc, SlotKey::Current(device, generation))
}

/// Remembers `shard` as the shard of this thread's current stream of (`alloc`, `device`).
pub(crate) fn cache_current_shard(alloc: u64, device: usize, generation: u64, shard: *const Shard) {
    remember(alloc, SlotKey::Current(device, generation), shard)
}

#[inline]
fn lookup(alloc: u64, key: SlotKey) -> Option<*const Shard> {
    SHARDS.with(|cache| {
        let cache = cache.borrow();
        let hit = |slot: &ShardSlot| slot.alloc == alloc && slot.key == key;
        // The slot written last is the usual hit (one allocator, one stream): try it first.
        let newest = &cache.0[(cache.1 + SHARD_SLOTS - 1) % SHARD_SLOTS];
        let slot = if hit(newest) {
            newest
        } else {
            cache.0.iter().find(|slot| hit(slot))?
        };
        if slot.shard.is_null() {
            return None;
        }
        // SAFETY: a shard of allocator `alloc`, alive while it lives (see the module docs); only
        // that allocator looks its slots up.
        let serial = unsafe { &*slot.shard }.serial();
        // Recycled for another stream since it was cached (`Shard::recycle`): a miss.
        (serial == slot.serial).then_some(slot.shard)
    })
}

/// Stores an entry, replacing the oldest (with the front cache of the shard if the thread has one).
fn remember(alloc: u64, key: SlotKey, shard: *const Shard) {
    forget_shard(alloc, key);
    // SAFETY: `shard` was just taken from a live allocator (see the module docs).
    let live = unsafe { &*shard };
    let front = FRONTS
        .try_with(|fronts| {
            fronts
                .borrow()
                .0
                .iter()
                .find(|f| f.cache.serves(live.serial()) && !f.cache.is_retired())
                .map_or(std::ptr::null(), |f| Arc::as_ptr(&f.cache))
        })
        .unwrap_or(std::ptr::null());
    SHARDS.with(|cache| {
        let (slots, next) = &mut *cache.borrow_mut();
        slots[*next % SHARD_SLOTS] = ShardSlot {
            alloc,
            key,
            shard,
            serial: live.serial(),
            front,
        };
        *next = (*next + 1) % SHARD_SLOTS;
    })
}

/// This thread's front cache of `shard`, as the slots know it.
#[inline]
fn known_front(shard: &Shard) -> Option<*const FrontCache> {
    SHARDS
        .try_with(|cache| {
            cache
                .borrow()
                .0
                .iter()
                .find(|slot| {
                    std::ptr::eq(slot.shard, shard)
                        && slot.serial == shard.serial()
                        && !slot.front.is_null()
                })
                .map(|slot| slot.front)
        })
        .ok()
        .flatten()
}

/// Takes a block held for size class `class` out of this thread's front cache of `shard`: its
/// index and address.
#[inline]
pub(crate) fn take_from_front(shard: &Shard, class: NonZeroU32) -> Option<(BlockId, u64)> {
    let front = known_front(shard)?;
    // SAFETY: slot pointers to front caches are cleared before `FRONTS` drops its references
    // (`ThreadFronts::drop`) and are only set from entries of `FRONTS`, which never removes one
    // while the thread runs; so the cache is alive.
    let entry = unsafe { &*front }.take(class)?;
    Some((entry.block, entry.ptr))
}

/// Hands `entry` (a block of `shard`) to this thread's front cache of `shard`, making the cache on
/// first use; false when the thread or the allocator is going away or the cache is full.
pub(crate) fn keep_in_front(
    shard: &Shard,
    entry: FrontEntry,
    limit: u64,
    taken: impl FnOnce(),
) -> bool {
    let front = match known_front(shard) {
        Some(front) => front,
        None => match start_front(shard) {
            Some(front) => front,
            None => return false,
        },
    };
    // SAFETY: as in `take_from_front`.
    unsafe { &*front }.keep(entry, limit, taken)
}

/// This thread's front cache of `shard`: found in `FRONTS` or made and registered, and noted in
/// every slot of the shard. `None` while the thread's storage is being torn down or the
/// allocator is closing.
#[cold]
fn start_front(shard: &Shard) -> Option<*const FrontCache> {
    let front = FRONTS
        .try_with(|fronts| {
            let mut fronts = fronts.borrow_mut();
            if let Some(found) = fronts
                .0
                .iter()
                .find(|f| f.cache.serves(shard.serial()) && !f.cache.is_retired())
            {
                return Some(Arc::as_ptr(&found.cache));
            }
            let made = shard.register_front()?;
            let ptr = Arc::as_ptr(&made);
            // Retired caches (of allocators dropped since) are forgotten here, and with them any
            // slot pointer to them.
            let before = fronts.0.len();
            fronts.0.retain(|f| !f.cache.is_retired());
            if fronts.0.len() != before {
                // No slot cache (thread exit): no pointer to forget.
                let _ = SHARDS.try_with(|cache| {
                    for slot in cache.borrow_mut().0.iter_mut() {
                        slot.front = std::ptr::null();
                    }
                });
            }
            fronts.0.push(ThreadFront {
                shard: NonNull::from(shard),
                cache: made,
            });
            Some(ptr)
        })
        .ok()
        .flatten()?;
    // No slot cache (thread exit): the front is found through `FRONTS` next time.
    let _ = SHARDS.try_with(|cache| {
        for slot in cache.borrow_mut().0.iter_mut() {
            if std::ptr::eq(slot.shard, shard) && slot.serial == shard.serial() {
                slot.front = front;
            }
        }
    });
    Some(front)
}

/// Forgets this thread's cached shards of `device`'s current stream, of every generation.
fn forget_current_shards(alloc: u64, device: usize) {
    SHARDS.with(|cache| {
        for slot in cache.borrow_mut().0.iter_mut() {
            if slot.alloc == alloc && matches!(slot.key, SlotKey::Current(d, _) if d == device) {
                *slot = EMPTY_SLOT;
            }
        }
    })
}

/// Forgets this thread's cached shards of `device`, by stream and by current stream.
fn forget_device_shards(alloc: u64, device: usize) {
    // No slot cache (thread exit): nothing cached to forget.
    let _ = SHARDS.try_with(|cache| {
        for slot in cache.borrow_mut().0.iter_mut() {
            let of_device = match slot.key {
                SlotKey::Stream(stream) => stream.device() == device,
                SlotKey::Current(d, _) => d == device,
            };
            if slot.alloc == alloc && of_device {
                *slot = EMPTY_SLOT;
            }
        }
    });
}

fn forget_shard(alloc: u64, key: SlotKey) {
    SHARDS.with(|cache| {
        for slot in cache.borrow_mut().0.iter_mut() {
            if slot.alloc == alloc && slot.key == key {
                *slot = EMPTY_SLOT;
            }
        }
    })
}
