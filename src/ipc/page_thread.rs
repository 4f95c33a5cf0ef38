//! The page socket's thread of one producer allocator: started with its first expandable share,
//! it serves the registry (`page_server.rs`) over every connection at once
//! (`page_connections.rs`), and stops within one pass of its poll loop when dropped.

use std::os::fd::OwnedFd;

use super::page_server::{Registry, SpanRegistration};
use super::refcount::RefCounterFile;
use super::SharedKey;
use crate::alloc::PagesUnder;
use crate::driver::ChunkId;
use crate::driver::Driver;
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::shm::socket::{self, ShmListener};
use crate::sync::os::Arc;

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
        listener
            .listener
            .set_nonblocking(true)
            .map_err(|e| Error::host_os("fcntl(O_NONBLOCK)", e))?;
        let (wake, stop) = socket::wake_pipe()?;
        let registry = Arc::new(Registry::default());
        let served = Arc::clone(&registry);
        let thread = std::thread::Builder::new()
            .name("cudalloc-pages".into())
            .spawn(move || {
                super::page_connections::serve(&listener, &wake, &served, driver.as_ref())
            })
            .map_err(|e| Error::host_os("spawning the page server", e))?;
        Ok(PageServer {
            registry,
            birth: Birth::now(),
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Serves `pages` for the storage `key` (whose slot is in `file`) until the returned
    /// registration drops; the registration carries the span's new page secret.
    pub(crate) fn register(
        &self,
        key: SharedKey,
        pages: PagesUnder,
        file: Arc<RefCounterFile>,
    ) -> Result<SpanRegistration> {
        Registry::register(&self.registry, key, pages, file)
    }

    /// The first address of a counted shared span overlapping `[start, end)`.
    pub(crate) fn counted_span_in(&self, start: u64, end: u64) -> Option<u64> {
        self.registry.counted_span_in(start, end)
    }

    /// Replaces the chunks of the spans `lookup` knows (see `Registry::rechunk`).
    pub(crate) fn rechunk(&self, lookup: impl Fn(u64, u64, u64) -> Option<Vec<ChunkId>>) {
        self.registry.rechunk(lookup);
    }

    /// Serves nothing of the spans `inside` picks until rechunked (see `Registry::pause`).
    pub(crate) fn pause(&self, inside: impl Fn(u64, u64) -> bool) {
        self.registry.pause(inside);
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
        // The thread blocks on nothing but its poll, which the closed pipe ends: the join is
        // bounded by one pass of its loop, whatever the peers do.
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            // A panic of the thread was already reported by the panic hook.
            let _ = thread.join();
        }
    }
}
