//! Producer side of sharing expandable memory: the registry of shared page spans and who may fetch
//! them; the thread that serves their chunks' descriptors over the page socket is
//! `page_thread.rs` (`page_protocol.rs` the messages, `page_connections.rs` the connections).
//!
//! | shared storage (in an expandable segment) | registry entry            | served         |
//! |-------------------------------------------|---------------------------|----------------|
//! | first shared                              | added: key → pages, chunks, page secret, its slot | to requests with the secret while a count is held |
//! | alive, or in limbo (consumers count on it)| kept                      | the same       |
//! | freed (its `SentData` dropped)            | removed *before* the block is freed | no (refused: not shared) |
//!
//! While an entry exists its block is allocated, so its pages stay mapped with the same chunks (the
//! release paths only unmap pages wholly inside free blocks): a chunk id read under the registry
//! lock is live, and exporting happens under that lock, batch by batch (the producer never holds
//! more than one batch of exported descriptors per connection).
//!
//! **Who is served (the threat model).** Peers of another user are refused by the socket file's
//! mode (`0600`) and by `SO_PEERCRED`. Peers of our own user can ptrace us or read our memory
//! outright where the system allows it, so nothing here defends against a determined process of
//! our user; the point is that a *stray or confused* peer — one that lists `/dev/shm`, reads a
//! ref-counter file, replays an old handle — can neither read a storage it was not given nor pin
//! its memory. Everything such a peer can learn from files is public to it: the ref-counter files
//! (names, slots, generations, counts) are readable and writable by our user, and their OFD locks
//! are advisory — any process of our user can take the shared lock that marks a lease, and
//! `F_OFD_GETLK` cannot tell *whose* lock it sees (`l_pid` is −1 for OFD locks, and it never
//! reports the locks of the open file description it is asked through). So a lock or a count
//! proves nothing about the requester. What
//! authorizes is the **page secret**: 16 random bytes (`getrandom`) made when the storage is first
//! shared, kept only in this registry and in the storage's handles (`WirePages::secret`), which
//! travel only over the user's own channel to the processes it gives them to (and on from them,
//! when a consumer forwards a storage). A request must carry it (compared in constant time). On
//! top, the storage's slot must have a count (`pending` or `held` of the storage's generation —
//! counts are anonymous, so this is "somebody counts", not "the requester counts"): an
//! honest consumer asks while its handle's `pending` count is held, so a request for a storage
//! nobody counts on any more — every handle opened and released, or expired and reclaimed — comes
//! from a stale copy of a handle and is refused. What a served peer then reaches is the files of
//! the chunks it got: on the host backend those are arenas holding other chunks of this producer
//! too (`shm/vm.rs`), as a CUDA IPC handle reaches a whole allocation — the secret decides who
//! gets a descriptor at all, not which bytes of its file a holder can map.
//!
//! The server (`page_thread.rs`) is one thread per producer allocator, started with its first
//! expandable share, that serves every connection at once without blocking (`page_connections.rs`), so stopping it never
//! waits on a peer. It stops (and its socket is unlinked) when the allocator's IPC state drops;
//! when storages stay in limbo at teardown it keeps serving them until the process exits, as their
//! memory stays allocated until then. A forked child inherits neither thread nor socket: sharing
//! through its parent's runtime is refused (`IpcState::check_process`).

use std::collections::HashMap;

use super::limbo::SlotCounters;
use super::page_protocol::{PageRequest, Refusal};
use super::refcount::RefCounterFile;
use super::wire::PAGE_SECRET_SIZE;
use super::SharedKey;
use crate::alloc::PagesUnder;
use crate::driver::{ChunkId, Driver, ExportedChunk};
use crate::error::{Error, Result};
use crate::sync::os::{Arc, Mutex};

/// What the registry keeps of one shared span.
#[derive(Debug)]
struct Served {
    pages: PagesUnder,
    secret: [u8; PAGE_SECRET_SIZE],
    /// The storage's ref-counter file (its slot is the key's).
    file: Arc<RefCounterFile>,
    /// Its pages are asleep (`runtime/sleep.rs`): their chunks are released, nothing is served
    /// until the wake names the new ones.
    paused: bool,
}

/// Shared page spans by storage key.
#[derive(Debug, Default)]
pub(super) struct Registry {
    spans: Mutex<HashMap<SharedKey, Served>>,
}

