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
//! | 128 + 4·RING        | slots of 32 bytes: `pending` word (count, generation, closed bit), `held`, `deadline` (unix ms), reserved |
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

use super::limbo::{Counter, SlotCounters};
use crate::error::{Error, Result};
use crate::shm::SharedMemory;
use crate::sync::os::atomic::{AtomicU32, AtomicU64, Ordering};

/// Default slots per file (PyTorch's number).
pub(crate) const DEFAULT_SLOTS: u32 = 10_000;
/// Entries of the release ring.
pub(crate) const RING: u32 = 1024;
const MAGIC: u64 = u64::from_le_bytes(*b"cdalRCNT");
const VERSION: u32 = 2;
const HEADER: u64 = 64;
const CONTROL: u64 = 64;
const SLOT_BYTES: u64 = 32;

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

/// The counters of one slot.
#[repr(C)]
pub(crate) struct SlotCell {
    pending: PendingWord,
    held: AtomicU64,
    /// Unix time (ms) after which every handle of the slot has expired (0: no time-to-live).
    deadline: AtomicU64,
    _reserved: AtomicU64,
}

/// The `pending` word: the count, the slot's generation and the *closed* bit in one atomic, so a
/// claim checks generation and expiry and takes its count in one compare-and-swap.
///
/// | bits   | field                                                                    |
/// |--------|--------------------------------------------------------------------------|
/// | 0..32  | handles sent and not yet opened or given back                           |
/// | 32..63 | generation: bumped each time the producer gives the slot to a new storage |
/// | 63     | closed: the producer reclaimed the counts of expired handles             |
///
/// A stale handle (older generation) or an expired one (closed slot) can neither take nor give back
/// a count: a handle is either opened or reclaimed, never both.
#[repr(transparent)]
pub(crate) struct PendingWord(AtomicU64);

const COUNT_MASK: u64 = (1 << 32) - 1;
const GEN_SHIFT: u32 = 32;
const GEN_MASK: u64 = (1 << 31) - 1;
const CLOSED: u64 = 1 << 63;

fn generation_of(word: u64) -> u32 {
    ((word >> GEN_SHIFT) & GEN_MASK) as u32
}

impl Counter for PendingWord {
    fn increment(&self) -> u64 {
        // The producer sends one more handle; a closed slot reopens with this one count (every
        // earlier count was reclaimed). The count saturates instead of spilling into the generation.
        let old = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                if w & CLOSED != 0 {
                    Some((w & !CLOSED & !COUNT_MASK) | 1)
                } else if w & COUNT_MASK == COUNT_MASK {
                    None
                } else {
                    Some(w + 1)
                }
            })
            .unwrap_or(COUNT_MASK);
        old & COUNT_MASK
    }

    fn decrement(&self) -> bool {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                (w & CLOSED == 0 && w & COUNT_MASK > 0).then(|| w - 1)
            })
            .is_ok()
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst) & COUNT_MASK
    }
}

fn file_size(slots: u32) -> u64 {
    HEADER + CONTROL + u64::from(RING) * 4 + u64::from(slots) * SLOT_BYTES
}

impl Counter for AtomicU64 {
    fn increment(&self) -> u64 {
        self.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_add(1))
            .unwrap_or(u64::MAX)
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
    type P = PendingWord;

    fn pending(&self) -> &PendingWord {
        &self.pending
    }

    fn held(&self) -> &AtomicU64 {
        &self.held
    }
}

/// Why a claim on a slot was refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The slot belongs to a newer storage than the handle's.
    Stale,
    /// The handle's time-to-live ran out (the producer reclaims its count).
    Expired,
    /// No count to take (released twice, or a corrupt file).
    Underflow,
}

impl Refused {
    pub(crate) fn into_error(self, slot: u32) -> Error {
        Error::bad_handle(match self {
            Refused::Stale => format!(
                "slot {slot} belongs to a newer storage: the handle is stale (its storage was freed)"
            ),
            Refused::Expired => format!(
                "the handle of slot {slot} expired (ipc_handle_ttl_s) before it was opened"
            ),
            Refused::Underflow => format!("slot {slot} has no pending count (opened twice?)"),
        })
    }
}

