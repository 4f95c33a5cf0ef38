//! The out-of-memory path's pieces: free-memory callbacks and the error message.
//!
//! The message says what PyTorch's says — the *requested* size, the device, its capacity and free
//! memory, what we have allocated and what we reserve without using — and then why *this*
//! request failed (`engine/explain.rs` computes the figures): the largest free block of the
//! asking stream's pool against the rounded request, what other streams cache and whether one of
//! their blocks would have served it, what private pools and graphs hold, the address space
//! expandable segments reserve unmapped. Advice only where it applies:
//!
//! | advice | given when |
//! |---|---|
//! | `expandable_segments:True` | the pool's free bytes would fit the request but no block does (fragmentation), and expandable segments are off |
//! | `max_split_size_mb` | the same fragmentation, and no `max_split_size_mb` is set |
//! | `cross_stream_reuse:blocks` | another stream caches a free block that would have served the request, and the policy is not `blocks` |
//! | empty or drop memory pools | pools (or the graphs holding them) reserve memory |
//!
//! A memory-fraction cap in force is named; no advice is given that the configuration already
//! follows (PyTorch suggests `expandable_segments` when it is on).

use super::observers::OutOfMemoryEvent;
use crate::config::{AllocatorConfig, CrossStreamReuse};
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
    pub(super) fn register(&self, callback: FreeMemoryCallback) {
        self.list.write().push(callback);
    }

    /// Runs every callback; true if any freed something. A panicking callback is caught and
    /// logged, and counts as having freed nothing.
    pub(super) fn run(&self) -> bool {
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

/// Builds the out-of-memory error from the facts, with advice that applies under `config`.
pub(crate) fn out_of_memory(f: &OutOfMemoryEvent, config: &AllocatorConfig) -> Error {
    Error::OutOfMemory {
        device: f.device,
        requested: f.requested,
        message: message(f, config),
    }
}

fn message(f: &OutOfMemoryEvent, config: &AllocatorConfig) -> String {
    let unallocated = f.reserved.saturating_sub(f.allocated);
    let mut m = format!("tried to allocate {}", format_size(f.requested));
    if f.rounded > f.requested {
        m.push_str(&format!(" ({} as served)", format_size(f.rounded)));
    }
    if let Some(stream) = f.stream {
        // The stream's number among its driver's (the raw id also carries the driver's number).
        m.push_str(&format!(" on stream {}", stream.serial()));
    }
    m.push_str(&format!(
        ". Device {} has a total capacity of {} of which {} is free. \
         Of the allocated memory {} is allocated by cudalloc, and {} is reserved by cudalloc but unallocated.",
        f.device,
        format_size(f.capacity),
        format_size(f.free),
        format_size(f.allocated),
        format_size(unallocated),
    ));
    if let Some((fraction, allowed)) = f.fraction {
        m.push_str(&format!(
            " This process may use {fraction} of the device ({}).",
            format_size(allowed)
        ));
    }
    let served = f.rounded.max(f.requested);
    m.push_str(&format!(
        " The largest free block this stream's pool has is {} ({} free there",
        format_size(f.largest_free_block),
        format_size(f.free_in_pool),
    ));
    if f.free_in_pool > 0 {
        m.push_str(&format!(", fragmentation {:.0}%", f.fragmentation * 100.0));
    }
    m.push_str(").");
    let fragmented = f.free_in_pool >= served && f.largest_free_block < served;
    if fragmented {
        m.push_str(" Its free memory would hold the request, but in no single block.");
        if !config.expandable_segments {
            m.push_str(
                " Setting expandable_segments:True in CUDALLOC_CONF lets segments grow instead \
                 of fragmenting.",
            );
        }
        if config.max_split_size == u64::MAX {
            m.push_str(
                " Setting max_split_size_mb in CUDALLOC_CONF keeps large blocks from being split.",
            );
        }
    }
    if f.cached_on_other_streams > 0 {
        m.push_str(&format!(
            " Other streams cache {} free",
            format_size(f.cached_on_other_streams)
        ));
        if f.largest_fit_on_other_streams > 0 {
            m.push_str(&format!(
                "; one of their blocks ({}) would have served this request",
                format_size(f.largest_fit_on_other_streams)
            ));
            if config.cross_stream_reuse != CrossStreamReuse::Blocks {
                m.push_str(" (cross_stream_reuse:blocks in CUDALLOC_CONF lends it)");
            }
        }
        m.push('.');
    }
    if f.held_by_pools > 0 {
        m.push_str(&format!(
            " Memory pools reserve {}",
            format_size(f.held_by_pools)
        ));
        if f.held_by_graphs > 0 {
            m.push_str(&format!(
                " ({} of it in pools graphs hold)",
                format_size(f.held_by_graphs)
            ));
        }
        m.push_str("; emptying or dropping them gives it back.");
    }
    if f.reserved_unmapped > 0 {
        m.push_str(&format!(
            " Expandable segments also reserve {} of address space without memory behind it.",
            format_size(f.reserved_unmapped)
        ));
    }
    if let Some(cause) = &f.cause {
        m.push_str(&format!(" The driver said: {cause}"));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> OutOfMemoryEvent {
        OutOfMemoryEvent {
            device: 1,
            requested: 3 << 30,
            rounded: 3 << 30,
            capacity: 8 << 30,
            free: 1 << 30,
            allocated: 4 << 30,
            reserved: 6 << 30,
            ..Default::default()
        }
    }

    #[test]
    fn message_names_the_requested_size_and_the_totals() {
        let text = out_of_memory(&facts(), &AllocatorConfig::default()).to_string();
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
        // Nothing free on the stream, nothing elsewhere: no advice applies.
        assert!(!text.contains("max_split_size_mb"), "{text}");
        assert!(!text.contains("expandable"), "{text}");
        assert!(!text.contains("cross_stream_reuse"), "{text}");
        assert_eq!(format_size(512), "512 bytes");
        assert_eq!(format_size(20 << 20), "20.00 MiB");
    }

    #[test]
    fn advice_only_where_it_applies() {
        let mut f = facts();
        f.free_in_pool = 4 << 30;
        f.largest_free_block = 1 << 30;
        f.fragmentation = 0.75;
        let plain = out_of_memory(&f, &AllocatorConfig::default()).to_string();
        assert!(plain.contains("in no single block"), "{plain}");
        assert!(plain.contains("expandable_segments:True"), "{plain}");
        assert!(plain.contains("max_split_size_mb"), "{plain}");
        assert!(plain.contains("fragmentation 75%"), "{plain}");
        let tuned =
            AllocatorConfig::parse("expandable_segments:True,max_split_size_mb:64").unwrap();
        let text = out_of_memory(&f, &tuned).to_string();
        assert!(text.contains("in no single block"), "{text}");
        assert!(!text.contains("expandable_segments:True"), "{text}");
        assert!(!text.contains("max_split_size_mb"), "{text}");

        let mut f = facts();
        f.cached_on_other_streams = 5 << 30;
        f.largest_fit_on_other_streams = 4 << 30;
        let text = out_of_memory(&f, &AllocatorConfig::default()).to_string();
        assert!(text.contains("Other streams cache 5.00 GiB free"), "{text}");
        assert!(text.contains("cross_stream_reuse:blocks"), "{text}");
        let blocks = AllocatorConfig::parse("cross_stream_reuse:blocks").unwrap();
        let text = out_of_memory(&f, &blocks).to_string();
        assert!(!text.contains("cross_stream_reuse:blocks"), "{text}");

        let mut f = facts();
        f.held_by_pools = 2 << 30;
        f.held_by_graphs = 1 << 30;
        f.reserved_unmapped = 16 << 30;
        let text = out_of_memory(&f, &AllocatorConfig::default()).to_string();
        assert!(
            text.contains("Memory pools reserve 2.00 GiB (1.00 GiB of it in pools graphs hold)"),
            "{text}"
        );
        assert!(text.contains("16.00 GiB of address space"), "{text}");
    }
}
