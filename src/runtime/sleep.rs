//! Sleep and wake by tag ([`Runtime::sleep`], [`Runtime::wake_up`]): vLLM's sleep mode and
//! SGLang's memory saver, on the allocator's tags (`alloc/tags.rs`) and the pinned host allocator.
//!
//! `sleep(offload, discard)`:
//!
//! 1. each tag starts falling asleep (`begin_sleep`): allocations of it are refused, its cached
//!    free pages are given back, every stream that used its memory is waited for;
//! 2. under each of its shards' locks, every allocated block is checked — memory shared with
//!    other processes that somebody still counts on is refused (below) — and, for an offloaded
//!    tag, its copy into a pinned host buffer is enqueued on the block's stream (a free racing
//!    the sleep waits for the lock, and is ordered after the copy by that stream);
//! 3. the copies' streams are waited for;
//! 4. every mapped page of the tags is deregistered, unmapped and released (`finish_sleeps`);
//!    the reservations stay, so every address handed out stays valid for later.
//!
//! A failure before step 4 — an error, or a panic unwinding through it (a driver in the stream
//! sanitizer's panic mode) — leaves every tag awake, as it was. `wake_up(tags)` maps fresh pages at
//! the same addresses and registers them (on failure — out of memory — the tag stays asleep and
//! its offloaded bytes stay kept for a retry), copies the offloaded bytes back into the blocks
//! still allocated, zeroes discarded ones when [`WakeOptions::zero_discarded`] asks, waits for
//! those copies, and only then serves allocations of the tag again.
//!
//! | memory of a sleeping tag | what happens |
//! |---|---|
//! | a new allocation in it | refused: [`Error::Asleep`] |
//! | work on it (a copy, a kernel, a COW materialization, sharing it) | refused with [`Error::Asleep`] under the stream sanitizer (and reported); without it, the host backend refuses the unmapped address (a typed error, never a signal); on a GPU it faults, as vLLM's does |
//! | a free of a block in it | as ever; the wake does not restore it |
//! | a graph captured over it | replays after the wake: the addresses are the same |
//! | storages shared with other processes | a sleep is refused while a consumer holds one or a handle to one is unopened (it would unmap memory the consumer maps); `ipc_collect` reclaims what dead consumers held |
//!
//! Why refuse shared memory rather than let consumers see it vanish: a consumer maps the
//! producer's chunks; releasing them would not give the memory back (the consumer's mapping
//! keeps it) and would leave the consumer reading bytes the producer no longer keeps.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use super::Runtime;
use crate::alloc::{SleepStart, TagRange};
use crate::driver::{ChunkId, DeviceAddr, StreamId};
use crate::error::{Error, Result};
use crate::pinned::PinnedBuffer;

/// What [`Runtime::sleep`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SleepReport {
    /// Bytes of allocated blocks copied to pinned host memory.
    pub offloaded_bytes: u64,
    /// Bytes of allocated blocks whose contents were dropped.
    pub discarded_bytes: u64,
    /// Device memory given back to the driver (cached free pages included).
    pub released_bytes: u64,
}

/// What [`Runtime::wake_up`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WakeReport {
    /// Device memory mapped again.
    pub mapped_bytes: u64,
    /// Offloaded bytes copied back.
    pub restored_bytes: u64,
    /// Bytes of discarded blocks set to zero ([`WakeOptions::zero_discarded`]).
    pub zeroed_bytes: u64,
}

/// How [`Runtime::wake_up`] wakes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WakeOptions {
    /// Set the blocks of discarded tags to zero (default: their bytes are undefined, as on a
    /// fresh allocation).
    pub zero_discarded: bool,
}

impl WakeOptions {
    /// Zeroes discarded blocks at wake.
    pub fn zero_discarded(mut self, on: bool) -> Self {
        self.zero_discarded = on;
        self
    }
}

/// A sleeping tag's kept bytes: one pinned buffer per block offloaded (none when discarded).
#[derive(Debug, Default)]
pub(super) struct Kept {
    offloaded: bool,
    buffers: Vec<(TagRange, PinnedBuffer)>,
}

/// The sleeping tags' kept bytes, by tag.
pub(super) type Sleepers = HashMap<String, Kept>;

