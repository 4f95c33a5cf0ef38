//! Per-thread state of every allocator: the current stream per device and a small cache of the
//! shards this thread used last, so the hot path finds its shard with one thread-local access — no
//! shared map, no lock, no atomic.
//!
//! The cache holds plain pointers keyed by (allocator id, stream). That is sound without any
//! reference count because of two facts the allocator guarantees:
//!
//! * a shard stays in its device's map (which holds it) for the allocator's whole life — only the
//!   allocator's `Drop` removes shards;
//! * allocator ids come from a process-wide counter and are never reused.
//!
//! So an entry is only ever read by a call on the allocator that cached it (`&self` proves that
//! allocator alive, hence the shard), and entries of dropped allocators can never match again;
//! they are overwritten as the cache rotates. The cache has no destructor and a constant
//! initializer, so reaching it is a plain thread-local access.

use std::cell::RefCell;

use super::shard::Shard;
use crate::driver::StreamId;

/// Entries of the shard cache.
const SHARD_SLOTS: usize = 8;

/// What a cached shard is the shard of.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotKey {
    /// A stream.
    Stream(StreamId),
    /// This thread's current stream of a device (dropped when the current stream changes).
    Current(usize),
}

/// One cached shard (a null pointer marks an empty slot).
#[derive(Clone, Copy)]
struct ShardSlot {
    alloc: u64,
    key: SlotKey,
    shard: *const Shard,
}

const EMPTY_SLOT: ShardSlot = ShardSlot {
    alloc: 0,
    key: SlotKey::Current(usize::MAX),
    shard: std::ptr::null(),
};

struct ThreadState {
    /// ((allocator id, device), current stream)
    current: Vec<((u64, usize), StreamId)>,
    /// ((allocator id, device), this thread's default stream) with `default_stream:per_thread`.
    per_thread: Vec<((u64, usize), StreamId)>,
}

thread_local! {
    static STATE: RefCell<ThreadState> = const {
        RefCell::new(ThreadState {
            current: Vec::new(),
            per_thread: Vec::new(),
        })
    };
    /// The shard cache; slot `next` is overwritten next.
    static SHARDS: RefCell<([ShardSlot; SHARD_SLOTS], usize)> =
        const { RefCell::new(([EMPTY_SLOT; SHARD_SLOTS], 0)) };
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
        forget_shard(alloc, SlotKey::Current(device));
        let previous = s.current.iter().find(|(k, _)| *k == key).map(|(_, st)| *st);
        s.current.retain(|(k, _)| *k != key);
        if let Some(stream) = stream {
            s.current.push((key, stream));
        }
        previous
    })
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
/// the current stream last changed (same validity as [`cached_shard`]).
#[inline]
pub(crate) fn current_shard(alloc: u64, device: usize) -> Option<*const Shard> {
    lookup(alloc, SlotKey::Current(device))
}

/// Remembers `shard` as the shard of this thread's current stream of (`alloc`, `device`).
pub(crate) fn cache_current_shard(alloc: u64, device: usize, shard: *const Shard) {
    remember(alloc, SlotKey::Current(device), shard)
}

#[inline]
fn lookup(alloc: u64, key: SlotKey) -> Option<*const Shard> {
    SHARDS.with(|cache| {
        cache
            .borrow()
            .0
            .iter()
            .find(|slot| slot.alloc == alloc && slot.key == key && !slot.shard.is_null())
            .map(|slot| slot.shard)
    })
}

/// Stores an entry, replacing the oldest.
fn remember(alloc: u64, key: SlotKey, shard: *const Shard) {
    forget_shard(alloc, key);
    SHARDS.with(|cache| {
        let (slots, next) = &mut *cache.borrow_mut();
        slots[*next % SHARD_SLOTS] = ShardSlot { alloc, key, shard };
        *next = (*next + 1) % SHARD_SLOTS;
    })
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
