//! Ref-counter files: shared-memory files of many slots, one slot per shared storage, through
//! which consumer processes tell the producer when it may free the memory.
//!
//! Layout (all little endian, every counter an atomic):
//!
//! | offset              | content                                                         |
//! |---------------------|-----------------------------------------------------------------|
//! | 0                   | header: magic `cdalRCNT`, version, slot count, producer pid, ring size |
//! | 64                  | ring control: `head` (producer's read position), `tail` (next write position), `overflow` flag |
//! | 128                 | ring: `RING` × u32 released-slot hints (slot + 1; 0 = empty)    |
//! | 128 + 4·RING        | slots: `pending`, `held` (u64 each)                             |
//!
//! Slot counters (the producer frees the storage when both are 0 and its own storage is gone):
//!
//! | event                                   | `pending` | `held` | lock on the slot's bytes |
//! |-----------------------------------------|-----------|--------|--------------------------|
//! | producer sends a handle                 | +1        |        |                          |
//! | consumer opens it (first in its process) | −1 (after) | +1 (first) | shared OFD lock taken before |
//! | consumer opens it again / drops it unopened | −1     |        |                          |
//! | consumer releases its lease             |           | −1     | released after           |
//!
//! `held` is raised before `pending` is lowered, so the producer (reading `pending` then `held`)
//! never sees both at 0 while a consumer is mid-way. A process killed outright loses its OFD locks
//! (Linux drops them with the last descriptor), so a slot with `pending == 0`, `held > 0` and no lock
//! belongs to dead consumers only: its memory can be reclaimed.
//!
//! Draining is proportional to what consumers released: each release pushes its slot number into
//! the ring, and the producer reads only the new entries. The ring is a *hint* — every hinted slot
//! is re-checked against its counters — so a lost or stale entry can delay a free but never cause a
//! wrong one; when the ring overflows, the producer falls back to one scan of its limbo.

use std::os::fd::AsRawFd;

use super::limbo::{Counter, SlotCounters};
use crate::error::{Error, Result};
use crate::shm::SharedMemory;
use crate::sync::os::atomic::{AtomicU32, AtomicU64, Ordering};

/// Default slots per file (PyTorch's number).
pub const DEFAULT_SLOTS: u32 = 10_000;
/// Entries of the release ring.
pub const RING: u32 = 1024;
const MAGIC: u64 = u64::from_le_bytes(*b"cdalRCNT");
const VERSION: u32 = 1;
const HEADER: u64 = 64;
const CONTROL: u64 = 64;
const SLOT_BYTES: u64 = 16;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    slots: AtomicU32,
    producer_pid: AtomicU32,
    ring: AtomicU32,
}

#[repr(C)]
struct Control {
    head: AtomicU64,
    tail: AtomicU64,
    overflow: AtomicU32,
}

/// The two counters of one slot.
#[repr(C)]
pub(crate) struct SlotCell {
    pending: AtomicU64,
    held: AtomicU64,
}

fn file_size(slots: u32) -> u64 {
    HEADER + CONTROL + u64::from(RING) * 4 + u64::from(slots) * SLOT_BYTES
}

impl Counter for AtomicU64 {
    fn increment(&self) -> u64 {
        self.fetch_add(1, Ordering::SeqCst)
    }

    fn decrement(&self) -> bool {
        self.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
            .is_ok()
    }

    fn get(&self) -> u64 {
        self.load(Ordering::SeqCst)
    }
}

impl SlotCounters for SlotCell {
    type C = AtomicU64;

    fn pending(&self) -> &AtomicU64 {
        &self.pending
    }

    fn held(&self) -> &AtomicU64 {
        &self.held
    }
}

impl SlotCell {
    /// Producer: resets a slot (a fresh slot, or one whose holders are proven dead).
    pub fn clear(&self) {
        self.pending.store(0, Ordering::SeqCst);
        self.held.store(0, Ordering::SeqCst);
    }
}

/// A counter that went below zero: a foreign process released more than it held.
pub(crate) fn underflow(what: &str) -> Error {
    Error::bad_handle(format!("slot {what} count is already 0 (released twice?)"))
}

/// What a drain of the release ring found.
#[derive(Debug, Default)]
pub(crate) struct Released {
    /// Slots that consumers released since the last drain (hints).
    pub slots: Vec<u32>,
    /// The ring overflowed: some releases were not recorded, scan instead.
    pub overflowed: bool,
}

/// A mapped ref-counter file.
#[derive(Debug)]
pub(crate) struct RefCounterFile {
    shm: SharedMemory,
    slots: u32,
}

