//! Producer side of sharing expandable memory: the registry of shared page spans and the thread
//! that serves their chunks' descriptors over the page socket (`page_protocol.rs`).
//!
//! | shared storage (in an expandable segment) | registry entry            | served         |
//! |-------------------------------------------|---------------------------|----------------|
//! | first shared                              | added: key → pages, chunks | yes           |
//! | alive, or in limbo (consumers count on it)| kept                      | yes            |
//! | freed (its `SentData` dropped)            | removed *before* the block is freed | no (refused: not shared) |
//!
//! While an entry exists its block is allocated, so its pages stay mapped with the same chunks (the
//! release paths only unmap pages wholly inside free blocks): a chunk id read under the registry
//! lock is live, and exporting happens under that lock, batch by batch (the producer never holds
//! more than one batch of exported descriptors). A consumer that asks holds a count on the slot —
//! `pending` while it opens — so its storage cannot be freed during the exchange.
//!
//! The server is one thread per producer allocator, started with its first expandable share; it
//! answers one connection at a time, each bounded by the protocol's timeout, and only peers of our
//! own user (so teardown waits at most one timeout for a request in progress). It stops (and its socket is unlinked) when the allocator's IPC state drops; when
//! storages stay in limbo at teardown it keeps serving them until the process exits, as their
//! memory stays allocated until then. A forked child inherits neither thread nor socket: sharing
//! through its parent's runtime is refused (`IpcState::check_process`).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use super::page_protocol::{self, PageRequest, Refusal, ReplyHeader, BATCH, REQUEST_SIZE};
use super::wire::WirePages;
use super::SharedKey;
use crate::alloc::PagesUnder;
use crate::driver::{ChunkId, Driver};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::shm::socket::{self, ShmListener};
use crate::sync::os::{Arc, Mutex};

/// Shared page spans by storage key.
#[derive(Debug, Default)]
struct Registry {
    spans: Mutex<HashMap<SharedKey, PagesUnder>>,
}

/// A registered span; dropping it unregisters (before the storage's block is freed).
#[derive(Debug)]
pub(crate) struct SpanRegistration {
    registry: Arc<Registry>,
    key: SharedKey,
}

impl Drop for SpanRegistration {
    fn drop(&mut self) {
        self.registry.spans.lock().remove(&self.key);
    }
}

