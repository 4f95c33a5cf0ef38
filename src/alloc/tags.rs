//! Tags: named memory pools that can be put to sleep and woken (vLLM's `CuMemAllocator` tags,
//! SGLang's `torch_memory_saver` regions). A tag is a [`MemPool`] of the allocator, made on first
//! use, whose memory lives on expandable segments of its own; a thread allocates into it inside
//! [`Runtime::use_tag`](crate::Runtime::use_tag) (a [`PoolScope`]), or through the pool itself.
//!
//! The protocol (one tag; `runtime/sleep.rs` runs it over several and copies the bytes):
//!
//! | phase | allocations of the tag | pages | entered by | left by |
//! |---|---|---|---|---|
//! | awake | served | mapped | making the tag; a finished wake | [`Runtime::begin_sleep`](crate::Runtime::begin_sleep) |
//! | falling asleep | refused ([`Error::Asleep`]) | mapped; its free pages given back (kept when graphs hold the tag: they sleep with the rest), its streams waited for | `begin_sleep` (refused while a capture is under way) | `finish_sleeps` (pages unmapped and released), `cancel_sleep` (awake again) |
//! | asleep | refused | unmapped, released; reservations kept | `finish_sleeps` | `begin_wake` |
//! | waking | refused | mapped again at the same addresses, registered | `begin_wake` (on failure: asleep again, nothing mapped) | `finish_wake` (after the bytes are back) |
//!
//! Beginning a sleep or a wake is undone when it fails — an error, or a panic unwinding through
//! it (a driver in the stream sanitizer's panic mode) — and leaves the tag in the phase it
//! started from (`PhaseUndo`; a wake's shards already mapped go back to sleep). Code the
//! allocator calls back into (registrars, observers, free-memory callbacks) cannot unwind
//! through any step: its panics are caught where it is called. What could still unwind through
//! the unmaps that end a sleep, or through one shard's maps, is the allocator's own invariant
//! checker (`check_invariants`: a bug report) or a driver that panics in `vm_map` or `vm_unmap`
//! (none of this crate's does, the sanitizer's panic mode included); the tag then stays where it
//! stopped.
//!
//! The shards' `sleeping` flag is set on the way into "falling asleep" *before* any shard lock is
//! taken to list what to offload, and cleared when "awake" is entered again; allocations read it
//! under the shard's lock (`try_fit`, then the slow path says why: `device.rs`), so an
//! allocation racing a sleep either finishes before the listing (its block is offloaded) or is
//! refused.

use super::engine::{DeviceCore, Shard};
use super::mem_pool::{MemPool, PoolScope};
use super::pool_id::{MemPoolId, MemPoolOptions, Phase, TagPhases};
use super::CachingAllocator;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use crate::driver::{ChunkId, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::{Arc, Mutex, RwLock};

/// An allocator's tags: one record each — its name, its pool (the handle that keeps the pool
/// alive) and its phase — read by pool id by the engine ([`TagPhases`]). Tags are few: lookups
/// scan. Two locks, in this order: `steps` serializes the phase changes of the protocol (a step
/// never falls between a wake's "awake" and its clearing of the shards' flags: `end_phase` holds
/// it while it lists the tag's shards, which takes a device's shard map; the other steps list
/// their shards after releasing it, each phase change checking the phase it starts from);
/// `records` is taken alone and briefly, since a device creating a shard under its map's lock
/// reads a phase. The records hold
/// pools whose devices hold this book: the allocator's drop clears it ([`Tags::clear`]).
#[derive(Debug, Default)]
pub(crate) struct Tags {
    steps: Mutex<()>,
    records: RwLock<Vec<TagRecord>>,
}

#[derive(Debug)]
struct TagRecord {
    name: Arc<str>,
    pool: MemPool,
    phase: Phase,
}

impl TagPhases for Tags {
    fn is_sleeping(&self, pool: MemPoolId) -> bool {
        self.phase_of(pool) != Phase::Awake
    }

    fn name_of(&self, pool: MemPoolId) -> Option<Arc<str>> {
        self.records
            .read()
            .iter()
            .find(|r| r.pool.id() == pool)
            .map(|r| Arc::clone(&r.name))
    }
}

impl Tags {
    /// The phase of tag `pool` (awake for a pool that is no tag).
    fn phase_of(&self, pool: MemPoolId) -> Phase {
        self.records
            .read()
            .iter()
            .find(|r| r.pool.id() == pool)
            .map_or(Phase::Awake, |r| r.phase)
    }

    /// The pool of tag `name`.
    fn pool(&self, name: &str) -> Option<MemPool> {
        self.records
            .read()
            .iter()
            .find(|r| &*r.name == name)
            .map(|r| r.pool.clone())
    }

    /// Sets the phase of tag `pool`.
    fn set_phase(&self, pool: MemPoolId, to: Phase) {
        if let Some(r) = self
            .records
            .write()
            .iter_mut()
            .find(|r| r.pool.id() == pool)
        {
            r.phase = to;
        }
    }

    /// Forgets every tag (the allocator's drop: the pools go, and with them the cycle through
    /// their devices).
    pub(crate) fn clear(&self) {
        let records = std::mem::take(&mut *self.records.write());
        drop(records);
    }
}

/// One block of a tag to offload (or restore): where, how long, and the stream of its shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TagRange {
    pub device: usize,
    pub stream: StreamId,
    pub addr: u64,
    pub len: u64,
}