impl RefCounterFile {
    /// Creates a file of `slots` slots (0600, exclusive, no symlinks — see `shm.rs`).
    pub fn create(name: &str, slots: u32) -> Result<Self> {
        if slots == 0 {
            return Err(Error::invalid("a ref-counter file needs at least one slot"));
        }
        let shm = SharedMemory::create(name, file_size(slots))?;
        let file = RefCounterFile { shm, slots };
        let h = file.header();
        h.version.store(VERSION, Ordering::SeqCst);
        h.slots.store(slots, Ordering::SeqCst);
        h.producer_pid.store(std::process::id(), Ordering::SeqCst);
        h.ring.store(RING, Ordering::SeqCst);
        h.magic.store(MAGIC, Ordering::SeqCst);
        Ok(file)
    }

    /// Opens another process's file and checks that it is ours in header and size.
    pub fn open(name: &str, producer_pid: u32) -> Result<Self> {
        super::wire::validate_ref_file_name(name)?;
        let shm = SharedMemory::open(name, None)?;
        if shm.len() < HEADER + CONTROL {
            return Err(Error::bad_handle(format!(
                "{name} is too small to be a ref-counter file"
            )));
        }
        let probe = RefCounterFile { shm, slots: 0 };
        let h = probe.header();
        let (magic, version, slots, pid, ring) = (
            h.magic.load(Ordering::SeqCst),
            h.version.load(Ordering::SeqCst),
            h.slots.load(Ordering::SeqCst),
            h.producer_pid.load(Ordering::SeqCst),
            h.ring.load(Ordering::SeqCst),
        );
        if magic != MAGIC || version != VERSION || ring != RING || pid != producer_pid || slots == 0
        {
            return Err(Error::bad_handle(format!(
                "{name} is not a ref-counter file of process {producer_pid} (magic {magic:#x}, version {version}, pid {pid})"
            )));
        }
        if probe.shm.len() != file_size(slots) {
            return Err(Error::bad_handle(format!(
                "{name} has {} bytes; {slots} slots need {}",
                probe.shm.len(),
                file_size(slots)
            )));
        }
        Ok(RefCounterFile {
            shm: probe.shm,
            slots,
        })
    }

    /// The file's name in `/dev/shm`.
    pub fn name(&self) -> &str {
        self.shm.name()
    }

    /// Number of slots.
    pub fn slot_count(&self) -> u32 {
        self.slots
    }

    fn at<T>(&self, offset: u64) -> &T {
        debug_assert!(offset + std::mem::size_of::<T>() as u64 <= self.shm.len());
        // SAFETY: callers pass offsets inside the mapping (header and control are within the
        // checked minimum size; ring and slot offsets are bounds-checked against the validated slot
        // count); the mapping is page aligned and every offset is a multiple of 8 (or 4 for ring
        // entries); the types are atomics only, valid for any bytes another process wrote; the
        // reference lives no longer than `self`, which keeps the mapping.
        unsafe { &*(self.shm.as_ptr().add(offset as usize) as *const T) }
    }

    fn header(&self) -> &Header {
        self.at(0)
    }

    fn control(&self) -> &Control {
        self.at(HEADER)
    }

    fn ring_entry(&self, pos: u64) -> &AtomicU32 {
        self.at(HEADER + CONTROL + (pos % u64::from(RING)) * 4)
    }

    fn slot_offset(&self, slot: u32) -> Result<u64> {
        if slot >= self.slots {
            return Err(Error::bad_handle(format!(
                "slot {slot} does not exist in {} ({} slots)",
                self.name(),
                self.slots
            )));
        }
        Ok(HEADER + CONTROL + u64::from(RING) * 4 + u64::from(slot) * SLOT_BYTES)
    }

    /// The counters of `slot`.
    pub fn slot(&self, slot: u32) -> Result<&SlotCell> {
        Ok(self.at(self.slot_offset(slot)?))
    }

    /// Consumer: records that `slot` was released (a hint for the producer's next drain).
    pub fn push_release(&self, slot: u32) {
        let c = self.control();
        // `head` and `tail` are written by other processes: never trusted for arithmetic.
        let pos = c.tail.fetch_add(1, Ordering::SeqCst);
        if pos
            >= c.head
                .load(Ordering::SeqCst)
                .saturating_add(u64::from(RING))
        {
            c.overflow.store(1, Ordering::SeqCst);
            return;
        }
        self.ring_entry(pos)
            .store(slot.wrapping_add(1), Ordering::SeqCst);
    }

