//! Guarded mappings: a `SIGBUS` in a mapping of a named shared-memory object is survived, not
//! fatal.
//!
//! Any process of our user can `ftruncate` an object in `/dev/shm` (a segment, a ref-counter file,
//! an event chunk); every mapping of the cut pages then faults with `SIGBUS` on its next touch,
//! which kills the process — a peer could kill a producer that way. Named files cannot be sealed
//! against it (tmpfs files opened by name carry `F_SEAL_SEAL`; only memfds can be sealed, and the
//! chunks of expandable segments are), so the faults are handled instead:
//!
//! | step | who                     | what                                                          |
//! |------|-------------------------|---------------------------------------------------------------|
//! | 1    | [`Guard::new`]          | the mapping's range goes into a fixed table of atomics; the handler is installed once per process (the previous action kept) |
//! | 2    | a peer                  | truncates the object                                           |
//! | 3    | the faulting thread     | a kernel-raised `SIGBUS` (`BUS_ADRERR`) at an address in a guarded range: the handler maps fresh private zero pages over the range from the faulting page to its end (`MAP_FIXED`), records the lowest damaged offset, and returns; the access is retried on the new pages |
//! | 4    | the owner of the mapping| [`Guard::damage`] says the object was cut and from where: an error for what the object concerns (its storages, its slots) |
//! | 5    | [`Guard`]'s drop        | the range leaves the table before the mapping is unmapped      |
//!
//! A `SIGBUS` at any other address goes to the action that was installed before ours (Rust's own
//! stack-overflow handler, or the default action, which ends the process as before). A `SIGBUS`
//! that another process *sent* (its `si_addr` is whatever the sender chose) never replaces a
//! mapping: it goes to the previous action too, and ours is put back after it (Rust's handler
//! resets the action to the default before returning). The handler
//! only reads and writes atomics and makes two system calls (`mmap`, and `sigaction` when it hands
//! a fault back to the default action), which is what a signal handler may do. The bytes of the cut
//! pages are gone for every process — the file system freed them — so nothing is lost by replacing
//! them; what was written to the private pages afterwards is seen by this process alone, which is
//! why the damage is an error and not a repair.
//!
//! Limits: [`SLOTS`] mappings are guarded at once (more are mapped unguarded, with a warning); a
//! program that installs its own `SIGBUS` handler after cudalloc's replaces ours unless it chains
//! to the action it found.

use crate::sync::os::atomic::{AtomicUsize, Ordering};
use nix::sys::signal::{self, SaFlags, SigAction, SigHandler, SigSet, Signal};

use crate::sync::os::OnceLock;

/// Mappings guarded at once.
pub(crate) const SLOTS: usize = 16_384;

/// `si_code` of a `SIGBUS` the kernel raises for an access past the end of a mapped file (Linux's
/// `BUS_ADRERR`). Only such faults are handled: a `SIGBUS` another process *sends* (`kill`,
/// `sigqueue`, with `si_code <= 0` and any `si_addr` it likes) must not make the handler replace a
/// live mapping.
const BUS_ADRERR: libc::c_int = 2;

/// One guarded range. A slot is claimed by a compare-and-swap of `start` from 0; its fields are
/// written between two increments of `seq` (odd while being written), and the handler uses a
/// range only if it read the same even `seq` before and after `start` and `len` — never the
/// `start` of one registration with the `len` of the next.
struct Slot {
    seq: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    /// 1 + the lowest damaged offset in the range; 0 while undamaged.
    damaged_from: AtomicUsize,
}

impl Slot {
    const fn free() -> Self {
        Slot {
            seq: AtomicUsize::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            damaged_from: AtomicUsize::new(0),
        }
    }

    /// Writes the slot's fields with `seq` odd meanwhile.
    fn write(&self, len: usize) {
        self.seq.fetch_add(1, Ordering::SeqCst);
        self.len.store(len, Ordering::SeqCst);
        self.damaged_from.store(0, Ordering::SeqCst);
        self.seq.fetch_add(1, Ordering::SeqCst);
    }

