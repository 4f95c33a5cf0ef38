//! A value readers see through a plain reference — no lock, no reference count, one load — that
//! a writer replaces by publishing another: the allocator's live configuration (read on every
//! allocation, changed a handful of times in a program's life: `Runtime::reconfigure`).
//!
//! Every value ever published stays alive until the cell drops, so a reference handed out keeps
//! pointing at the value it was read from (a reader mid-way through an allocation finishes it
//! under the settings it started with). Publishing a value equal to one kept before reuses it, so
//! a program toggling between settings keeps one copy of each, not one per toggle. The values
//! live in heap cells the cell owns through raw pointers and only ever reads through shared
//! references: a kept value is never borrowed mutably again once published.

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, Ordering};

use super::os::Mutex;

/// See the module docs.
pub(crate) struct Published<T> {
    /// The value `get` returns: always one of `kept`.
    current: AtomicPtr<T>,
    /// Every value published (from `Box::into_raw`, freed in `Drop`); only grows.
    kept: Mutex<Vec<NonNull<T>>>,
    /// The cell owns `T`s and hands `&T` to every thread.
    _owns: PhantomData<T>,
}

// SAFETY: the cell owns its values (dropped with it, possibly on another thread: `T: Send`) and
// gives shared references to them to any thread holding `&Published` (`T: Sync`); the raw
// pointers are only the ownership's representation.
unsafe impl<T: Send + Sync> Send for Published<T> {}
// SAFETY: as above; writers are serialized by `kept`'s lock, readers only load `current`.
unsafe impl<T: Send + Sync> Sync for Published<T> {}

impl<T> Published<T> {
    /// A cell holding `value`.
    pub(crate) fn new(value: T) -> Self {
        let first = NonNull::from(Box::leak(Box::new(value)));
        Published {
            current: AtomicPtr::new(first.as_ptr()),
            kept: Mutex::new(vec![first]),
            _owns: PhantomData,
        }
    }

    /// The value published last (as of this call).
    #[inline]
    pub(crate) fn get(&self) -> &T {
        // SAFETY: `current` always points at one of `kept`'s values (set in `new` and
        // `publish_locked` only to a pointer `kept` holds), each a live heap allocation freed
        // only in `Drop`, which cannot run while `&self` is borrowed; nothing writes a kept value
        // after it was published. The Acquire load pairs with the Release store that published
        // it, so the value is seen whole.
        unsafe { &*self.current.load(Ordering::Acquire) }
    }
}

impl<T: PartialEq> Published<T> {
    /// Makes `value` the one later `get`s return (earlier references stay valid).
    pub(crate) fn publish(&self, value: T) {
        let mut kept = self.kept.lock();
        Self::publish_locked(&self.current, &mut kept, value);
    }

    /// Publishes what `next` makes of the current value, one writer at a time (a concurrent
    /// `update` waits, then sees this one's value); nothing is published when `next` fails.
    pub(crate) fn update<E>(&self, next: impl FnOnce(&T) -> Result<T, E>) -> Result<(), E> {
        let mut kept = self.kept.lock();
        let value = next(self.get())?;
        Self::publish_locked(&self.current, &mut kept, value);
        Ok(())
    }

    fn publish_locked(current: &AtomicPtr<T>, kept: &mut Vec<NonNull<T>>, value: T) {
        // SAFETY: every pointer in `kept` is a live value of this cell (see `get`), read shared.
        let found = kept.iter().find(|k| unsafe { k.as_ref() } == &value);
        let ptr = match found {
            Some(k) => *k,
            None => {
                let fresh = NonNull::from(Box::leak(Box::new(value)));
                kept.push(fresh);
                fresh
            }
        };
        current.store(ptr.as_ptr(), Ordering::Release);
    }

    /// How many distinct values the cell keeps.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.kept.lock().len()
    }
}

impl<T> Drop for Published<T> {
    fn drop(&mut self) {
        // Through `&mut self`, not the lock: a forked child dropping its copy must not wait for
        // a lock a thread of its parent held at the fork (`process`).
        for value in self.kept.get_mut().drain(..) {
            // SAFETY: each pointer came from `Box::leak` in this cell, is in `kept` once, and no
            // reference from `get` outlives `&self`, which `drop`'s `&mut self` excludes.
            drop(unsafe { Box::from_raw(value.as_ptr()) });
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Published<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reference_keeps_its_value_and_equal_values_are_kept_once() {
        let cell = Published::new(String::from("a"));
        let before = cell.get();
        cell.publish(String::from("b"));
        assert_eq!(before, "a");
        assert_eq!(cell.get(), "b");
        for _ in 0..10 {
            cell.publish(String::from("a"));
            cell.publish(String::from("b"));
        }
        assert_eq!(cell.kept(), 2);
        assert_eq!(cell.get(), "b");
        let failed: Result<(), &str> = cell.update(|_| Err("refused"));
        assert!(failed.is_err());
        assert_eq!(cell.get(), "b", "a failed update publishes nothing");
    }
}