/// A tag falling asleep: its start, whether it is offloaded, its buffers so far.
type Started = (SleepStart, bool, Vec<(TagRange, PinnedBuffer)>);

impl Runtime {
    /// Puts tags to sleep: `offload` tags keep their bytes in pinned host memory, `discard`
    /// tags drop them; the physical memory of both is given back while every address stays
    /// reserved (see `src/runtime/sleep.rs`). Tags are made with
    /// [`Runtime::tag`](crate::Runtime::tag). All or nothing: on an error no
    /// tag sleeps.
    ///
    /// Offloaded bytes go to one pinned buffer per allocated block, from the runtime's pinned
    /// host allocator (sizes rounded up to powers of two, as every pinned buffer is); after the
    /// wake those buffers return to its cache, ready for the next sleep —
    /// `pinned_allocator().empty_cache()` gives them back. They live in this runtime: dropping it
    /// while tags sleep drops them, and the tags' memory then goes back with the allocator.
    /// Tags already asleep (or on their way) are refused with [`Error::Asleep`]; so is memory
    /// other processes still count on. Refused in a forked child.
    pub fn sleep(&self, offload: &[&str], discard: &[&str]) -> Result<SleepReport> {
        self.allocator.check_process("this runtime")?;
        let mut seen = HashSet::new();
        for name in offload.iter().chain(discard) {
            self.is_asleep(name)?;
            if !seen.insert(*name) {
                return Err(Error::invalid(format!(
                    "tag {name:?} is named twice (offload {offload:?}, discard {discard:?})"
                )));
            }
        }
        let plan: Vec<(&str, bool)> = offload
            .iter()
            .map(|n| (*n, true))
            .chain(discard.iter().map(|n| (*n, false)))
            .collect();
        // The tags on their way to sleep live out here: should a panic unwind through the
        // steps before the unmaps (a driver in the stream sanitizer's panic mode), every one is
        // awake again, as on an error.
        let mut started: Vec<Started> = Vec::new();
        let outcome = catch_unwind(AssertUnwindSafe(|| self.sleep_tags(&plan, &mut started)));
        outcome.unwrap_or_else(|panic| {
            self.abandon(std::mem::take(&mut started));
            resume_unwind(panic)
        })
    }

    /// [`Runtime::sleep`]'s steps; `started` is emptied once the tags are handed to the unmaps.
    fn sleep_tags(&self, plan: &[(&str, bool)], started: &mut Vec<Started>) -> Result<SleepReport> {
        let mut streams: Vec<StreamId> = Vec::new();
        for &(name, keep) in plan {
            let mut buffers = Vec::new();
            let begun = self.allocator.begin_sleep(name, |range| {
                self.refuse_shared(name, range)?;
                if keep {
                    buffers.push((*range, self.offload(range)?));
                    streams.push(range.stream);
                }
                Ok(())
            });
            match begun {
                Ok(start) => started.push((start, keep, buffers)),
                Err(err) => return Err(self.cancel_all(std::mem::take(started), err)),
            }
        }
        streams.sort_unstable_by_key(|s| s.raw());
        streams.dedup();
        let driver = self.allocator().driver();
        if let Err(err) = streams
            .iter()
            .try_for_each(|&s| driver.stream_synchronize(s))
        {
            return Err(self.cancel_all(std::mem::take(started), err));
        }
        // The kept bytes are in place before any tag can be woken (a wake needs the tag asleep,
        // which `finish_sleeps` makes it); the tags' shared spans are served nothing while
        // their pages are released (a stale handle is refused, never given a released chunk).
        {
            let mut sleepers = self.sleepers.lock();
            for (start, keep, buffers) in started.iter_mut() {
                let kept = Kept {
                    offloaded: *keep,
                    buffers: std::mem::take(buffers),
                };
                sleepers.insert(start.tag.clone(), kept);
            }
        }
        let ranges: Vec<&TagRange> = started.iter().flat_map(|(s, ..)| &s.ranges).collect();
        self.ipc().pause_served(|first, end| {
            ranges
                .iter()
                .any(|r| r.addr < end && first < r.addr.saturating_add(r.len))
        });
        // From here the unmaps own the tags: a panic in them is not undone here.
        let started = std::mem::take(started);
        let finished = {
            let starts: Vec<&SleepStart> = started.iter().map(|(start, ..)| start).collect();
            self.allocator.finish_sleeps(&starts)
        };
        let released = match finished {
            Ok(released) => released,
            Err(err) => {
                self.abandon(started);
                return Err(err);
            }
        };
        let mut report = SleepReport::default();
        for ((start, keep, _), released) in started.iter().zip(released) {
            let bytes: u64 = start.ranges.iter().map(|r| r.len).sum();
            report.released_bytes += released;
            if *keep {
                report.offloaded_bytes += bytes;
            } else {
                report.discarded_bytes += bytes;
            }
        }
        Ok(report)
    }

