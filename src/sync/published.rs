//! A value readers see through a plain reference — no lock, no reference count, one load — that
//! a writer replaces by publishing another: the allocator's live configuration (read on every
//! allocation, changed a handful of times in a program's life: `Runtime::reconfigure`).
//!
//! Every value ever published stays alive until the cell drops, so a reference handed out keeps
//! pointing at the value it was read from (a reader mid-way through an allocation finishes it
//! under the settings it started with). Publishing a value equal to one kept before reuses it, so
//! a program toggling between settings keeps one copy of each, not one per toggle.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicPtr, Ordering};

use super::os::Mutex;

/// See the module docs.
pub(crate) struct Published<T> {
    /// The value `get` returns: always one of `kept`'s boxes.
    current: AtomicPtr<T>,
    /// Every value published, in boxes that never move their contents; only grows.
    kept: Mutex<Vec<Box<T>>>,
    /// `get` hands `&T` to every thread: the cell is `Sync` only where `T` is.
    _shared: PhantomData<T>,
}

impl<T> Published<T> {
    /// A cell holding `value`.
    pub(crate) fn new(value: T) -> Self {
        let mut first = Box::new(value);
        let current = AtomicPtr::new(&mut *first as *mut T);
        Published {
            current,
            kept: Mutex::new(vec![first]),
            _shared: PhantomData,
        }
    }

    /// The value published last (as of this call).
    #[inline]
    pub(crate) fn get(&self) -> &T {
        // SAFETY: `current` always points into one of `kept`'s boxes (set in `new` and
        // `publish`, under `kept`'s lock, only to a box `kept` holds); the boxes are never
        // removed or dropped before `self`, and a box's contents do not move when the vector
        // grows. The Acquire load pairs with `publish`'s Release store, so the value is seen
        // whole. The reference borrows `self`, which outlives it.
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

    fn publish_locked(current: &AtomicPtr<T>, kept: &mut Vec<Box<T>>, value: T) {
        let at = match kept.iter().position(|k| **k == value) {
            Some(at) => at,
            None => {
                kept.push(Box::new(value));
                kept.len() - 1
            }
        };
        let ptr: *mut T = &mut *kept[at];
        current.store(ptr, Ordering::Release);
    }

    /// How many distinct values the cell keeps.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.kept.lock().len()
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
    }
}
