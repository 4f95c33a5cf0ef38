//! Which captures are under way, and whose pool each one allocates from: what the allocation,
//! free and miss paths ask while a stream capture runs (`graph.rs` begins and ends them).
//!
//! | path | while no capture runs | while one runs |
//! |---|---|---|
//! | finding a shard | the thread's cached shard (one load to see no capture runs) | the stream's capture status from the driver, then the capture's pool (its shard), uncached |
//! | a free with stream uses | events recorded, polled later | deferred: the block stays pending; its events are recorded when the last capture ends (no event may be recorded or queried on a capturing stream) |
//! | polling events | before best fit | skipped (a query could be a forbidden call) |
//! | a miss | PyTorch's whole sequence | the driver's allocation alone — with the thread's capture mode relaxed around it when the stream is capturing, as PyTorch's `cudaMallocMaybeCapturing` — then out of memory: releasing cached memory would synchronize |
//!
//! A pool is *held by graphs* from the moment a capture begins routing to it until its last
//! capture and last graph are gone ([`GraphHold`]). While held, its freed blocks stay the
//! graphs': replays may touch them, so the stream sanitizer is told of those frees as
//! *graph-held* (a replay touching them is no use after free; a replay touching them once they
//! were handed out to an eager allocation of the pool is reported: it writes another owner's
//! memory), `MemPool::empty_cache` keeps them, and `use_on_oom` lends none of them to eager work
//! — found by the randomized capture/replay/eager mix (`tests/graph_mix.rs`).
//!
//! A capture the allocator begins records an event on its stream just before (its *eager tail*):
//! the stream's work queued before the capture, which work outside the capture may still have
//! to wait for (a lazy clone read on that stream, then stolen elsewhere: `engine/handover.rs`).
//! A stream that is capturing cannot be waited for otherwise: its own events are the capture's.
//!
//! Accesses an upper layer takes inside a capture (a storage's typed kernel or copy) are kept per
//! capture ([`CapturedUse`]); the [`Graph`](super::Graph) takes them at its end and orders each
//! replay with them, as the storages order their own accesses: a replay is one more access of
//! every storage its capture touched, and the graph keeps those storages alive.
//!
//! The capture gate ([`CaptureRoutes::releasing`]): every driver free and unmap of cached memory
//! holds its read side, a capture's start its write side, so no release runs while a capture
//! does. Segment observers are told of an unmap inside the gate: an observer must not begin a
//! capture (nor wait for a thread that does), or the two wait on each other.

use std::collections::HashMap;

use super::pool_id::{MemPoolId, MemPoolOptions};
use crate::driver::{EventId, StreamId};
use crate::error::Result;
use crate::process::{Birth, PerProcess};
use crate::sync::os::atomic::{AtomicUsize, Ordering};
use crate::sync::os::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