/// A tag falling asleep: its shards, and the blocks to offload (their streams already waited
/// for).
#[derive(Debug)]
pub(crate) struct SleepStart {
    pub tag: String,
    pool: MemPool,
    shards: Vec<(usize, Arc<Shard>)>,
    pub ranges: Vec<TagRange>,
    /// Bytes of cached free pages given back on the way (before any copy).
    pub released_cached: u64,
}

/// A tag waking: its shards (pages mapped back), and the blocks still allocated, whose bytes
/// are to be restored.
#[derive(Debug)]
pub(crate) struct WakeStart {
    pub tag: String,
    pool: MemPool,
    shards: Vec<(usize, Arc<Shard>)>,
    pub ranges: Vec<TagRange>,
    /// Bytes mapped again.
    pub mapped_bytes: u64,
}

/// Sets a tag's phase back when dropped armed: a step that did not get through — an error, or a
/// panic unwinding through it (a driver in the stream sanitizer's panic mode) — leaves the tag
/// as it was before the step, never stuck half-way with its allocations refused.
struct PhaseUndo<'a> {
    alloc: &'a CachingAllocator,
    pool: &'a MemPool,
    to: Phase,
    armed: bool,
}

impl<'a> PhaseUndo<'a> {
    fn new(alloc: &'a CachingAllocator, pool: &'a MemPool, to: Phase) -> Self {
        PhaseUndo {
            alloc,
            pool,
            to,
            armed: true,
        }
    }

    /// The step got through: nothing to undo.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for PhaseUndo<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.alloc.end_phase(self.pool, self.to);
        }
    }
}

/// The pages mapped now under `shards`' expandable segments: address → chunk.
fn mapped_pages(shards: &[(usize, Arc<Shard>)]) -> BTreeMap<u64, ChunkId> {
    let mut out = BTreeMap::new();
    for (_, shard) in shards {
        shard.mapped_pages_into(&mut out);
    }
    out
}

impl SleepStart {
    /// The tag's pages mapped now (before the sleep unmaps them): what its shared spans are
    /// served with again when the sleep is given up.
    pub(crate) fn mapped_pages(&self) -> BTreeMap<u64, ChunkId> {
        mapped_pages(&self.shards)
    }
}

impl WakeStart {
    /// The tag's pages mapped again: what its shared spans are served with after the wake.
    pub(crate) fn mapped_pages(&self) -> BTreeMap<u64, ChunkId> {
        mapped_pages(&self.shards)
    }
}

