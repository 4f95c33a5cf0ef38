//! Which process an object belongs to, so that a forked child never acts for its parent.
//!
//! `fork` copies every cudalloc object into the child: runtimes, shards and their caches, leases on
//! other processes' slots, stream tables whose worker threads exist only in the parent, locks that
//! a parent thread held at that instant. The memory behind them is not all copied: segments, event
//! cells and ref-counter slots are shared mappings, the file locks sit on open file descriptions the
//! child shares with its parent, and the parent's page server answers for its sockets. A child
//! acting on them frees, poisons or reuses memory its parent still uses, or waits forever on a lock
//! or a thread that is not there.
//!
//! So every process-bound object records its [`Birth`] when it is made, and asks
//! [`Birth::is_current`] (one relaxed atomic load) *before it takes any lock*:
//!
//! | what the object is asked for             | in its own process | in a forked child                          |
//! |------------------------------------------|--------------------|--------------------------------------------|
//! | allocate, stream work, share, open, stats | done               | [`Error::ForkedChild`] naming both pids   |
//! | free, drop, empty the cache              | done               | nothing: the object and what it holds are leaked in the child (the child's copy of its own heap is private; what is shared belongs to the parent) |
//!
//! Where an object's state is reached through one value, the check is made by that value, so no
//! door can forget it: the allocator, its memory pools and its captures reach their devices only
//! through `alloc::engine::Cores`, which checks first (its `all`/`get` answer
//! [`Error::ForkedChild`], its `in_its_process` gives a drop nothing to release); a storage
//! reaches its lock only through a checked accessor; every configuration change goes through one
//! checked path (`alloc/reconfigure.rs`).
//!
//! A child that wants memory builds its own runtime (and driver): objects born in the child are
//! the child's, and work normally there. The process-wide registries under those objects (live
//! shared-memory names, leases, opened mappings, sanitizers) are [`PerProcess`] values: a child
//! gets fresh, empty ones on first use, and its parent's — whose locks another parent thread may
//! have held at the instant of the fork — are left untouched (leaked) in the child.
//!
//! How a child knows it is one: a `pthread_atfork` child handler, registered the first time a
//! birth is taken (so before any process-bound object exists), adds one to a process-wide fork
//! count. That handler only does an atomic add, which is async-signal-safe, as the handler of a
//! fork from a multi-threaded process must be. A birth is the count at creation; an object is in
//! its process while the count has not moved. (Comparing pids instead would cost a system call per
//! allocation, and a pid seen across pid namespaces proves nothing.)

use std::fmt;

use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use crate::sync::os::OnceLock;

/// Forks this process has gone through since it was exec'ed (its ancestors' forks included: the
/// count is inherited and incremented in each child).
static FORKS: AtomicU64 = AtomicU64::new(0);

/// This process's pid, kept by the child handler too: taking a birth costs no system call.
static PID: AtomicU32 = AtomicU32::new(0);

/// Whether the child handler is registered (`Ok`) or why it could not be (then a forked child is
/// not detected; logged once).
static HANDLER: OnceLock<std::result::Result<(), i32>> = OnceLock::new();

extern "C" fn count_a_fork_in_the_child() {
    // Async-signal-safe: `getpid` and two atomic writes, no allocation, no lock.
    // rustix's `getpid` is the system call itself (no cached value, no lock).
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    PID.store(u32::try_from(pid).unwrap_or(0), Ordering::Relaxed);
    FORKS.fetch_add(1, Ordering::Release);
}

fn register_handler() {
    let registered = HANDLER.get_or_init(|| {
        PID.store(std::process::id(), Ordering::Relaxed);
        // SAFETY: registers a child handler that only calls `getpid` and writes atomics
        // (async-signal-safe, no lock, no allocation); the prepare and parent handlers are absent.
        // `pthread_atfork` has no other precondition.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(count_a_fork_in_the_child)) };
        if rc == 0 {
            Ok(())
        } else {
            Err(rc)
        }
    });
    if let Err(rc) = registered {
        tracing::warn!(
            rc,
            "pthread_atfork failed: a forked child will not be detected"
        );
    }
}

/// The process an object was made in (see the [module docs](self)).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Birth {
    forks: u64,
    pid: u32,
}

impl fmt::Debug for Birth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Birth(pid {}, fork {})", self.pid, self.forks)
    }
}

impl Birth {
    /// The birth of an object made now, in this process.
    pub(crate) fn now() -> Birth {
        register_handler();
        Birth {
            forks: FORKS.load(Ordering::Acquire),
            pid: PID.load(Ordering::Relaxed),
        }
    }

    /// Whether this is still the process the object was made in (false in a forked child).
    #[inline]
    pub(crate) fn is_current(self) -> bool {
        FORKS.load(Ordering::Relaxed) == self.forks
    }