/// An access an upper layer took on a capturing stream (a storage's, `storage/order.rs`): kept
/// by the capture's graph, which orders each replay with it.
pub(crate) trait CapturedUse: Send + Sync + std::fmt::Debug {
    /// Enqueues `launch` on `stream` ordered after the earlier accesses that conflict with the
    /// uses of `uses` (this one among them; all of one graph), and records the replay as their
    /// access — or an error when one of them cannot be replayed any more.
    fn order_replay(
        &self,
        uses: &[Arc<dyn CapturedUse>],
        stream: StreamId,
        launch: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()>;

    /// Whether a replay ordered with this use is ordered as `other` asks too (the same memory,
    /// the same or a weaker mode): `other` need not be kept.
    fn covers(&self, other: &dyn CapturedUse) -> bool;

    /// For the upper layer to recognize its own uses.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// The accesses of one capture.
pub(crate) type CapturedUses = Vec<Arc<dyn CapturedUse>>;

/// Every allocator's captures under way in this process, by the driver's capture id: an access
/// inside a capture is kept by the allocator that began it, whichever allocator owns the storage
/// (found by review: a capture of one runtime writing another runtime's storage kept nothing, and
/// its replays wrote under the other runtime's zero-copy slices).
static UNDER_WAY: PerProcess<Mutex<Vec<UnderWay>>> = PerProcess::new(|| Mutex::new(Vec::new()));

/// A capture under way: its id, and the allocator that began it.
type UnderWay = (u64, Weak<CaptureRoutes>);

/// Whether any allocator of this process has a capture under way (one load).
pub(crate) fn any_capture_under_way() -> bool {
    UNDER_WAY_COUNT.load(Ordering::Acquire) != 0
}

/// How many captures [`UNDER_WAY`] holds (process-wide, like it; a forked child's copy may be
/// off, which only costs a capture-status query per access).
static UNDER_WAY_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Keeps `used` for capture `capture` in the allocator that began it, if one did (a capture begun
/// on the driver alone keeps nothing: its replays are raw and the caller's to order): whether
/// one did.
pub(crate) fn note_captured_use(capture: u64, used: Arc<dyn CapturedUse>) -> bool {
    let routes = UNDER_WAY
        .lock()
        .iter()
        .find(|(c, _)| *c == capture)
        .and_then(|(_, r)| r.upgrade());
    routes.is_some_and(|r| r.note_use(capture, used))
}

/// The captures of one allocator under way, by the driver's capture id.
#[derive(Debug, Default)]
pub(crate) struct CaptureRoutes {
    /// Captures begun (counted before the driver's begin, so a free never misses one).
    active: AtomicUsize,
    routes: RwLock<Vec<(u64, MemPoolId, MemPoolOptions)>>,
    /// For the captures this allocator began: the origin stream and an event recorded on it just
    /// before the capture began — the stream's eager work, which work outside the capture can
    /// still be ordered after (`engine/handover.rs`).
    tails: RwLock<Vec<(u64, StreamId, EventId)>>,
    /// Pools held by graphs: captures and graphs per pool (see the module docs).
    held: RwLock<HashMap<MemPoolId, usize>>,
    /// Whether any pool is held (one load when none is).
    any_held: AtomicUsize,
    /// Held (read) by every driver free and unmap of cached memory, taken (write) by a capture
    /// starting: a release in flight ends before a capture begins, and one after sees it
    /// ([`CaptureRoutes::releasing`]; found by review — a release that checked before a capture
    /// began on another thread freed during it, which CUDA refuses, invalidating the capture).
    gate: RwLock<()>,
    /// Held (read) by every wait the allocator enqueues between streams, from the capture status
    /// it asks to the wait enqueued; taken (write) by a capture of this allocator's from just
    /// before the driver's begin until its eager tail is known ([`CaptureRoutes::ordering`];
    /// found by the model of every exit on the CUDA double — a wait checked before a capture
    /// began on another thread and enqueued after joined the waiting stream to the capture, whose
    /// end then failed with unjoined work; a wait between the begin and the tail's entry found
    /// the stream capturing with no tail, and refused).
    beginning: RwLock<()>,
    /// The accesses taken inside each capture under way ([`CapturedUse`]).
    uses: Mutex<Vec<(u64, CapturedUses)>>,
}

/// One capture's or one graph's hold on its pool (see the module docs); released on drop — in
/// the allocator's process only (in a forked child the holds are the parent's, and the lock of
/// the book may have been held by a parent thread at the fork).
#[derive(Debug)]
pub(crate) struct GraphHold {
    routes: Arc<CaptureRoutes>,
    pool: MemPoolId,
    birth: Birth,
}

impl GraphHold {
    /// Another hold on the same pool (a graph taking over from its capture).
    pub(crate) fn another(&self) -> GraphHold {
        CaptureRoutes::hold(&self.routes, self.pool, self.birth)
    }
}

impl Drop for GraphHold {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            return;
        }
        let mut held = self.routes.held.write();
        if let Some(n) = held.get_mut(&self.pool) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.pool);
                self.routes.any_held.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

impl CaptureRoutes {
    /// Whether any capture of this allocator is under way (one load).
    #[inline]
    pub(crate) fn any(&self) -> bool {
        self.active.load(Ordering::Acquire) != 0
    }

    /// Counts a capture about to begin, once no release is in flight.
    pub(crate) fn starting(&self) {
        let _no_release_in_flight = self.gate.write();
        self.active.fetch_add(1, Ordering::AcqRel);
    }

    /// Held while a wait between streams is decided and enqueued: no capture of this allocator
    /// begins meanwhile, and one that began has its eager tail known. Never held across a host
    /// wait (a capture's start would wait for a stream's work).
    pub(crate) fn ordering(&self) -> RwLockReadGuard<'_, ()> {
        self.beginning.read()
    }

    /// Held by a capture's start from before the driver's begin until its tail and route are
    /// entered ([`Self::ordering`]'s other side). Taken after [`Self::starting`] (never while the
    /// release gate is held: a release may wait for a stream, and order one); no shard lock is
    /// taken while it is held (a free takes [`Self::ordering`] under its shard's lock).
    pub(crate) fn beginning(&self) -> RwLockWriteGuard<'_, ()> {
        self.beginning.write()
    }

