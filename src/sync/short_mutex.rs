//! [`ShortMutex`]: a mutex for short critical sections that several threads take in turn (the
//! allocator's shard state: one stream, a thread pool allocating on it).
//!
//! `std`'s futex mutex marks its word "contended" as soon as one thread sleeps, and from then on
//! every unlock makes a `futex` wake system call, while the woken thread, once it runs, marks the
//! word contended again: two threads taking a lock for ~100 ns each in turn spend most of their
//! time in the kernel (a convoy). This lock keeps its whole state in one 32-bit word, like `std`'s
//! (nothing process-wide: a forked child's fresh locks are unaffected by the parent's threads),
//! and differs in three ways:
//!
//! * one waiter at a time spins (with more threads than cores, spinners would take the holder's
//!   core; the others sleep at once), with a growing pause between looks at the word; a look that finds the
//!   word free looks again a moment later before taking it, so a holder that is merely between
//!   two operations keeps the lock (a hand-off moves the whole protected state, a dozen cache
//!   lines, to the other core); only a lock busy for a long time puts its waiters to sleep;
//! * the word has a cache line of its own: waiters reading it do not pull the value's lines;
//! * sleepers are counted in the word, so an unlock with no sleeper is one atomic subtraction;
//! * at most one wake is under way at a time (the `WOKEN` bit): the woken thread clears it when it
//!   runs, and unlocks meanwhile make no system call.
//!
//! | word | meaning |
//! |---|---|
//! | bit 0 (`LOCKED`) | held |
//! | bit 1 (`WOKEN`) | an unlock woke a sleeper that has not run yet: later unlocks wake no one |
//! | bit 2 (`SPINNER`) | a waiter is spinning: others go to sleep without spinning |
//! | bits 3.. (`SLEEPER` each) | threads registered to sleep (in the kernel, or on their way there) |
//!
//! | step | word change | then |
//! |---|---|---|
//! | lock, free word | `0 → LOCKED` | held |
//! | lock, held, no spinner: spin | `w → w \| SPINNER`, then loads | take it (`→ (w \| LOCKED) & !SPINNER`) when `LOCKED` clears and stays clear a moment, or clear `SPINNER` and register to sleep |
//! | lock, held, a spinner | none | register to sleep |
//! | register to sleep | `w → w + SLEEPER`, only while `LOCKED` is set | `futex_wait(w + SLEEPER)`: returns at once if the word changed since |
//! | back from the kernel | `w → (w - SLEEPER) & !WOKEN` | spin again |
//! | unlock | `w → w - LOCKED` | if sleepers and no `WOKEN`, and still free: set `WOKEN`, wake one |
//!
//! No lost wake-up: a thread registers only while the lock is held, so the holder's unlock sees it
//! counted; if that unlock lands before the thread is in the kernel, the word differs from the value
//! it waits on and the wait returns at once. `WOKEN` never stays set with everyone asleep: it is set
//! only while some thread is registered, and every registered thread either is in the kernel (the
//! wake that follows reaches one of them) or has not reached it yet (its wait returns at once, the
//! word having changed); whichever thread returns clears `WOKEN`.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};

use rustix::thread::futex;

const LOCKED: u32 = 1;
const WOKEN: u32 = 2;
const SPINNER: u32 = 4;
const SLEEPER: u32 = 8;

/// Looks at the word before sleeping; the pause between looks doubles up to [`MAX_PAUSE`] spin
/// hints (about 15,000 hints in all, ~0.4 ms where a hint takes 24 ns: only a lock that stays
/// busy that long puts its waiters to sleep).
const SPIN_LOOKS: u32 = 24;
/// The longest pause between two looks, in spin hints.
const MAX_PAUSE: u32 = 1024;
/// A look that finds the word free waits this many hints and looks again before taking it: a
/// holder that is only between two operations (unlock, then lock again ~25 ns later) keeps the
/// lock, so the protected state's cache lines do not move to the other core at every operation.
const CONFIRM_PAUSE: u32 = 16;