/// Equality of two secrets in time independent of where they differ.
fn same_secret(a: &[u8; PAGE_SECRET_SIZE], b: &[u8; PAGE_SECRET_SIZE]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Registry {
    /// Serves `pages` for the storage `key` (whose slot is in `file`) until the returned
    /// registration drops; the registration carries the span's new page secret.
    pub(super) fn register(
        registry: &Arc<Registry>,
        key: SharedKey,
        pages: PagesUnder,
        file: Arc<RefCounterFile>,
    ) -> Result<SpanRegistration> {
        let secret = new_secret()?;
        let served = Served {
            pages,
            secret,
            file,
            paused: false,
        };
        registry.spans.lock().insert(key.clone(), served);
        Ok(SpanRegistration {
            registry: Arc::clone(registry),
            key,
            secret,
        })
    }

    /// Whether `request` may be served (checked when it arrives): the storage is shared, the
    /// request carries its secret, somebody counts on its slot, and it names the shared pages.
    pub(super) fn authorize(&self, request: &PageRequest) -> std::result::Result<(), Refusal> {
        let key = (request.ref_file.clone(), request.slot, request.generation);
        let spans = self.spans.lock();
        let served = spans.get(&key).ok_or(Refusal::NotShared)?;
        if !same_secret(&served.secret, &request.pages.secret) {
            return Err(Refusal::Unauthorized);
        }
        if served.paused {
            return Err(Refusal::NotShared);
        }
        let counted = served
            .file
            .slot(request.slot)
            .is_ok_and(|cell| cell.generation() == request.generation && cell.counts() != (0, 0));
        if !counted {
            return Err(Refusal::NoCount);
        }
        let asked = &request.pages;
        let same = served.pages.page == asked.page
            && served.pages.first == asked.first
            && served.pages.chunks.len() as u64 == asked.count;
        if !same {
            return Err(Refusal::OtherPages);
        }
        Ok(())
    }

    /// The first address of a shared span overlapping `[start, end)` that somebody still counts
    /// on (a consumer holds it, or a handle to it is unopened): memory that must stay mapped.
    pub(super) fn counted_span_in(&self, start: u64, end: u64) -> Option<u64> {
        let spans = self.spans.lock();
        spans.iter().find_map(|((_, slot, generation), served)| {
            let p = &served.pages;
            let span_end = p
                .first
                .saturating_add(p.page.saturating_mul(p.chunks.len() as u64));
            let overlaps = p.first < end && start < span_end;
            // Held only by dead consumers (no lock on the slot) counts as nobody.
            let counted = served.file.slot(*slot).is_ok_and(|cell| {
                cell.generation() == *generation
                    && match cell.counts() {
                        (0, 0) => false,
                        (0, _) => served.file.is_locked(*slot).unwrap_or(true),
                        _ => true,
                    }
            });
            (overlaps && counted).then_some(p.first)
        })
    }

    /// Replaces the chunks of every span `lookup` knows (`lookup(first, page, count)`: the chunks
    /// mapped there now) and serves it again — after a sleeping tag's pages were mapped again
    /// with new chunks, or a sleep was given up.
    pub(super) fn rechunk(&self, lookup: impl Fn(u64, u64, u64) -> Option<Vec<ChunkId>>) {
        let mut spans = self.spans.lock();
        for served in spans.values_mut() {
            let p = &mut served.pages;
            if let Some(chunks) = lookup(p.first, p.page, p.chunks.len() as u64) {
                p.chunks = chunks;
                served.paused = false;
            }
        }
    }

    /// Serves nothing of the spans that `inside(first, end)` picks until they are rechunked:
    /// their pages are about to be released (a sleep).
    pub(super) fn pause(&self, inside: impl Fn(u64, u64) -> bool) {
        let mut spans = self.spans.lock();
        for served in spans.values_mut() {
            let p = &served.pages;
            let end = p
                .first
                .saturating_add(p.page.saturating_mul(p.chunks.len() as u64));
            if inside(p.first, end) {
                served.paused = true;
            }
        }
    }

    /// Exports the chunks of pages `start .. start + n` of the span `request` names — under the
    /// registry lock, so the span cannot be unregistered (and its chunks released) meanwhile.
    pub(super) fn export(
        &self,
        driver: &dyn Driver,
        request: &PageRequest,
        start: u64,
        n: u64,
    ) -> std::result::Result<Vec<ExportedChunk>, Refusal> {
        let key = (request.ref_file.clone(), request.slot, request.generation);
        let spans = self.spans.lock();
        let served = spans.get(&key).ok_or(Refusal::NotShared)?;
        if served.paused
            || !same_secret(&served.secret, &request.pages.secret)
            || served.pages.chunks.len() as u64 != request.pages.count
        {
            return Err(Refusal::OtherPages);
        }
        let from = usize::try_from(start).map_err(|_| Refusal::Malformed)?;
        let to = usize::try_from(start.saturating_add(n)).map_err(|_| Refusal::Malformed)?;
        let chunks: &[ChunkId] = served
            .pages
            .chunks
            .get(from..to)
            .ok_or(Refusal::Malformed)?;
        chunks
            .iter()
            .map(|&chunk| {
                driver.vm().vm_export_chunk(chunk).map_err(|err| {
                    tracing::warn!(%err, "exporting a chunk for a consumer failed");
                    Refusal::ExportFailed
                })
            })
            .collect()
    }
}

/// A registered span; dropping it unregisters (before the storage's block is freed).
#[derive(Debug)]
pub(crate) struct SpanRegistration {
    registry: Arc<Registry>,
    key: SharedKey,
    secret: [u8; PAGE_SECRET_SIZE],
}

impl SpanRegistration {
    /// The span's page secret (for the storage's handles).
    pub(crate) fn secret(&self) -> [u8; PAGE_SECRET_SIZE] {
        self.secret
    }
}

impl Drop for SpanRegistration {
    fn drop(&mut self) {
        self.registry.spans.lock().remove(&self.key);
    }
}

/// A fresh page secret from the kernel's random source (never all zero: zero means "none").
fn new_secret() -> Result<[u8; PAGE_SECRET_SIZE]> {
    let mut secret = [0u8; PAGE_SECRET_SIZE];
    while secret == [0; PAGE_SECRET_SIZE] {
        fill_random(&mut secret)?;
    }
    Ok(secret)
}

fn fill_random(buf: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is valid for writes of its length; getrandom writes at most that many.
        let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if got < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::host_os("getrandom", err));
        }
        filled += got as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn secrets_are_random_and_compared_whole() {
        let a = new_secret().unwrap();
        let b = new_secret().unwrap();
        assert_ne!(a, b);
        assert_ne!(a, [0; PAGE_SECRET_SIZE]);
        assert!(same_secret(&a, &a));
        let mut c = a;
        c[PAGE_SECRET_SIZE - 1] ^= 1;
        assert!(!same_secret(&a, &c));
    }
}