    /// Wakes `tags` (every sleeping tag when empty): their memory mapped back at the same
    /// addresses, offloaded bytes restored, discarded bytes undefined unless `options` zero them
    /// (`WakeOptions::default()`: as vLLM's `wake_up`). Tag by tag: on an error (out of memory)
    /// the tags before it are awake, it and the rest still asleep with their bytes kept.
    /// Refused in a forked child.
    pub fn wake_up(&self, tags: &[&str], options: WakeOptions) -> Result<WakeReport> {
        // Before the sleepers' lock, which a thread of the parent may have held at the fork.
        self.allocator.check_process("this runtime")?;
        let mut names: Vec<String> = if tags.is_empty() {
            self.sleepers.lock().keys().cloned().collect()
        } else {
            tags.iter().map(|t| (*t).to_owned()).collect()
        };
        names.sort();
        names.dedup();
        let mut report = WakeReport::default();
        for name in names {
            self.wake_one(&name, options, tags.is_empty(), &mut report)?;
        }
        Ok(report)
    }

    /// Wakes tag `name`; when `every` (waking every sleeping tag), one another thread is waking
    /// or woke meanwhile is skipped (`begin_wake` refuses a tag that is not asleep with
    /// `Error::Asleep`) — only that refusal, never an error of the restore.
    fn wake_one(
        &self,
        name: &str,
        options: WakeOptions,
        every: bool,
        report: &mut WakeReport,
    ) -> Result<()> {
        let start = match self.allocator.begin_wake(name) {
            Ok(start) => start,
            Err(Error::Asleep { .. }) if every => return Ok(()),
            Err(err) => return Err(err),
        };
        let kept = self.sleepers.lock().remove(name).unwrap_or_default();
        report.mapped_bytes += start.mapped_bytes;
        // The blocks still allocated, with the stream their restore runs on now (not the one of
        // the sleep's copy: a stream destroyed meanwhile is replaced by a live one).
        let live: HashMap<(usize, u64), StreamId> = start
            .ranges
            .iter()
            .map(|r| ((r.device, r.addr), r.stream))
            .collect();
        let driver = self.allocator().driver();
        let mut streams: Vec<StreamId> = Vec::new();
        // The allocator's own writes of the program's bytes (the sanitizer's bounds and
        // copy-on-write checks do not concern them: `driver::sanitizer::allocators_own`).
        let restore = || -> Result<()> {
            for (range, buffer) in &kept.buffers {
                let Some(&stream) = live.get(&(range.device, range.addr)) else {
                    continue; // freed while asleep
                };
                // SAFETY: the copy reads only the buffer's first `len` bytes, on `stream`; the
                // buffer lives in `kept` until that stream is synchronized below.
                unsafe {
                    buffer.enqueue_read(stream, 0..buffer.len(), |src, len| {
                        driver.pinned().copy_pinned_to_device(
                            stream,
                            DeviceAddr(range.addr),
                            src,
                            len,
                        )
                    })?;
                }
                streams.push(stream);
                report.restored_bytes += range.len;
            }
            if !kept.offloaded && options.zero_discarded {
                for range in &start.ranges {
                    // SAFETY: the wake's own zeroing of discarded memory, ordered on the stream of each range as its restore is; nothing uses the tag's memory until the wake returns.
                    unsafe { driver.memset(range.stream, DeviceAddr(range.addr), 0, range.len) }?;
                    streams.push(range.stream);
                    report.zeroed_bytes += range.len;
                }
            }
            streams.sort_unstable_by_key(|s| s.raw());
            streams.dedup();
            for &stream in &streams {
                driver.stream_synchronize(stream)?;
            }
            Ok(())
        };
        let failed = match catch_unwind(AssertUnwindSafe(|| {
            crate::driver::sanitizer::allocators_own(restore)
        })) {
            Ok(Ok(())) => None,
            Ok(Err(err)) => Some(Ok(err)),
            Err(panic) => Some(Err(panic)),
        };
        if let Some(failure) = failed {
            // The memory is mapped; its bytes are not all back (an error, or a panic of the
            // driver: the stream sanitizer's panic mode). Keep them for a retry of the copy by
            // the caller's next wake: the tag goes back to sleep.
            self.sleepers.lock().insert(name.to_owned(), kept);
            self.allocator.sleep_again(start);
            return match failure {
                Ok(err) => Err(err),
                Err(panic) => resume_unwind(panic),
            };
        }
        // Storages of the tag shared earlier are served with the new pages' chunks from now on
        // (read before the page registry's lock is taken: no shard lock under it).
        self.serve_spans_from(&start.mapped_pages());
        self.allocator.finish_wake(start);
        Ok(())
    }