    /// Producer: takes the hints pushed since the last drain. Stops at an entry that was claimed
    /// but not yet written (it is read next time); on overflow reports it and skips ahead.
    pub fn drain_released(&self) -> Released {
        let c = self.control();
        let mut out = Released {
            overflowed: c.overflow.swap(0, Ordering::SeqCst) != 0,
            ..Released::default()
        };
        let tail = c.tail.load(Ordering::SeqCst);
        let mut head = c.head.load(Ordering::SeqCst);
        if head > tail {
            // Corrupt (or scribbled) positions: resynchronize and fall back to a scan.
            out.overflowed = true;
            head = tail;
        } else if tail - head > u64::from(RING) {
            out.overflowed = true;
            head = tail - u64::from(RING);
        }
        while head < tail {
            let v = self.ring_entry(head).swap(0, Ordering::SeqCst);
            if v == 0 {
                break;
            }
            // A hint naming no slot of this file is ignored (callers re-check every hint).
            if v - 1 < self.slots {
                out.slots.push(v - 1);
            }
            head += 1;
        }
        c.head.store(head, Ordering::SeqCst);
        out
    }

    fn lock(&self, slot: u32, lock_type: libc::c_short, cmd: libc::c_int) -> Result<libc::flock> {
        let start = self.slot_offset(slot)?;
        // SAFETY: flock is a plain C struct; all-zero is a valid value.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = lock_type;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = start as libc::off_t;
        fl.l_len = SLOT_BYTES as libc::off_t;
        // SAFETY: the descriptor is open for the life of `self.shm`; `fl` is a valid flock for
        // the duration of the call; F_OFD_* commands only read/write `fl`.
        let rc = unsafe {
            libc::fcntl(
                self.shm.file().as_raw_fd(),
                cmd,
                &mut fl as *mut libc::flock,
            )
        };
        if rc == -1 {
            return Err(Error::Driver {
                backend: "host",
                call: "fcntl(F_OFD_*)",
                message: std::io::Error::last_os_error().to_string(),
            });
        }
        Ok(fl)
    }

    /// Consumer: takes the shared lock on `slot`'s bytes (held while the process holds the slot).
    pub fn lock_shared(&self, slot: u32) -> Result<()> {
        self.lock(slot, libc::F_RDLCK as libc::c_short, libc::F_OFD_SETLK)
            .map(|_| ())
    }

    /// Consumer: releases its lock on `slot`.
    pub fn unlock(&self, slot: u32) -> Result<()> {
        self.lock(slot, libc::F_UNLCK as libc::c_short, libc::F_OFD_SETLK)
            .map(|_| ())
    }

    /// Producer: whether any process holds a lock on `slot`'s bytes.
    pub fn is_locked(&self, slot: u32) -> Result<bool> {
        let fl = self.lock(slot, libc::F_WRLCK as libc::c_short, libc::F_OFD_GETLK)?;
        Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(tag: &str) -> String {
        format!(
            "cudalloc-{}-{:016x}-{tag}-ref0",
            std::process::id(),
            crate::shm::random_u64()
        )
    }

    #[test]
    fn create_open_and_validate() {
        let n = name("a");
        let f = RefCounterFile::create(&n, 16).unwrap();
        let g = RefCounterFile::open(&n, std::process::id()).unwrap();
        assert_eq!(g.slot_count(), 16);
        assert!(
            RefCounterFile::open(&n, std::process::id() + 1).is_err(),
            "wrong producer pid"
        );
        assert!(g.slot(16).is_err());
        f.slot(3).unwrap().add_pending();
        assert_eq!(g.slot(3).unwrap().counts(), (1, 0));
        assert!(g.slot(3).unwrap().pending_to_held());
        assert_eq!(f.slot(3).unwrap().counts(), (0, 1));
        assert!(
            !g.slot(3).unwrap().give_back_pending(),
            "no wrap-around below 0"
        );
    }

    #[test]
    fn ring_delivers_hints_and_reports_overflow() {
        let f = RefCounterFile::create(&name("b"), 8).unwrap();
        f.push_release(5);
        f.push_release(2);
        let r = f.drain_released();
        assert_eq!(r.slots, vec![5, 2]);
        assert!(!r.overflowed);
        for i in 0..RING + 3 {
            f.push_release(i % 8);
        }
        let r = f.drain_released();
        assert!(r.overflowed);
        assert_eq!(r.slots.len(), RING as usize);
        assert!(f.drain_released().slots.is_empty());
    }

    #[test]
    fn ofd_locks_are_seen_by_another_open_file_description() {
        let n = name("c");
        let producer = RefCounterFile::create(&n, 4).unwrap();
        let consumer = RefCounterFile::open(&n, std::process::id()).unwrap();
        assert!(!producer.is_locked(1).unwrap());
        consumer.lock_shared(1).unwrap();
        assert!(producer.is_locked(1).unwrap());
        assert!(!producer.is_locked(2).unwrap());
        consumer.unlock(1).unwrap();
        assert!(!producer.is_locked(1).unwrap());
        consumer.lock_shared(2).unwrap();
        drop(consumer); // closing the descriptor drops its locks, as a dying process does
        assert!(!producer.is_locked(2).unwrap());
    }
}
