//! The one place that chooses synchronization primitives.
//!
//! No other file names `std::sync`, `parking_lot` or `loom`. Two families are exported:
//!
//! * [`os`] — always the real thing (`parking_lot` locks, `std` atomics and `Arc`). Used by code that
//!   talks to the operating system or to other processes (host-backend stream workers, shared-memory
//!   cells, driver tables). Loom cannot model FFI, `mmap`ed memory or processes, so this code is never
//!   run under a loom model.
//! * [`model`] — the primitives of the in-process protocols that `loom_tests/` model-checks (the COW
//!   context, the IPC slot protocol). Under `--cfg loom` they are loom's shims; otherwise the same
//!   real types as [`os`], so production code pays nothing for being checkable.

/// Real operating-system primitives, never swapped for loom's.
pub(crate) mod os {
    pub(crate) use parking_lot::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};
    pub(crate) use std::sync::{Arc, OnceLock, Weak};

    /// Real atomics. Also the only atomics that may be placed in shared memory mapped from a file.
    pub(crate) mod atomic {
        pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
    }
}

/// Primitives of the model-checked protocols: loom's under `--cfg loom`, real ones otherwise.
#[allow(unused_imports)]
pub mod model {
    #[cfg(loom)]
    pub(crate) use loom::sync::{Arc, Mutex, MutexGuard, RwLock};
    #[cfg(not(loom))]
    pub(crate) use std::sync::{Arc, Mutex, MutexGuard, RwLock};

    /// Atomics of the modeled protocols.
    pub mod atomic {
        #[cfg(loom)]
        pub use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
        #[cfg(not(loom))]
        pub use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    }
}