    /// A pinned buffer for `range` and the copy of its bytes into it, enqueued on the block's
    /// stream (waited for by the caller).
    fn offload(&self, range: &TagRange) -> Result<PinnedBuffer> {
        let driver = self.allocator().driver();
        let len = range.len;
        let mut buffer = self.pinned_allocator().allocate(len)?;
        // The allocator's own read of the whole block, its rounding too (the sanitizer's bounds,
        // which are the bytes asked for, do not concern it: `driver::sanitizer::allocators_own`).
        crate::driver::sanitizer::allocators_own(|| {
            // SAFETY: the copy writes only the buffer's `len` bytes, on `range.stream`; the
            // buffer is not borrowed, and is kept until that stream is synchronized.
            unsafe {
                buffer.enqueue_write(range.stream, 0..len, |dst, n| {
                    driver.pinned().copy_device_to_pinned(
                        range.stream,
                        dst,
                        DeviceAddr(range.addr),
                        n,
                    )
                })
            }
        })?;
        Ok(buffer)
    }

    /// Refuses to put `tag` to sleep when other processes still count on the memory of `range`.
    fn refuse_shared(&self, tag: &str, range: &TagRange) -> Result<()> {
        let end = range.addr.saturating_add(range.len);
        match self.ipc().shared_in(range.addr, end) {
            None => Ok(()),
            Some(at) => Err(Error::Asleep {
                tag: tag.to_owned(),
                message: format!(
                    "cannot sleep: memory at {at:#x} is shared with other processes and still held \
                     there (or a handle to it is unopened); unmapping it would pull it from under \
                     them — release it there (or run ipc_collect once they exited) and sleep again"
                ),
            }),
        }
    }

    /// Serves the shared spans lying on `pages` with those chunks (address → chunk).
    fn serve_spans_from(&self, pages: &BTreeMap<u64, ChunkId>) {
        self.ipc().refresh_served(|first, page, count| {
            (0..count)
                .map(|i| {
                    let at = first.checked_add(i.checked_mul(page)?)?;
                    pages.get(&at).copied()
                })
                .collect()
        });
    }

    /// Gives up started sleeps whose bytes may be filed and whose spans paused already: the
    /// filed bytes dropped, the spans served again, every tag awake.
    fn abandon(&self, started: Vec<Started>) {
        let mut sleepers = self.sleepers.lock();
        for (start, ..) in &started {
            sleepers.remove(&start.tag);
            self.serve_spans_from(&start.mapped_pages());
        }
        drop(sleepers);
        for (start, ..) in started {
            self.allocator.cancel_sleep(start);
        }
    }

    /// Gives up every started sleep; returns `err`.
    fn cancel_all(&self, started: Vec<Started>, err: Error) -> Error {
        for (start, _, _) in started {
            self.allocator.cancel_sleep(start);
        }
        err
    }
}