    /// `(start, len)` of a stable, registered range.
    fn range(&self) -> Option<(usize, usize)> {
        let before = self.seq.load(Ordering::SeqCst);
        let (start, len) = (
            self.start.load(Ordering::SeqCst),
            self.len.load(Ordering::SeqCst),
        );
        let stable = before.is_multiple_of(2) && self.seq.load(Ordering::SeqCst) == before;
        (stable && start != 0 && len != 0).then_some((start, len))
    }
}

static TABLE: [Slot; SLOTS] = [const { Slot::free() }; SLOTS];

/// The `SIGBUS` action found before ours was installed (what faults outside guarded ranges get),
/// and ours (put back when a sent signal was handed to an action that uninstalled it).
static PREVIOUS: OnceLock<SigAction> = OnceLock::new();
static OURS: OnceLock<SigAction> = OnceLock::new();

/// The system's page size, read once at installation (the handler cannot call `sysconf`).
static PAGE: AtomicUsize = AtomicUsize::new(4096);

/// A registered range; dropping it unregisters (before the mapping goes).
#[derive(Debug)]
pub(crate) struct Guard {
    slot: Option<usize>,
}

/// Where a guarded object was found cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Damage {
    /// Offset of the first page that faulted (every byte from here to the end reads as zero now).
    pub from: u64,
}

impl Guard {
    /// Guards `[start, start + len)`. Never fails: without the handler or a free slot the mapping
    /// works as before, unguarded (logged).
    pub(crate) fn new(start: usize, len: usize) -> Self {
        if start == 0 || len == 0 || !install() {
            return Guard { slot: None };
        }
        for (i, slot) in TABLE.iter().enumerate() {
            if slot
                .start
                .compare_exchange(0, start, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                slot.write(len);
                return Guard { slot: Some(i) };
            }
        }
        tracing::warn!(
            slots = SLOTS,
            "every guard slot is taken: this shared-memory mapping is unguarded (a peer that \
             truncates its object would end this process with SIGBUS)"
        );
        Guard { slot: None }
    }

    /// Whether (and from where) the guarded object was cut under this mapping.
    pub(crate) fn damage(&self) -> Option<Damage> {
        let slot = &TABLE[self.slot?];
        match slot.damaged_from.load(Ordering::SeqCst) {
            0 => None,
            d => Some(Damage {
                from: (d - 1) as u64,
            }),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            let slot = &TABLE[i];
            slot.write(0);
            // Released last: nobody claims the slot while its fields change.
            slot.start.store(0, Ordering::SeqCst);
        }
    }
}

/// Installs the handler once; whether it is in place.
fn install() -> bool {
    static INSTALLED: OnceLock<bool> = OnceLock::new();
    *INSTALLED.get_or_init(|| match install_handler() {
        Ok(()) => true,
        Err(err) => {
            tracing::warn!(%err, "could not install the SIGBUS guard: shared-memory mappings are unguarded");
            false
        }
    })
}

fn install_handler() -> std::io::Result<()> {
    PAGE.store(rustix::param::page_size(), Ordering::SeqCst);
    let ours = SigAction::new(
        SigHandler::SigAction(on_sigbus),
        SaFlags::SA_SIGINFO | SaFlags::SA_ONSTACK,
        SigSet::empty(),
    );
    // Runs once (under `INSTALLED`): the cell is empty, so this set cannot fail.
    let _ = OURS.set(ours);
    // SAFETY: installs a handler that only touches atomics and makes async-signal-safe calls;
    // the previous action comes from the kernel, installed by this process's own code.
    let previous = unsafe { signal::sigaction(Signal::SIGBUS, &ours) }?;
    // Kept right after ours is in place: a fault that is not ours in between finds no previous
    // action and gets the default one — the end the process meets anyway (Rust's own handler
    // also ends it, with a message, for a fault it does not own).
    // Set once, like `OURS` above.
    let _ = PREVIOUS.set(previous);
    Ok(())
}

extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler; `si_addr` is the
    // faulting address of a kernel-raised SIGBUS (read only for those).
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code != BUS_ADRERR {
        pass_on_sent_or_foreign(signal, info, context, code);
        return;
    }
    let page_size = PAGE.load(Ordering::SeqCst);
    for slot in TABLE.iter() {
        let Some((start, len)) = slot.range() else {
            continue;
        };
        if addr < start || addr - start >= len {
            continue;
        }
        let page = (addr & !(page_size - 1)).max(start);
        let end = start + len;
        // SAFETY: `[page, end)` lies inside the guarded mapping (a stable registration, read
        // under its sequence word), which stays mapped while its guard is registered (the guard
        // is dropped before the unmap); replacing those pages with private zero pages is what
        // the handler exists for — their file pages were cut away.
        let mapped = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                end - page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            break;
        }
        let offset = page - start + 1;
        // Cannot fail: the update always returns `Some`.
        let _ = slot
            .damaged_from
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| {
                Some(if d == 0 { offset } else { d.min(offset) })
            });
        return;
    }
    pass_on(signal, info, context);
}

/// A `SIGBUS` the kernel did not raise for a cut file (sent by a process, or another kind of
/// fault): handed to the previous action, after which ours is put back — Rust's own handler, for
/// one, sets the default action before returning, which would leave every mapping unguarded. A
/// sent signal with the default action ends the process, as it would without cudalloc.
fn pass_on_sent_or_foreign(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
    code: libc::c_int,
) {
    if code > 0 {
        // A kernel fault of another kind (misaligned access, hardware error): as before.
        pass_on(signal, info, context);
        return;
    }
    let handler = PREVIOUS
        .get()
        .map_or(SigHandler::SigDfl, SigAction::handler);
    if matches!(handler, SigHandler::SigIgn) {
        return;
    }
    if matches!(handler, SigHandler::SigDfl) {
        pass_on(signal, info, context);
        // The signal is blocked until this handler returns and then ends the process with the
        // default action restored by `pass_on` (raise is async-signal-safe). A signal handler
        // has nowhere to report a failure (logging is not async-signal-safe).
        let _ = signal::raise(Signal::SIGBUS);
        return;
    }
    pass_on(signal, info, context);
    if let Some(ours) = OURS.get() {
        // Unreportable from a signal handler; it fails only for an invalid signal or action.
        // SAFETY: sigaction is async-signal-safe; `ours` is the action installed at first use.
        let _ = unsafe { signal::sigaction(Signal::SIGBUS, ours) };
    }
}

/// Hands a fault that is not ours to the action installed before ours.
fn pass_on(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    match PREVIOUS
        .get()
        .map_or(SigHandler::SigDfl, SigAction::handler)
    {
        SigHandler::SigDfl | SigHandler::SigIgn => {
            let default = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
            // Unreportable from a signal handler; it fails only for an invalid signal or action.
            // SAFETY: sigaction is async-signal-safe; the default action, restored, ends the
            // process when the faulting access is retried on return.
            let _ = unsafe { signal::sigaction(Signal::SIGBUS, &default) };
        }
        // The previous action's handler, with the arguments the kernel gave us.
        SigHandler::SigAction(f) => f(signal, info, context),
        SigHandler::Handler(f) => f(signal),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guarded_slot_is_freed_on_drop_and_reused() {
        let a = Guard::new(0x1000_0000, 4096);
        let i = a.slot.unwrap();
        assert_eq!(a.damage(), None);
        drop(a);
        // Freed: the slot no longer guards this range (another test's guard may take it at once).
        assert_ne!(TABLE[i].start.load(Ordering::SeqCst), 0x1000_0000);
        let b = Guard::new(0x2000_0000, 4096);
        assert!(b.slot.is_some());
    }
}
