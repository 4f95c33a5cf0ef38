//! The out-of-memory path's pieces: free-memory callbacks and the error message.
//!
//! The message says what PyTorch's says — the *requested* size, the device, its capacity and free
//! memory, what we have allocated and what we reserve without using — without its warts: it names
//! the size that was asked for (not a rounded internal one), mentions a memory-fraction cap when
//! one is in force, and suggests `max_split_size_mb` (our fragmentation lever) only when reserved
//! but unallocated memory is at least a quarter of what we reserve; it never suggests `expandable_segments`, which segments
//! that must stay IPC-exportable cannot use.

use super::observers::OutOfMemoryEvent;
use crate::error::{caught, Error};
use crate::sync::os::{Arc, RwLock};

/// A free-memory callback: frees what it can and says whether it freed anything.
pub type FreeMemoryCallback = Arc<dyn Fn() -> bool + Send + Sync>;

/// The registered callbacks, run on a cache miss before asking the driver for memory.
#[derive(Default)]
pub(crate) struct Callbacks {
    list: RwLock<Vec<FreeMemoryCallback>>,
    /// Segment and out-of-memory observers (`observers.rs`).
    pub observers: super::observers::Observers,
    /// Every mapped region and the registrars attached (`registration.rs`).
    pub registry: super::registration::Registry,
}

impl std::fmt::Debug for Callbacks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Callbacks({})", self.list.read().len())
    }
}

impl Callbacks {
    pub fn register(&self, callback: FreeMemoryCallback) {
        self.list.write().push(callback);
    }

    /// Runs every callback; true if any freed something. A panicking callback is caught and
    /// logged, and counts as having freed nothing.
    pub fn run(&self) -> bool {
        let list: Vec<_> = self.list.read().clone();
        list.iter().fold(false, |freed, cb| {
            let this = caught(|| cb()).unwrap_or_else(|panic| {
                tracing::warn!(%panic, "a free-memory callback panicked");
                false
            });
            this | freed
        })
    }
}

/// Human-readable bytes, PyTorch style (`20.00 MiB`).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// Builds the out-of-memory error.
pub(crate) fn out_of_memory(f: &OutOfMemoryEvent) -> Error {
    let unallocated = f.reserved.saturating_sub(f.allocated);
    let mut message = format!(
        "tried to allocate {}. Device {} has a total capacity of {} of which {} is free. \
         Of the allocated memory {} is allocated by cudalloc, and {} is reserved by cudalloc but unallocated.",
        format_size(f.requested),
        f.device,
        format_size(f.capacity),
        format_size(f.free),
        format_size(f.allocated),
        format_size(unallocated),
    );
    if let Some((fraction, allowed)) = f.fraction {
        message.push_str(&format!(
            " This process may use {fraction} of the device ({}).",
            format_size(allowed)
        ));
    }
    if unallocated > 0 && unallocated >= f.reserved / 4 {
        message.push_str(
            " If reserved but unallocated memory is large, try setting max_split_size_mb in \
             CUDALLOC_CONF to reduce fragmentation.",
        );
    }
    if let Some(cause) = &f.cause {
        message.push_str(&format!(" The driver said: {cause}"));
    }
    Error::OutOfMemory {
        device: f.device,
        requested: f.requested,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_the_requested_size_and_never_expandable_segments() {
        let e = out_of_memory(&OutOfMemoryEvent {
            device: 1,
            requested: 3 << 30,
            capacity: 8 << 30,
            free: 1 << 30,
            allocated: 4 << 30,
            reserved: 6 << 30,
            fraction: None,
            cause: None,
        });
        let text = e.to_string();
        assert!(text.contains("tried to allocate 3.00 GiB"), "{text}");
        assert!(
            text.contains("Device 1 has a total capacity of 8.00 GiB of which 1.00 GiB is free"),
            "{text}"
        );
        assert!(text.contains("4.00 GiB is allocated by cudalloc"), "{text}");
        assert!(
            text.contains("2.00 GiB is reserved by cudalloc but unallocated"),
            "{text}"
        );
        assert!(text.contains("max_split_size_mb"));
        assert!(!text.contains("expandable"));
        assert_eq!(format_size(512), "512 bytes");
        assert_eq!(format_size(20 << 20), "20.00 MiB");
    }
}
