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
        pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
    }
}

/// Primitives of the model-checked protocols: loom's under `--cfg loom`, real ones otherwise.
///
/// The locks are wrapped so that they never report poisoning: a panic while one is held is a bug
/// that the panic itself reports; the protected state of these protocols stays consistent at every
/// await point (each critical section is a few field updates), so later users go on with it rather
/// than every call site writing `unwrap_or_else(|p| p.into_inner())`.
#[allow(unused_imports)]
pub mod model {
    #[cfg(loom)]
    use loom::sync as inner;
    #[cfg(not(loom))]
    use std::sync as inner;

    pub(crate) use inner::Arc;
    pub(crate) use inner::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

    /// A mutex whose `lock` ignores poisoning.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(inner::Mutex<T>);

    impl<T> Mutex<T> {
        /// A new mutex.
        pub(crate) fn new(value: T) -> Self {
            Mutex(inner::Mutex::new(value))
        }

        /// Locks (waiting as long as it takes).
        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|p| p.into_inner())
        }
    }

    /// A reader-writer lock whose `read` and `write` ignore poisoning.
    #[derive(Debug, Default)]
    pub(crate) struct RwLock<T>(inner::RwLock<T>);

    impl<T> RwLock<T> {
        /// A new lock.
        pub(crate) fn new(value: T) -> Self {
            RwLock(inner::RwLock::new(value))
        }

        /// Shared access.
        pub(crate) fn read(&self) -> RwLockReadGuard<'_, T> {
            self.0.read().unwrap_or_else(|p| p.into_inner())
        }

        /// Exclusive access.
        pub(crate) fn write(&self) -> RwLockWriteGuard<'_, T> {
            self.0.write().unwrap_or_else(|p| p.into_inner())
        }
    }

    /// Atomics of the modeled protocols.
    pub mod atomic {
        #[cfg(loom)]
        pub use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
        #[cfg(not(loom))]
        pub use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    }
}
