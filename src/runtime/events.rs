//! [`Event`]: a point in a stream's work, recorded through the runtime (PyTorch's
//! `torch.cuda.Event`), destroyed when dropped.
//!
//! | call | what it does | returns |
//! |---|---|---|
//! | [`Runtime::record_event`]`(stream)` | an event after the work queued on `stream` so far | at once |
//! | [`Event::wait_on`]`(stream)` | later work on `stream` waits for the event | at once |
//! | [`Event::is_complete`] | whether that work has run (a failed stream's error is an error) | at once |
//! | [`Event::synchronize`] | blocks until it has | when done |
//!
//! The runtime's own waits between streams are one call ([`Runtime::wait_stream`]); storages order
//! their accesses themselves (`storage/order.rs`). An event is for what neither covers: a point
//! kept to wait for later, or polled from the host. Through the runtime's driver, so the stream
//! sanitizer sees its record and its waits.

use std::fmt;

use super::Runtime;
use crate::driver::{Driver, EventFlags, EventId, StreamId};
use crate::error::Result;
use crate::sync::os::Arc;

/// A recorded point in a stream's work ([`Runtime::record_event`]); destroyed on drop (work
/// already waiting for it still does, as CUDA's `cudaEventDestroy`).
pub struct Event {
    driver: Arc<dyn Driver>,
    id: EventId,
    stream: StreamId,
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("id", &self.id)
            .field("recorded_on", &self.stream)
            .finish()
    }
}

impl Runtime {
    /// An event after the work queued on `stream` so far.
    pub fn record_event(&self, stream: StreamId) -> Result<Event> {
        let driver = Arc::clone(self.allocator().driver());
        let device = driver.stream_device(stream)?;
        let id = driver.event_create(device, EventFlags::default())?;
        if let Err(err) = driver.event_record(id, stream) {
            if let Err(destroyed) = driver.event_destroy(id) {
                tracing::warn!(%destroyed, "destroying an event whose record failed failed");
            }
            return Err(err);
        }
        Ok(Event { driver, id, stream })
    }
}

impl Event {
    /// Work queued on `stream` after this call waits for the event.
    pub fn wait_on(&self, stream: StreamId) -> Result<()> {
        self.driver.stream_wait_event(stream, self.id)
    }

    /// Whether the work before the event has run.
    pub fn is_complete(&self) -> Result<bool> {
        self.driver.event_query(self.id)
    }

    /// Blocks until the work before the event has run.
    pub fn synchronize(&self) -> Result<()> {
        self.driver.event_synchronize(self.id)
    }

    /// The stream it was recorded on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Err(err) = self.driver.event_destroy(self.id) {
            tracing::debug!(%err, "destroying an event failed");
        }
    }
}