fn asleep(tag: &str, message: impl Into<String>) -> Error {
    Error::Asleep {
        tag: tag.to_owned(),
        message: message.into(),
    }
}

impl CachingAllocator {
    /// The body of [`Runtime::tag`](crate::Runtime::tag), documented there.
    pub(crate) fn tag(&self, name: &str) -> Result<MemPool> {
        self.birth.check("this allocator")?;
        if name.is_empty() || name.len() > 256 {
            return Err(Error::invalid(format!(
                "a tag's name is 1 to 256 bytes, not {}",
                name.len()
            )));
        }
        let _steps = self.tags.steps.lock();
        if let Some(pool) = self.tags.pool(name) {
            return Ok(pool);
        }
        let pool = self.mem_pool(MemPoolOptions::default().with_expandable_segments(true))?;
        self.tags.records.write().push(TagRecord {
            name: Arc::from(name),
            pool: pool.clone(),
            phase: Phase::Awake,
        });
        Ok(pool)
    }

    /// The body of [`Runtime::use_tag`](crate::Runtime::use_tag), documented there.
    pub(crate) fn use_tag(&self, name: &str, device: usize) -> Result<PoolScope> {
        let pool = self.tag(name)?;
        self.use_mem_pool(&pool, device)
    }

    /// The tags made so far, by name (none in a forked child: the tags are the parent's, and
    /// their lock may be held for good there).
    pub(crate) fn tag_names(&self) -> Vec<String> {
        if self.birth.ignored_in_child("listing the tags") {
            return Vec::new();
        }
        let mut names: Vec<String> = self
            .tags
            .records
            .read()
            .iter()
            .map(|r| r.name.to_string())
            .collect();
        names.sort();
        names
    }

    /// Whether tag `name` is asleep (or on its way to or from sleep); an error for an unknown
    /// tag, and in a forked child.
    pub(crate) fn is_asleep(&self, name: &str) -> Result<bool> {
        self.birth.check("this allocator")?;
        let records = self.tags.records.read();
        let record = records.iter().find(|r| &*r.name == name).ok_or_else(|| {
            let names: Vec<&str> = records.iter().map(|r| &*r.name).collect();
            Error::invalid(format!("no tag {name:?} (tags: {names:?})"))
        })?;
        Ok(record.phase != Phase::Awake)
    }

    /// Moves tag `name` from `from` to `to`; the tag's pool.
    fn step(&self, name: &str, from: Phase, to: Phase) -> Result<MemPool> {
        // Under the tags' lock, as `end_phase`: a step never falls between a wake's "awake"
        // and its clearing of the shards' flags.
        let _steps = self.tags.steps.lock();
        let mut records = self.tags.records.write();
        let record = records
            .iter_mut()
            .find(|r| &*r.name == name)
            .ok_or_else(|| Error::invalid(format!("no tag {name:?}")))?;
        if record.phase != from {
            return Err(asleep(
                name,
                format!("the tag is {}, not {from}", record.phase),
            ));
        }
        record.phase = to;
        Ok(record.pool.clone())
    }

    /// Every shard of `pool` on every device (none in a forked child).
    fn tag_shards(&self, pool: &MemPool) -> Vec<(usize, Arc<Shard>)> {
        self.devices
            .in_its_process()
            .unwrap_or_default()
            .iter()
            .flat_map(|d| {
                d.pool_shards(pool.id())
                    .into_iter()
                    .map(|s| (d.device(), s))
            })
            .collect()
    }

    /// Starts putting tag `name` to sleep: its allocations refused from now on, its cached free
    /// pages given back, every stream that used its memory waited for; then, under each shard's
    /// lock, `offload` is called for every allocated block (to enqueue its copy on the block's
    /// stream: a free racing the sleep then waits for the lock, and its stream orders it after
    /// the copy). Refused while a capture is under way (unmapping is forbidden then); an error
    /// of `offload` gives the sleep up (the tag is awake).
    pub(crate) fn begin_sleep(
        &self,
        name: &str,
        offload: impl FnMut(&TagRange) -> Result<()>,
    ) -> Result<SleepStart> {
        let devices = self.devices.all("this allocator")?;
        let pool = self.step(name, Phase::Awake, Phase::FallingAsleep)?;
        let undo = PhaseUndo::new(self, &pool, Phase::Awake);
        let start = self.prepare_sleep(name, &pool, devices, offload)?;
        undo.disarm();
        Ok(start)
    }