/// A mutex for short critical sections (see the module docs); not poisoned by a panic.
pub(crate) struct ShortMutex<T: ?Sized> {
    word: Word,
    value: UnsafeCell<T>,
}

/// The lock word on a cache line (pair) of its own: waiters reading it do not pull the protected
/// value's lines away from the holder.
#[repr(align(128))]
struct Word(AtomicU32);

impl Deref for Word {
    type Target = AtomicU32;
    fn deref(&self) -> &AtomicU32 {
        &self.0
    }
}

// SAFETY: the lock hands `&mut T` to one thread at a time, so sharing the mutex across threads
// needs only that `T` may move between threads (as `std::sync::Mutex`).
unsafe impl<T: ?Sized + Send> Send for ShortMutex<T> {}
// SAFETY: as above: access to `T` is exclusive while the word's `LOCKED` bit is held.
unsafe impl<T: ?Sized + Send> Sync for ShortMutex<T> {}

impl<T> ShortMutex<T> {
    /// A new, unlocked mutex.
    pub(crate) const fn new(value: T) -> Self {
        ShortMutex {
            word: Word(AtomicU32::new(0)),
            value: UnsafeCell::new(value),
        }
    }
}

impl<T: Default> Default for ShortMutex<T> {
    fn default() -> Self {
        ShortMutex::new(T::default())
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for ShortMutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShortMutex")
            .field("word", &self.word.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<T: ?Sized> ShortMutex<T> {
    /// Locks (waiting as long as it takes).
    #[inline]
    pub(crate) fn lock(&self) -> ShortMutexGuard<'_, T> {
        if self
            .word
            .compare_exchange_weak(0, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        ShortMutexGuard { lock: self }
    }

    /// The value, through exclusive access (no locking).
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }

    /// Takes the lock if it is free now (whatever the sleepers); `true` if taken.
    #[inline]
    fn try_take(&self) -> bool {
        self.update(Ordering::Acquire, |w| {
            (w & LOCKED == 0).then_some(w | LOCKED)
        })
    }

    /// Applies `f` to the word until it holds (`f` says `None`: leave it); `true` if it changed.
    /// `order` is the ordering of the successful change.
    #[inline]
    fn update(&self, order: Ordering, f: impl FnMut(u32) -> Option<u32>) -> bool {
        self.word.fetch_update(order, Ordering::Relaxed, f).is_ok()
    }

    /// Becomes the one spinning waiter if there is none; `true` if it did.
    fn claim_spinner(&self) -> bool {
        self.update(Ordering::Relaxed, |w| {
            (w & SPINNER == 0).then_some(w | SPINNER)
        })
    }

    /// The spinner takes the lock if it is free, giving up `SPINNER` in the same step.
    fn spinner_take(&self) -> bool {
        self.update(Ordering::Acquire, |w| {
            (w & LOCKED == 0).then_some((w | LOCKED) & !SPINNER)
        })
    }

    #[cold]
    fn lock_contended(&self) {
        loop {
            // One waiter at a time spins (the others sleep at once: with more threads than
            // cores, spinners would take the holder's core): it looks at the word with growing
            // pauses and takes it when it is free and still free a moment later.
            if self.claim_spinner() {
                let mut pause = 1;
                for _ in 0..SPIN_LOOKS {
                    if self.word.load(Ordering::Relaxed) & LOCKED == 0 {
                        for _ in 0..CONFIRM_PAUSE {
                            std::hint::spin_loop();
                        }
                        if self.spinner_take() {
                            return;
                        }
                    }
                    for _ in 0..pause {
                        std::hint::spin_loop();
                    }
                    pause = (pause * 2).min(MAX_PAUSE);
                }
                self.word.fetch_and(!SPINNER, Ordering::Relaxed);
            } else if self.try_take() {
                return;
            }
            // Register to sleep, only while the lock is held (so that its unlock sees us).
            let registered = self
                .word
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                    (w & LOCKED != 0).then_some(w + SLEEPER)
                });
            let Ok(before) = registered else {
                // Freed meanwhile: take it if still free, else round again.
                if self.try_take() {
                    return;
                }
                continue;
            };
            let expected = before + SLEEPER;
            // Returns at once if the word is no longer `expected` (an unlock came first), on a
            // wake, or on a signal: all the same here. No other error can come for a valid
            // address, and any would only mean one more round.
            let _ = futex::wait(&self.word, futex::Flags::PRIVATE, expected, None);
            // Running again: no longer registered, and no wake under way (ours, or one meant for
            // another sleeper: at worst a later unlock wakes one thread more).
            self.update(Ordering::Relaxed, |w| Some((w - SLEEPER) & !WOKEN));
        }
    }