    /// `Ok` in the object's own process; in a forked child, [`Error::ForkedChild`] saying that
    /// `what` belongs to the parent.
    #[inline]
    pub(crate) fn check(self, what: &str) -> Result<()> {
        if self.is_current() {
            Ok(())
        } else {
            Err(self.refusal(what))
        }
    }

    /// False in the object's own process; in a forked child, true after a warning that `what`
    /// (a call that returns no `Result`: a registration, `empty_cache`) was ignored there.
    pub(crate) fn ignored_in_child(self, what: &str) -> bool {
        if self.is_current() {
            return false;
        }
        tracing::warn!(err = %self.refusal("this object"), "{what}: ignored");
        true
    }

    #[cold]
    fn refusal(self, what: &str) -> Error {
        Error::ForkedChild(format!(
            "{what} belongs to process {}, and process {} is a child forked from it: it cannot \
             allocate, free or run stream work for its parent (build a runtime in the child)",
            self.pid,
            std::process::id()
        ))
    }
}

/// A process-wide value of which each process has its own: a forked child gets a fresh one (made
/// by `init`) the first time it asks, and never touches its parent's — whose locks another thread
/// of the parent may have held when it forked. Each process's value is made once and never freed
/// (a static), so references to it stay valid. Reading it is one atomic load and a comparison.
pub(crate) struct PerProcess<T> {
    current: AtomicPtr<Generation<T>>,
    init: fn() -> T,
}

struct Generation<T> {
    forks: u64,
    value: T,
}

impl<T: 'static> PerProcess<T> {
    /// A value made by `init` on first use in each process.
    pub(crate) const fn new(init: fn() -> T) -> Self {
        PerProcess {
            current: AtomicPtr::new(std::ptr::null_mut()),
            init,
        }
    }

    /// This process's value.
    pub(crate) fn get(&self) -> &T {
        let forks = FORKS.load(Ordering::Acquire);
        let mut seen = self.current.load(Ordering::Acquire);
        loop {
            // SAFETY: a non-null pointer here came from `Box::leak` below and is never freed
            // (each process's value lives as long as the process, like a static).
            if let Some(generation) = unsafe { seen.as_ref() } {
                if generation.forks == forks {
                    return &generation.value;
                }
            }
            register_handler();
            // Leaked: each process's value lives as long as the process (a thread that loses the
            // race below leaks its fresh, empty value — a few bytes, once per racing thread).
            let fresh: &'static Generation<T> = Box::leak(Box::new(Generation {
                forks,
                value: (self.init)(),
            }));
            let published = std::ptr::from_ref(fresh).cast_mut();
            match self.current.compare_exchange(
                seen,
                published,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                // The previous process's value (if any) is left as it is: leaked, never locked.
                Ok(_) => return &fresh.value,
                // Another thread of this process published first: use its value.
                Err(now) => seen = now,
            }
        }
    }
}

impl<T: 'static> std::ops::Deref for PerProcess<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.get()
    }
}

/// In a forked child, takes `value` out of `slot` and leaks it (its drop would act for the
/// parent); in the object's own process, does nothing. For `Drop` impls of process-bound objects.
pub(crate) fn leak_in_child<T: Default>(birth: Birth, slot: &mut T) {
    if !birth.is_current() {
        std::mem::forget(std::mem::take(slot));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_per_process_value_is_made_once_per_fork_count() {
        static VALUE: PerProcess<crate::sync::os::Mutex<Vec<u32>>> =
            PerProcess::new(|| crate::sync::os::Mutex::new(Vec::new()));
        VALUE.lock().push(1);
        let first: *const _ = VALUE.get();
        VALUE.lock().push(2);
        assert_eq!(*VALUE.lock(), [1, 2]);
        assert!(std::ptr::eq(first, VALUE.get()));
        // Threads racing for the first value of a fresh static all get the same one.
        static RACED: PerProcess<AtomicU64> = PerProcess::new(|| AtomicU64::new(0));
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| RACED.fetch_add(1, Ordering::Relaxed));
            }
        });
        assert_eq!(RACED.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_birth_is_current_until_the_fork_count_moves() {
        let birth = Birth::now();
        assert!(birth.is_current());
        assert!(birth.check("this").is_ok());
        assert_eq!(birth.pid, std::process::id());
        // What an object made before one more fork sees (the count a child handler would leave):
        let before_a_fork = Birth {
            forks: birth.forks.wrapping_sub(1),
            ..birth
        };
        assert!(!before_a_fork.is_current());
        let err = before_a_fork.check("the runtime").unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::ForkedChild);
        assert!(
            err.to_string().contains("build a runtime in the child"),
            "{err}"
        );
    }
}
