//! The one place that chooses synchronization primitives.
//!
//! No other file names `std::sync` or `loom` (but this module's own child `short_mutex.rs`, a
//! lock of our own built on an atomic word and `futex`). Two families are exported:
//!
//! * [`os`] — always the real thing (`std` locks without poisoning, atomics and `Arc`). Used by code that
//!   talks to the operating system or to other processes (host-backend stream workers, shared-memory
//!   cells, driver tables). Loom cannot model FFI, `mmap`ed memory or processes, so this code is never
//!   run under a loom model.
//! * [`model`] — the primitives of the in-process protocols that `loom_tests/` model-checks (the COW
//!   context, the IPC slot protocol). Under `--cfg loom` they are loom's shims; otherwise the same
//!   real types as [`os`], so production code pays nothing for being checkable.

mod short_mutex;

/// Real operating-system primitives, never swapped for loom's.
///
/// The locks are `std`'s (futexes on Linux, whose whole state is the lock's own word) behind the
/// same non-poisoning interface as [`model`]'s. Not `parking_lot`'s: those park contended threads
/// in one process-wide table, which a forked child inherits with the queues of threads that do
/// not exist there, so a child's *own* fresh locks can deadlock or crash on first contention
/// (parking_lot issue #515). A forked child may build a runtime of its own (`process`).
pub(crate) mod os {
    pub(crate) use super::short_mutex::{ShortMutex, ShortMutexGuard};
    pub(crate) use std::sync::{
        Arc, MutexGuard, OnceLock, RwLockReadGuard, RwLockWriteGuard, Weak,
    };

    /// A mutex whose `lock` ignores poisoning (see [`super::model`] for why that is sound here).
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T: ?Sized>(std::sync::Mutex<T>);

    impl<T> Mutex<T> {
        /// A new mutex.
        pub(crate) const fn new(value: T) -> Self {
            Mutex(std::sync::Mutex::new(value))
        }
    }

    impl<T: ?Sized> Mutex<T> {
        /// Locks (waiting as long as it takes).
        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        /// The value, through exclusive access (no locking).
        pub(crate) fn get_mut(&mut self) -> &mut T {
            self.0
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }
    }

    /// A reader-writer lock whose `read` and `write` ignore poisoning.
    #[derive(Debug, Default)]
    pub(crate) struct RwLock<T: ?Sized>(std::sync::RwLock<T>);

    impl<T> RwLock<T> {
        /// A new lock.
        pub(crate) const fn new(value: T) -> Self {
            RwLock(std::sync::RwLock::new(value))
        }
    }

    impl<T: ?Sized> RwLock<T> {
        /// Shared access.
        pub(crate) fn read(&self) -> RwLockReadGuard<'_, T> {
            self.0
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        /// Exclusive access.
        pub(crate) fn write(&self) -> RwLockWriteGuard<'_, T> {
            self.0
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        /// Shared access if it is free now (no writer holds or waits for the lock).
        pub(crate) fn try_read(&self) -> Option<RwLockReadGuard<'_, T>> {
            match self.0.try_read() {
                Ok(guard) => Some(guard),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        }
    }

    /// A condition variable for [`Mutex`] guards.
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(std::sync::Condvar);

    impl Condvar {
        /// A new condition variable.
        pub(crate) const fn new() -> Self {
            Condvar(std::sync::Condvar::new())
        }

        /// Waits for a notification (or a spurious wake-up), unlocking `guard` meanwhile.
        pub(crate) fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
            self.0
                .wait(guard)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        /// Wakes one waiter.
        pub(crate) fn notify_one(&self) {
            self.0.notify_one();
        }

        /// Wakes every waiter.
        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }

    /// Real atomics. Also the only atomics that may be placed in shared memory mapped from a file.
    pub(crate) mod atomic {
        pub(crate) use std::sync::atomic::{
            AtomicBool, AtomicIsize, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize,
            Ordering,
        };
    }
}

/// Primitives of the model-checked protocols: loom's under `--cfg loom`, real ones otherwise.
///
/// The locks are wrapped so that they never report poisoning: a panic while one is held is a bug
/// that the panic itself reports; the protected state of these protocols stays consistent at every
/// await point (each critical section is a few field updates), so later users go on with it rather
/// than every call site writing `unwrap_or_else(|p| p.into_inner())`.
#[allow(unused_imports)]
pub(crate) mod model {
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
    pub(crate) mod atomic {
        #[cfg(loom)]
        pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
        #[cfg(not(loom))]
        pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    }
}