    fn prepare_sleep(
        &self,
        name: &str,
        pool: &MemPool,
        devices: &[Arc<DeviceCore>],
        mut offload: impl FnMut(&TagRange) -> Result<()>,
    ) -> Result<SleepStart> {
        if self.capturing.any() {
            return Err(Error::capture(format!(
                "tag {name:?} cannot sleep while a stream capture is under way (unmapping memory \
                 would invalidate it); end the capture first"
            )));
        }
        // Not awake in the book since `step`, before the shards are listed: a shard made
        // meanwhile starts asleep.
        let shards = self.tag_shards(pool);
        for (_, shard) in &shards {
            shard.set_sleeping(true);
        }
        let mut ranges = Vec::new();
        let mut released_cached = 0;
        for (device, shard) in &shards {
            let core = &devices[*device];
            // Cached free pages first: they need no copy (and pending frees are waited for) —
            // unless graphs hold the pool: their replays write its free blocks, whose pages must
            // come back with the wake, so they sleep with the rest.
            if !self.capturing.held_by_graphs(pool.id()) {
                let before = shard.reserved_bytes();
                core.release_shard(shard, true, false);
                released_cached += u64::try_from(before - shard.reserved_bytes()).unwrap_or(0);
            }
            for stream in shard.sleep_streams() {
                self.driver.stream_synchronize(stream)?;
            }
            let stream = shard.copy_stream(|| self.default_stream(*device))?;
            shard.offload_allocated(|addr, len| {
                let range = TagRange {
                    device: *device,
                    stream,
                    addr,
                    len,
                };
                offload(&range)?;
                ranges.push(range);
                Ok(())
            })?;
        }
        Ok(SleepStart {
            tag: name.to_owned(),
            pool: pool.clone(),
            shards,
            ranges,
            released_cached,
        })
    }

    /// Ends the sleeps begun with [`Self::begin_sleep`] (the bytes to keep are copied out): every
    /// mapped page of the tags unmapped and released; returns the bytes given back by each
    /// (cached pages included). All under one hold of the capture gate, so a capture cannot
    /// begin between two tags: refused as a whole (the caller cancels) when one is under way.
    pub(crate) fn finish_sleeps(&self, starts: &[&SleepStart]) -> Result<Vec<u64>> {
        let devices = self.devices.all("this allocator")?;
        // Held across the unmaps: a capture does not begin in between (`capturing.rs`).
        let Some(_no_capture) = self.capturing.releasing() else {
            return Err(Error::capture(
                "tags cannot sleep while a stream capture is under way; end it first",
            ));
        };
        let mut out = Vec::with_capacity(starts.len());
        for start in starts {
            let mut released = start.released_cached;
            for (device, shard) in &start.shards {
                released += devices[*device].sleep_shard(shard, &start.tag);
            }
            self.tags.set_phase(start.pool.id(), Phase::Asleep);
            out.push(released);
        }
        Ok(out)
    }

    /// Gives up a sleep begun with [`Self::begin_sleep`]: the tag is awake again.
    pub(crate) fn cancel_sleep(&self, start: SleepStart) {
        self.end_phase(&start.pool, Phase::Awake);
    }

