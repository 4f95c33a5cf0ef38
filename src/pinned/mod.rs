//! The caching allocator of page-locked ("pinned") host memory: PyTorch's
//! `CachingHostAllocator`, for the copies a tensor library makes between host and device.
//!
//! Allocating page-locked memory costs about a millisecond a call (`cuMemHostAlloc` takes the
//! driver's global lock and locks every page), so blocks are cached and reused — but only after
//! every stream that used a block finished with it.
//!
//! # Policy (PyTorch's)
//!
//! * A request is rounded up to a power of two; each power of two is a size class with its own
//!   free list (the last freed block is reused first). Blocks are never split or merged.
//! * Before looking in the cache, the allocator polls the events of freed blocks, oldest first,
//!   until one has not completed (`process_events`); it never blocks the allocating thread.
//! * A miss asks the driver (`memory.rs`): page-locked allocation, or — with
//!   `pinned_use_cuda_host_register:True` — ordinary pages faulted in by
//!   `pinned_num_register_threads` threads and then registered; or carves the block from the
//!   reserve segment (`pinned_reserve_segment_size_mb`).
//! * Out of memory: events are polled, the cache is emptied and the driver asked once more;
//!   then an [`Error::HostOutOfMemory`](crate::Error::HostOutOfMemory) that says what the
//!   allocator holds.
//! * `empty_cache` gives every cached block back to the driver; statistics carry PyTorch's
//!   `host_memory_stats` keys (`stats.rs`).
//!
//! # A block's life
//!
//! | state | held by | next |
//! |---|---|---|
//! | in use | a [`PinnedBuffer`] | dropped: cached when no stream used it, else waiting |
//! | waiting (n events) | the allocator's event queue | each completed event polled: n − 1; at 0, cached |
//! | cached | its class's free list | handed out again, or released by `empty_cache` |
//!
//! A buffer records an event after every copy through it (`buffer.rs`), so its reuse waits for
//! exactly those copies, where PyTorch records one event per stream at the free (waiting for
//! everything queued there meanwhile); [`PinnedBuffer::record_stream`] does the latter for work
//! cudalloc did not enqueue. Host borrows wait for the copies too, so natural code —
//! fill the buffer, copy it to the device, fill it again — is correct without a synchronize.
//!
//! # Where it meets the rest
//!
//! * The stream sanitizer sees host borrows and hand-outs (`driver/sanitizer/host.rs`): a
//!   pinned block reused while a copy still reads it is a use after free.
//! * A pinned buffer is process-local: it cannot be shared with another process (there is no
//!   handle for it, and the drivers refuse to export host memory).
//! * A forked child cannot allocate or free (its pages are copies and not locked); its buffers
//!   leak there.
//! * Copies on a capturing stream are refused (`buffer.rs`).
//!
//! Files, lowest first: `stats.rs` ([`PinnedStats`]), `state.rs` (the books and their
//! invariants), `memory.rs` (where memory comes from), `pinned_allocator.rs` (the [`PinnedAllocator`]
//! type, frees and event polling), `buffer.rs` ([`PinnedBuffer`]), `allocate.rs` (handing buffers
//! out, `empty_cache`, statistics).

mod allocate;
mod buffer;
mod memory;
mod pinned_allocator;
mod state;
mod stats;

pub use buffer::PinnedBuffer;
pub use pinned_allocator::{PinnedAllocator, PinnedOptions};
pub use stats::{DurationStat, PinnedStats};