/// Unix time in milliseconds.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl SlotCell {
    /// Producer: gives a free slot to a new storage; returns the slot's new generation.
    pub(crate) fn assign(&self) -> u32 {
        let next = (generation_of(self.pending.0.load(Ordering::SeqCst)) as u64 + 1) & GEN_MASK;
        self.held.store(0, Ordering::SeqCst);
        self.deadline.store(0, Ordering::SeqCst);
        self.pending.0.store(next << GEN_SHIFT, Ordering::SeqCst);
        next as u32
    }

    /// Producer: resets the counts of a slot whose holders are proven dead (generation kept).
    pub(crate) fn clear(&self) {
        let generation = u64::from(generation_of(self.pending.0.load(Ordering::SeqCst)));
        self.held.store(0, Ordering::SeqCst);
        self.pending
            .0
            .store(generation << GEN_SHIFT, Ordering::SeqCst);
    }

    /// The slot's current generation.
    pub(crate) fn generation(&self) -> u32 {
        generation_of(self.pending.0.load(Ordering::SeqCst))
    }

    /// Producer (or a forwarding consumer): one more handle sent, valid until `expires_ms` (0: no
    /// time-to-live). The slot's deadline is the latest expiry of its handles; a handle without a
    /// time-to-live pushes it to "never" (`u64::MAX`), so counts are reclaimed only when *every*
    /// handle that may still be pending has expired — a producer and a forwarder configured
    /// differently cannot get a handle without a time-to-live refused.
    pub(crate) fn add_pending_until(&self, expires_ms: u64) {
        let expiry = if expires_ms == 0 {
            u64::MAX
        } else {
            expires_ms
        };
        self.deadline.fetch_max(expiry, Ordering::SeqCst);
        self.add_pending();
    }

    fn take_count(&self, generation: u32) -> std::result::Result<(), Refused> {
        self.pending
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                let ok = w & CLOSED == 0 && generation_of(w) == generation && w & COUNT_MASK > 0;
                ok.then(|| w - 1)
            })
            .map(|_| ())
            .map_err(|w| {
                if generation_of(w) != generation {
                    Refused::Stale
                } else if w & CLOSED != 0 {
                    Refused::Expired
                } else {
                    Refused::Underflow
                }
            })
    }

    /// Consumer (lock held): becomes a holder of the handle's storage — `held` is raised before
    /// `pending` is lowered, so nobody reading `pending` then `held` sees both at 0 midway.
    pub(crate) fn claim(
        &self,
        generation: u32,
        expires_ms: u64,
    ) -> std::result::Result<(), Refused> {
        if expires_ms != 0 && now_ms() >= expires_ms {
            return Err(Refused::Expired);
        }
        self.held.increment();
        self.take_count(generation).inspect_err(|_| {
            self.held.decrement();
        })
    }

    /// Consumer: gives an unopened handle's count back. A stale or expired handle has no count to
    /// give (the producer already reclaimed it): that is not an error.
    pub(crate) fn give_back(&self, generation: u32) -> std::result::Result<(), Refused> {
        match self.take_count(generation) {
            Err(Refused::Stale | Refused::Expired) => Ok(()),
            other => other,
        }
    }

    /// Producer: past the slot's deadline, takes back every count still pending and closes the slot
    /// (later claims of those handles are refused). Returns the counts reclaimed.
    pub(crate) fn reclaim_expired(&self, now_ms: u64) -> u64 {
        let deadline = self.deadline.load(Ordering::SeqCst);
        if deadline == 0 || deadline == u64::MAX || now_ms < deadline {
            return 0;
        }
        let old = self
            .pending
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                (w & CLOSED == 0 && w & COUNT_MASK > 0).then_some((w & !COUNT_MASK) | CLOSED)
            });
        old.map_or(0, |w| w & COUNT_MASK)
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
    pub(crate) fn create(name: &str, slots: u32) -> Result<Self> {
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
    pub(crate) fn open(name: &str, producer_pid: u32) -> Result<Self> {
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
    pub(crate) fn name(&self) -> &str {
        self.shm.name()
    }

    /// Number of slots.
    pub(crate) fn slot_count(&self) -> u32 {
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

    /// The counters of `slot`; an error once an access to the file faulted because another
    /// process truncated it (`shm/guard.rs`: the counts read as zeros from then on).
    pub(crate) fn slot(&self, slot: u32) -> Result<&SlotCell> {
        self.shm.check_not_faulted()?;
        Ok(self.at(self.slot_offset(slot)?))
    }

    /// Whether the producer that created the file still runs (its creator lock, valid across pid
    /// namespaces; see `shm`).
    pub(crate) fn producer_alive(&self) -> bool {
        self.shm.creator_alive()
    }

    /// An error when another process truncated the file (a fault survived, or its size now): its
    /// counts are lost, so only the slots' locks can tell who still holds a storage.
    pub(crate) fn intact(&self) -> Result<()> {
        self.shm.check_intact()
    }

    /// Consumer: records that `slot` was released (a hint for the producer's next drain).
    pub(crate) fn push_release(&self, slot: u32) {
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
    pub(crate) fn drain_released(&self) -> Released {
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

    fn lock(&self, slot: u32, lock_type: libc::c_int, cmd: libc::c_int) -> Result<libc::flock> {
        let start = self.slot_offset(slot)?;
        crate::shm::ofd_lock(self.shm.file(), lock_type, cmd, start, SLOT_BYTES)
    }

    /// Consumer: takes the shared lock on `slot`'s bytes (held while the process holds the slot).
    pub(crate) fn lock_shared(&self, slot: u32) -> Result<()> {
        self.lock(slot, libc::F_RDLCK, libc::F_OFD_SETLK)
            .map(|_| ())
    }

    /// Consumer: releases its lock on `slot`.
    pub(crate) fn unlock(&self, slot: u32) -> Result<()> {
        self.lock(slot, libc::F_UNLCK, libc::F_OFD_SETLK)
            .map(|_| ())
    }

    /// Producer: whether any process holds a lock on `slot`'s bytes.
    pub(crate) fn is_locked(&self, slot: u32) -> Result<bool> {
        let fl = self.lock(slot, libc::F_WRLCK, libc::F_OFD_GETLK)?;
        Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh ref-counter file name of this process (the nonce makes it unique).
    fn name() -> String {
        crate::shm::object_name(std::process::id(), crate::shm::random_u64(), "ref", 0)
    }

    #[test]
    fn create_open_and_validate() {
        let n = name();
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
    fn generations_and_expiry_decide_claims_atomically() {
        let f = RefCounterFile::create(&name(), 4).unwrap();
        let s = f.slot(1).unwrap();
        let g1 = s.assign();
        s.add_pending_until(0);
        s.add_pending_until(0);
        assert_eq!(s.claim(g1 + 1, 0), Err(Refused::Stale));
        assert_eq!(s.claim(g1, 0), Ok(()));
        assert_eq!(s.counts(), (1, 1));
        // Reuse: the old handle's remaining count is stale now.
        let g2 = s.assign();
        assert_ne!(g1, g2);
        assert_eq!(s.give_back(g1), Ok(()), "a stale give-back touches nothing");
        assert_eq!(s.counts(), (0, 0));
        // Expiry: the producer reclaims, the late claim is refused, a give-back is a no-op.
        s.add_pending_until(1_000);
        s.add_pending_until(2_000);
        assert_eq!(s.reclaim_expired(1_500), 0, "not every handle expired yet");
        assert_eq!(s.reclaim_expired(2_000), 2);
        assert_eq!(s.counts(), (0, 0));
        assert_eq!(s.claim(g2, 0), Err(Refused::Expired));
        assert_eq!(s.give_back(g2), Ok(()));
        assert_eq!(s.counts(), (0, 0));
        // A new share reopens the slot.
        s.add_pending_until(0);
        assert_eq!(s.claim(g2, 0), Ok(()));
        assert_eq!(
            s.claim(g2, 1),
            Err(Refused::Expired),
            "expired by the clock"
        );
    }

    #[test]
    fn ring_delivers_hints_and_reports_overflow() {
        let f = RefCounterFile::create(&name(), 8).unwrap();
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
        let n = name();
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