    /// Starts waking tag `name`: fresh pages mapped at the same addresses and registered;
    /// returns the blocks still allocated (whose bytes are to be restored). On a failure the
    /// tag stays asleep and nothing is mapped.
    pub(crate) fn begin_wake(&self, name: &str) -> Result<WakeStart> {
        let devices = self.devices.all("this allocator")?;
        let pool = self.step(name, Phase::Asleep, Phase::Waking)?;
        let undo = PhaseUndo::new(self, &pool, Phase::Asleep);
        let shards = self.tag_shards(&pool);
        // A stream destroyed while the tag slept: the restore runs on a live one.
        let streams = shards
            .iter()
            .map(|(device, shard)| shard.copy_stream(|| self.default_stream(*device)))
            .collect::<Result<Vec<StreamId>>>()?;
        let mut mapped = self.map_back(name, devices, &shards);
        if matches!(mapped, Err(Error::OutOfMemory { .. })) {
            // As an allocation would: free-memory callbacks, then every cache, then once more.
            self.callbacks.run();
            for device in devices {
                device.release_cached(true);
            }
            mapped = self.map_back(name, devices, &shards);
        }
        let mapped_bytes = mapped?;
        let mut ranges = Vec::new();
        for ((device, shard), &stream) in shards.iter().zip(&streams) {
            ranges.extend(
                shard
                    .allocated_ranges()
                    .into_iter()
                    .map(|(addr, len)| TagRange {
                        device: *device,
                        stream,
                        addr,
                        len,
                    }),
            );
        }
        undo.disarm();
        Ok(WakeStart {
            tag: name.to_owned(),
            pool,
            shards,
            ranges,
            mapped_bytes,
        })
    }

    /// Maps the pages of `shards` back (all or nothing: on an error what was mapped is unmapped
    /// again); the bytes mapped.
    fn map_back(
        &self,
        name: &str,
        devices: &[Arc<DeviceCore>],
        shards: &[(usize, Arc<Shard>)],
    ) -> Result<u64> {
        // Held across the maps: a capture does not begin in between.
        let Some(_no_capture) = self.capturing.releasing() else {
            return Err(Error::capture(format!(
                "tag {name:?} cannot wake while a stream capture is under way; end it first"
            )));
        };
        let mut woken: Vec<&(usize, Arc<Shard>)> = Vec::new();
        let mut mapped_bytes = 0;
        for entry in shards {
            let (device, shard) = entry;
            let woke = catch_unwind(AssertUnwindSafe(|| devices[*device].wake_shard(shard)));
            if let Ok(Ok(bytes)) = woke {
                mapped_bytes += bytes;
                woken.push(entry);
                continue;
            }
            // Back to sleep, on an error or an unwind: what was woken holds nothing restored yet.
            for (device, shard) in woken {
                devices[*device].sleep_shard(shard, name);
            }
            return match woke {
                Err(panic) => resume_unwind(panic),
                Ok(outcome) => outcome,
            };
        }
        Ok(mapped_bytes)
    }

    /// Ends a wake begun with [`Self::begin_wake`] (the bytes are back): the tag is awake.
    pub(crate) fn finish_wake(&self, start: WakeStart) {
        self.end_phase(&start.pool, Phase::Awake);
    }

    /// Gives up a wake begun with [`Self::begin_wake`] (its bytes could not be restored): the
    /// pages are unmapped again and the tag is asleep.
    pub(crate) fn sleep_again(&self, start: WakeStart) {
        let devices = self.devices.in_its_process().unwrap_or_default();
        for (device, shard) in &start.shards {
            if let Some(core) = devices.get(*device) {
                core.sleep_shard(shard, &start.tag);
            }
        }
        self.end_phase(&start.pool, Phase::Asleep);
    }

    /// Sets the tag's phase to `to`; when awake, its shards serve allocations again — every
    /// shard listed after the book says so (a shard made meanwhile, which read the book while
    /// it said asleep, is listed too: it was inserted under the map's lock before the listing).
    /// Under the tags' lock, so that a sleep's `step` cannot set the flags in between and see
    /// them cleared.
    fn end_phase(&self, pool: &MemPool, to: Phase) {
        let _no_step = self.tags.steps.lock();
        self.tags.set_phase(pool.id(), to);
        if to == Phase::Awake {
            for (_, shard) in self.tag_shards(pool) {
                shard.set_sleeping(false);
            }
        }
    }
}
