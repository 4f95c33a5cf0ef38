//! Which captures are under way, and whose pool each one allocates from: what the allocation,
//! free and miss paths ask while a stream capture runs (`graph.rs` begins and ends them).
//!
//! | path | while no capture runs | while one runs |
//! |---|---|---|
//! | finding a shard | the thread's cached shard (one load to see no capture runs) | the stream's capture status from the driver, then the capture's pool (its shard), uncached |
//! | a free with stream uses | events recorded, polled later | deferred: the block stays pending; its events are recorded when the last capture ends (no event may be recorded or queried on a capturing stream) |
//! | polling events | before best fit | skipped (a query could be a forbidden call) |
//! | a miss | PyTorch's whole sequence | the driver's allocation alone — with the thread's capture mode relaxed around it when the stream is capturing, as PyTorch's `cudaMallocMaybeCapturing` — then out of memory: releasing cached memory would synchronize |

use super::pool_id::{MemPoolId, MemPoolOptions};
use crate::sync::os::atomic::{AtomicUsize, Ordering};
use crate::sync::os::RwLock;

/// The captures of one allocator under way, by the driver's capture id.
#[derive(Debug, Default)]
pub(crate) struct CaptureRoutes {
    /// Captures begun (counted before the driver's begin, so a free never misses one).
    active: AtomicUsize,
    routes: RwLock<Vec<(u64, MemPoolId, MemPoolOptions)>>,
}

impl CaptureRoutes {
    /// Whether any capture of this allocator is under way (one load).
    #[inline]
    pub(crate) fn any(&self) -> bool {
        self.active.load(Ordering::Acquire) != 0
    }

    /// Counts a capture about to begin.
    pub(crate) fn starting(&self) {
        self.active.fetch_add(1, Ordering::AcqRel);
    }

    /// Routes the allocations of driver capture `capture` to `pool`.
    pub(crate) fn route(&self, capture: u64, pool: MemPoolId, options: MemPoolOptions) {
        self.routes.write().push((capture, pool, options));
    }

    /// The pool of driver capture `capture`, if it is one of this allocator's.
    pub(crate) fn pool_of(&self, capture: u64) -> Option<(MemPoolId, MemPoolOptions)> {
        self.routes
            .read()
            .iter()
            .find(|(c, ..)| *c == capture)
            .map(|&(_, pool, options)| (pool, options))
    }

    /// A capture ended (or never began: `capture` is `None`); returns whether none is left.
    pub(crate) fn ended(&self, capture: Option<u64>) -> bool {
        if let Some(capture) = capture {
            self.routes.write().retain(|(c, ..)| *c != capture);
        }
        self.active.fetch_sub(1, Ordering::AcqRel) == 1
    }
}