/// The page socket of one producer allocator and its serving thread.
#[derive(Debug)]
pub(crate) struct PageServer {
    registry: Arc<Registry>,
    birth: Birth,
    /// Dropping it wakes the thread, which then stops.
    stop: Option<OwnedFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PageServer {
    /// Binds the page socket `name` and starts serving.
    pub(crate) fn start(driver: Arc<dyn Driver>, name: &str) -> Result<Self> {
        let listener = ShmListener::bind(name)?;
        let (wake, stop) = socket::wake_pipe()?;
        let registry = Arc::new(Registry::default());
        let served = Arc::clone(&registry);
        let thread = std::thread::Builder::new()
            .name("cudalloc-pages".into())
            .spawn(move || serve(&listener, &wake, &served, driver.as_ref()))
            .map_err(|e| Error::host_os("spawning the page server", e))?;
        Ok(PageServer {
            registry,
            birth: Birth::now(),
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Serves `pages` for the storage `key` until the returned registration drops.
    pub(crate) fn register(&self, key: SharedKey, pages: PagesUnder) -> SpanRegistration {
        self.registry.spans.lock().insert(key.clone(), pages);
        SpanRegistration {
            registry: Arc::clone(&self.registry),
            key,
        }
    }

    /// Lets the thread serve until the process exits (storages stayed in limbo at teardown).
    pub(crate) fn serve_until_exit(mut self) {
        if let Some(stop) = self.stop.take() {
            std::mem::forget(stop);
        }
        self.thread = None;
    }
}

impl Drop for PageServer {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            // A forked child has no such thread, and the stop pipe is the parent's: forget both.
            std::mem::forget(self.stop.take());
            std::mem::forget(self.thread.take());
            return;
        }
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Waits for connections (or the stop pipe) and answers them one at a time.
fn serve(listener: &ShmListener, wake: &OwnedFd, registry: &Registry, driver: &dyn Driver) {
    let mut fds = [
        libc::pollfd {
            fd: listener.listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a valid array of two pollfd entries whose descriptors stay open (the
        // listener and the pipe live as long as this loop).
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(err = %std::io::Error::last_os_error(), "page server: poll failed; stopping");
            return;
        }
        if fds[1].revents != 0 {
            return; // the stop pipe closed
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            // A broken listener never becomes readable again: stop rather than spin.
            tracing::error!(
                socket = listener.name(),
                "page server: the socket failed; stopping"
            );
            return;
        }
        if fds[0].revents & libc::POLLIN == 0 {
            continue;
        }
        match listener.listener.accept() {
            Ok((stream, _)) => {
                if let Err(err) = answer(&stream, registry, driver) {
                    tracing::debug!(%err, socket = listener.name(), "page request not served");
                }
            }
            Err(err) => tracing::debug!(%err, "page server: accept failed"),
        }
    }
}

/// Answers one connection.
fn answer(stream: &UnixStream, registry: &Registry, driver: &dyn Driver) -> Result<()> {
    socket::set_timeouts(stream, page_protocol::TIMEOUT)?;
    if !socket::peer_is_our_user(stream)? {
        return Err(Error::invalid("a process of another user asked for pages"));
    }
    let mut raw = [0u8; REQUEST_SIZE];
    (&*stream)
        .read_exact(&mut raw)
        .map_err(|e| Error::host_os("reading a page request", e))?;
    let refuse = |refusal: Refusal, count: u64| {
        let header = ReplyHeader {
            refusal: Some(refusal),
            batch: 0,
            count,
            in_batch: 0,
        };
        let sent = (&*stream).write_all(&header.encode());
        sent.map_err(|e| Error::host_os("answering a page request", e))
    };
    let request = match PageRequest::parse(&raw) {
        Ok(r) => r,
        Err(err) => {
            refuse(Refusal::Malformed, 0)?;
            return Err(err);
        }
    };
    let key = (request.ref_file.clone(), request.slot, request.generation);
    let count = request.pages.count;
    let batches = count.div_ceil(BATCH as u64);
    for batch in 0..batches {
        let exported = match export_batch(registry, driver, &key, &request.pages, batch) {
            Ok(fds) => fds,
            Err(refusal) => return refuse(refusal, count),
        };
        let header = ReplyHeader {
            refusal: None,
            batch: u32::try_from(batch).map_err(|_| Error::invalid("too many batches"))?,
            count,
            in_batch: exported.len() as u64,
        };
        let borrowed: Vec<BorrowedFd<'_>> = exported.iter().map(AsFd::as_fd).collect();
        socket::send_fds(stream, &header.encode(), &borrowed)?;
    }
    Ok(())
}

/// Exports the chunks of batch `batch` of the span registered under `key` — under the registry
/// lock, so the span cannot be unregistered (and its chunks released) meanwhile.
fn export_batch(
    registry: &Registry,
    driver: &dyn Driver,
    key: &SharedKey,
    asked: &WirePages,
    batch: u64,
) -> std::result::Result<Vec<OwnedFd>, Refusal> {
    let spans = registry.spans.lock();
    let span = spans.get(key).ok_or(Refusal::NotShared)?;
    let same = span.page == asked.page
        && span.first == asked.first
        && span.chunks.len() as u64 == asked.count;
    if !same {
        return Err(Refusal::OtherPages);
    }
    let start = usize::try_from(batch).map_err(|_| Refusal::Malformed)? * BATCH;
    let chunks: &[ChunkId] = span
        .chunks
        .get(start..(start + BATCH).min(span.chunks.len()))
        .ok_or(Refusal::Malformed)?;
    chunks
        .iter()
        .map(|&chunk| {
            driver.vm_export_chunk(chunk).map_err(|err| {
                tracing::warn!(%err, "exporting a chunk for a consumer failed");
                Refusal::ExportFailed
            })
        })
        .collect()
}