    #[inline]
    fn unlock(&self) {
        let before = self.word.fetch_sub(LOCKED, Ordering::Release);
        if before >= SLEEPER && before & WOKEN == 0 {
            self.wake_one();
        }
    }

    #[cold]
    fn wake_one(&self) {
        // Wake only while there is a sleeper, no wake is under way, and no one took the lock
        // meanwhile (its own unlock will wake).
        if self.update(Ordering::Relaxed, |w| {
            (w >= SLEEPER && w & (WOKEN | LOCKED) == 0).then_some(w | WOKEN)
        }) {
            // A failed wake leaves `WOKEN` set only until a registered thread returns from its
            // wait (module docs); it cannot fail for a valid address.
            let _ = futex::wake(&self.word, futex::Flags::PRIVATE, 1);
        }
    }
}

/// Exclusive access to a [`ShortMutex`]'s value; unlocks when dropped.
pub(crate) struct ShortMutexGuard<'a, T: ?Sized> {
    lock: &'a ShortMutex<T>,
}

impl<T: ?Sized> Deref for ShortMutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while this thread holds `LOCKED`.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T: ?Sized> DerefMut for ShortMutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard exists only while this thread holds `LOCKED`, and `&mut self` makes
        // this the only reference through it.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T: ?Sized> Drop for ShortMutexGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.unlock();
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for ShortMutexGuard<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Threads well past the cores, each critical section a read-modify-write of two fields that
    /// a second holder would tear: the sums come out exact and no thread is left asleep (the
    /// test would hang).
    #[test]
    fn many_threads_on_two_cores_keep_the_sections_exclusive_and_all_finish() {
        const THREADS: u64 = 8;
        const ROUNDS: u64 = 20_000;
        let m = Arc::new(ShortMutex::new((0u64, 0u64)));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for i in 0..ROUNDS {
                        let mut g = m.lock();
                        let a = g.0;
                        std::hint::black_box(&a);
                        g.0 = a + 1;
                        g.1 += t + i;
                        if i % 1000 == 0 {
                            std::thread::yield_now(); // holders that lose the core: sleepers
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let g = m.lock();
        assert_eq!(g.0, THREADS * ROUNDS);
        let per_thread_i: u64 = (0..ROUNDS).sum();
        let t_sum: u64 = (0..THREADS).sum::<u64>() * ROUNDS;
        assert_eq!(g.1, THREADS * per_thread_i + t_sum);
        assert_eq!(
            m.word.load(Ordering::Relaxed),
            LOCKED,
            "no sleeper or wake left over"
        );
    }

    /// A holder that keeps the lock long enough for every waiter to go to sleep, then releases:
    /// each waiter is woken in turn (one wake at a time) and gets the lock.
    #[test]
    fn sleepers_are_woken_one_after_another() {
        let m = Arc::new(ShortMutex::new(0u32));
        let g = m.lock();
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || *m.lock() += 1)
            })
            .collect();
        // Wait until all four registered to sleep (the word counts them); no timing involved.
        while m.word.load(Ordering::Relaxed) < LOCKED + 4 * SLEEPER {
            std::thread::yield_now();
        }
        drop(g);
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(*m.lock(), 4);
        assert_eq!(m.word.load(Ordering::Relaxed), 0);
    }
}