    /// Permission to free or unmap cached memory: held for the driver calls, `None` while a
    /// capture runs (the memory then waits for the next release after it).
    pub(crate) fn releasing(&self) -> Option<RwLockReadGuard<'_, ()>> {
        let gate = self.gate.read();
        (!self.any()).then_some(gate)
    }

    /// [`Self::releasing`] without waiting: `None` also when the gate is not free now — for a
    /// free that may run inside the gate already (a `DataPtr` dropped by an observer, or by the
    /// cross-stream path's own rollback), which must not wait for a capture waiting for it.
    pub(crate) fn releasing_now(&self) -> Option<RwLockReadGuard<'_, ()>> {
        let gate = self.gate.try_read()?;
        (!self.any() && !any_capture_under_way()).then_some(gate)
    }

    /// Routes the allocations of driver capture `capture` to `pool`, and makes the capture known
    /// to the process (its accesses are kept here, [`note_captured_use`]).
    pub(crate) fn route(
        this: &Arc<CaptureRoutes>,
        capture: u64,
        pool: MemPoolId,
        options: MemPoolOptions,
    ) {
        this.routes.write().push((capture, pool, options));
        UNDER_WAY.lock().push((capture, Arc::downgrade(this)));
        UNDER_WAY_COUNT.fetch_add(1, Ordering::AcqRel);
    }

    /// Remembers `event`, recorded on `stream` just before capture `capture` began there.
    pub(crate) fn tail(&self, capture: u64, stream: StreamId, event: EventId) {
        self.tails.write().push((capture, stream, event));
    }

    /// The event after the eager work of `stream`, which a capture of this allocator's began on.
    pub(crate) fn eager_tail(&self, stream: StreamId) -> Option<EventId> {
        self.tails
            .read()
            .iter()
            .find(|&&(_, s, _)| s == stream)
            .map(|&(.., e)| e)
    }

    /// The pool of driver capture `capture`, if it is one of this allocator's.
    pub(crate) fn pool_of(&self, capture: u64) -> Option<(MemPoolId, MemPoolOptions)> {
        self.routes
            .read()
            .iter()
            .find(|(c, ..)| *c == capture)
            .map(|&(_, pool, options)| (pool, options))
    }

    /// A hold of a capture or graph on `pool`, by the allocator born in `birth`.
    pub(crate) fn hold(this: &Arc<CaptureRoutes>, pool: MemPoolId, birth: Birth) -> GraphHold {
        let mut held = this.held.write();
        let n = held.entry(pool).or_insert(0);
        if *n == 0 {
            this.any_held.fetch_add(1, Ordering::AcqRel);
        }
        *n += 1;
        GraphHold {
            routes: Arc::clone(this),
            pool,
            birth,
        }
    }

    /// Whether captures or graphs hold `pool` (one load while none holds any).
    #[inline]
    pub(crate) fn held_by_graphs(&self, pool: MemPoolId) -> bool {
        self.any_held.load(Ordering::Acquire) != 0 && self.held.read().contains_key(&pool)
    }

    /// Keeps `used` for capture `capture`, when it is one of this allocator's: whether it is.
    pub(crate) fn note_use(&self, capture: u64, used: Arc<dyn CapturedUse>) -> bool {
        if self.pool_of(capture).is_none() {
            return false;
        }
        let mut uses = self.uses.lock();
        match uses.iter_mut().find(|(c, _)| *c == capture) {
            // A capture of many kernels on the same storages keeps one use of each (at most a
            // read and a write): a replay orders with each kept use.
            Some((_, list)) if list.iter().any(|u| u.covers(&*used)) => {}
            Some((_, list)) => list.push(used),
            None => uses.push((capture, vec![used])),
        }
        true
    }

    /// The accesses taken inside capture `capture`, taken out (its graph keeps them).
    pub(crate) fn take_uses(&self, capture: u64) -> CapturedUses {
        let mut uses = self.uses.lock();
        match uses.iter().position(|(c, _)| *c == capture) {
            Some(i) => uses.swap_remove(i).1,
            None => Vec::new(),
        }
    }

    /// A capture ended (or never began: `capture` is `None`); returns whether none is left, and
    /// the capture's tail event, for the caller to destroy.
    pub(crate) fn ended(&self, capture: Option<u64>) -> (bool, Option<EventId>) {
        let mut tail = None;
        if let Some(capture) = capture {
            self.routes.write().retain(|(c, ..)| *c != capture);
            let mut under_way = UNDER_WAY.lock();
            let before = under_way.len();
            under_way.retain(|(c, _)| *c != capture);
            UNDER_WAY_COUNT.fetch_sub(before - under_way.len(), Ordering::AcqRel);
            drop(under_way);
            // Not taken by a graph (a capture dropped or failed): nothing replays them.
            drop(self.take_uses(capture));
            let mut tails = self.tails.write();
            if let Some(i) = tails.iter().position(|&(c, ..)| c == capture) {
                tail = Some(tails.remove(i).2);
            }
        }
        (self.active.fetch_sub(1, Ordering::AcqRel) == 1, tail)
    }
}
