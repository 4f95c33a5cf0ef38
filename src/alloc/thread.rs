//! Per-thread state of every allocator: the current stream per device and a small cache of the
//! shards this thread used last, so the hot path finds its shard with one thread-local access and
//! one reference-count increment — no shared map, no lock.
//!
//! Cached shards are weak references: a thread cache never keeps an allocator's shards (and with
//! them its driver) alive after the allocator is dropped. Upgrading costs the same one atomic
//! read-modify-write as cloning a strong reference would.

use std::cell::RefCell;

use super::shard::Shard;
use crate::driver::StreamId;
use crate::sync::os::{Arc, Weak};

/// Entries of the shard cache.
const SHARD_SLOTS: usize = 4;

#[derive(Default)]
struct ThreadState {
    /// ((allocator id, device), current stream)
    current: Vec<((u64, usize), StreamId)>,
    /// ((allocator id, device), this thread's default stream) with `default_stream:per_thread`.
    per_thread: Vec<((u64, usize), StreamId)>,
    /// ((allocator id, stream), shard), most recent last.
    shards: Vec<((u64, StreamId), Weak<Shard>)>,
}

thread_local! {
    static STATE: RefCell<ThreadState> = RefCell::new(ThreadState::default());
}

/// This thread's current stream of `device` for allocator `alloc`, if one was set.
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

/// The cached shard of (`alloc`, `stream`), if this thread has a live one.
#[inline]
pub(crate) fn cached_shard(alloc: u64, stream: StreamId) -> Option<Arc<Shard>> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let at = s.shards.iter().rposition(|(k, _)| *k == (alloc, stream))?;
        match s.shards[at].1.upgrade().filter(|shard| shard.is_alive()) {
            Some(shard) => Some(shard),
            None => {
                s.shards.remove(at);
                None
            }
        }
    })
}

/// Remembers `shard` as this thread's shard of (`alloc`, `stream`).
pub(crate) fn cache_shard(alloc: u64, stream: StreamId, shard: &Arc<Shard>) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.shards
            .retain(|(k, sh)| *k != (alloc, stream) && sh.strong_count() > 0);
        if s.shards.len() >= SHARD_SLOTS {
            s.shards.remove(0);
        }
        s.shards.push(((alloc, stream), Arc::downgrade(shard)));
    })
}
