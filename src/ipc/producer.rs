//! Producer side: what a shared storage's `DataPtr` owns, and `share`.
//!
//! The first share of a storage replaces its owner with a [`SentOwner`] that keeps the original
//! owner (so the block stays allocated), one slot in a ref-counter file and — within the live-event
//! budget — one interprocess event. Every share records the event on the current stream (past the
//! budget: synchronizes the stream and sends no event) and adds one to the slot's `pending`.
//!
//! | producer storage | slot counts | what happens to the memory                    |
//! |------------------|-------------|-----------------------------------------------|
//! | alive            | any         | allocated                                     |
//! | dropped          | 0 / 0       | freed at once (event, slot, block)            |
//! | dropped          | not 0       | limbo: freed by a drain once consumers release |

use super::state::{IpcState, SentData};
use super::wire::WirePages;
use crate::alloc::{BlockOwner, DataPtr, PagesUnder, SharedOwner};
use crate::driver::StreamId;
use crate::driver::{EventFlags, IPC_HANDLE_SIZE};
use crate::error::Result;
use crate::sync::os::atomic::Ordering;
use crate::sync::os::Arc;

/// The owner of a shared storage's `DataPtr`.
#[derive(Debug)]
pub(crate) struct SentOwner {
    pub state: Arc<IpcState>,
    pub data: Option<SentData>,
}

impl SharedOwner for SentOwner {
    fn label(&self) -> &'static str {
        "ipc-sent"
    }

    fn block(&self) -> Option<&BlockOwner> {
        self.data.as_ref().and_then(|d| d.original.block_owner())
    }

    fn record_stream(&self, stream: StreamId) -> Result<()> {
        match &self.data {
            Some(d) => d.original.record_stream(stream),
            None => Ok(()),
        }
    }
}

impl Drop for SentOwner {
    fn drop(&mut self) {
        let Some(data) = self.data.take() else { return };
        if !self.state.in_its_process() {
            // A forked child's copy: the parent's slot, event, pages and block (see `process`).
            std::mem::forget(data);
            return;
        }
        self.state.retire(data);
    }
}

impl IpcState {
    /// Wraps `original` for sharing: a slot, the segment's memory handle — or, in an expandable
    /// segment, the pages under the storage, registered with the page server — and (within the
    /// budget) an interprocess event.
    pub(crate) fn wrap(
        self: &Arc<Self>,
        original: DataPtr,
        segment: (u64, u64),
        nbytes: u64,
        pages: Option<PagesUnder>,
    ) -> Result<SentOwner, Box<(crate::Error, DataPtr)>> {
        let (base, segment_size) = segment;
        let memory = match &pages {
            Some(_) => [0; IPC_HANDLE_SIZE],
            None => match self
                .driver
                .ipc()
                .ipc_export_memory(crate::driver::DeviceAddr(base))
            {
                Ok(h) => h.0,
                Err(err) => return Err(Box::new((err, original))),
            },
        };
        let slot = match self.take_slot() {
            Ok(s) => s,
            Err(err) => return Err(Box::new((err, original))),
        };
        let (wire_pages, served_pages, segment_start, segment_size) = match pages {
            None => (None, None, base, segment_size),
            Some(pages) => {
                // Whether the driver can hand these chunks to another process at all (the
                // simulated device cannot): asked once, before a slot and the page server serve
                // a handle nobody could open.
                let probe = pages
                    .chunks
                    .first()
                    .ok_or_else(|| crate::Error::invalid("a shared range with no pages"))
                    .and_then(|&chunk| self.driver.vm().vm_export_chunk(chunk));
                if let Err(err) = probe {
                    self.give_back_slot(&slot);
                    return Err(Box::new((err, original)));
                }
                let (page, first, count) = (pages.page, pages.first, pages.chunks.len() as u64);
                let key = (slot.file.name().to_owned(), slot.slot, slot.generation);
                match self.serve_pages(key, pages, Arc::clone(&slot.file)) {
                    Ok(registration) => (
                        Some(WirePages {
                            page,
                            first,
                            count,
                            secret: registration.secret(),
                        }),
                        Some(registration),
                        first,
                        count * page,
                    ),
                    Err(err) => {
                        self.give_back_slot(&slot);
                        return Err(Box::new((err, original)));
                    }
                }
            }
        };
        let event = if self.live_events.load(Ordering::Relaxed) < self.event_budget as u64 {
            match self
                .driver
                .event_create(original.device(), EventFlags { interprocess: true })
            {
                Ok(e) => {
                    self.live_events.fetch_add(1, Ordering::Relaxed);
                    Some(e)
                }
                Err(err) => {
                    self.give_back_slot(&slot);
                    return Err(Box::new((err, original)));
                }
            }
        } else {
            None
        };
        let offset = original.ptr().0 - segment_start;
        Ok(SentOwner {
            state: Arc::clone(self),
            data: Some(SentData {
                _served_pages: served_pages,
                original,
                slot,
                event,
                memory,
                segment_size,
                offset,
                nbytes,
                pages: wire_pages,
            }),
        })
    }
}
