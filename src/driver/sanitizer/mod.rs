//! The stream sanitizer: a happens-before checker of everything enqueued on a driver's streams.
//!
//! Off by default; on with `CUDALLOC_SANITIZE=1` (or `panic`, which panics at the first hazard —
//! for test suites; add `,stacks` to capture the Rust stack of every access), or from code with
//! [`CachingAllocatorBuilder::sanitize`](crate::CachingAllocatorBuilder::sanitize). The allocator
//! wraps its driver in a [`SanitizedDriver`], so both backends (and the simulated one) feed the
//! same checker; the host backend's library kernels ([`HostDriver::enqueue_host`](crate::backend::HostDriver::enqueue_host))
//! and cudarc views report their accesses to it too, and the allocator reports its hand-outs and
//! frees.
//!
//! # The model (a vector-clock race detector, per byte range)
//!
//! Every stream is an actor with a vector clock; so is the host. Another process's writes before
//! its IPC event are an actor too (one per opened event).
//!
//! | call | effect on the clocks |
//! |---|---|
//! | any work enqueued on stream `s` (copy, memset, kernel, host kernel, view) | `C[s] ⊔= H`; `C[s][s] += 1`: the work's epoch |
//! | `event_record(e, s)` | `E[e] := C[s] ⊔ H` |
//! | `stream_wait_event(s, e)` | `C[s] ⊔= E[e]` |
//! | `graph_launch(x, s)` (an instantiated graph) | `C[s] ⊔= L[x]` (CUDA runs one executable graph's launches one after the other), then as any work; `L[x] := C[s]` |
//! | `stream_synchronize(s)`, a blocking copy or verify on `s` | `H ⊔= C[s]` (as of the call) |
//! | `event_synchronize(e)` | `H ⊔= E[e]` |
//! | `free`, `ipc_close_memory`, `vm_unmap` (the allocator's and the IPC layer's own steps, when memory pressure says) | nothing: the bytes are forgotten (a race straddling them is still one) |
//! | the allocator's pending-free events (recorded, polled, waited on the unsanitized driver) | nothing: the free's clock covers that reuse (below) |
//! | receipt of a storage whose producer recorded IPC event `e` | `E[e] := {producer P: n}` (P's n-th opened event); the bytes are written by `(P, n)` once the receiving stream waited |
//! | `stream_query`, `event_query` | nothing: a query observes timing, and verdicts must not depend on timing |
//!
//! An access `(s, epoch)` is *ordered before* whatever carries a clock `K` when `K[s] ≥ epoch`.
//! Each byte range remembers its last write and the reads since (`shadow.rs`). A new access on
//! stream `t` with clock `K` is a **race** when an earlier access to overlapping bytes on another
//! actor is not ordered before `K` and one of the two writes. The check runs when the work is
//! enqueued, on the calling thread, so a hazard is reported whatever the timing of the streams.
//!
//! The allocator's part (`memory.rs`):
//!
//! | allocator step | sanitizer |
//! |---|---|
//! | free of a block (its own stream `o`, recorded streams `r…`; `alloc/engine/handover.rs` tells every free) | the bytes are *freed* with `F = C[o] ⊔ C[r…] ⊔ H`: what the allocator's events guarantee before reuse; in a pool live graphs hold, the graphs' replays may still touch them, and need not be ordered before the free (the pool's reuse follows the replays, or the driver's synchronizing free) |
//! | hand-out of bytes | every access to them on an actor other than `o` must be ordered before `F`, else a **use after free** (reported even without `record_stream`); those accesses are then dropped (the allocator waited for them), accesses on `o` stay (a later access on another stream must still be ordered after them); graph-held bytes are marked as taken by the new allocation: a replay of the pool's graphs touching them is reported (it writes another owner's memory) until they are freed again |
//! | release of freed memory to the driver (`empty_cache`, the out-of-memory path, page release) | the hand-out's check, then the bytes are forgotten: a forgotten `record_stream` is reported whether the block is reused or released first |
//! | a COW copy, an IPC event | ordinary driver calls, checked as above; the COW copy is named as the lazy clone's copy-on-write copy in reports (`labelled`) |
//! | a lazy clone (`cow/context.rs`) | the allocation is *shared*: a write into it (through a clone's read pointer, or a raw pointer) is a **write into copy-on-write memory**, refused; unshared when the last reference steals it or is the only one left |
//! | every access (but a replay's, whose ranges are its capture's) | it must stay inside one live allocation (the block handed out, not the segment): one that runs past its allocation's end, or begins outside every allocation and runs into one, is **out of bounds**, refused before it runs; memory the allocator did not hand out (a library's own driver allocation, another process's) is not checked |
//! | a tag's pages put to sleep, mapped back at wake (`asleep.rs`) | any work on a sleeping range is refused with [`Error::Asleep`] and reported as an access while asleep |
//! | pinned host memory: host borrows of a `PinnedBuffer`, the pinned allocator's frees and hand-outs | the host is an actor too (`host.rs`): a borrow racing a copy, or a block reused while a copy still reads it, is reported |
//!
//! A receipt of another process's storage marks its bytes as written by the producer's event
//! actor: a consumer stream that did not wait for the event (the current stream at receipt does)
//! races with it.
//!
//! # Reports
//!
//! A hazard is an [`Error::StreamRace`] naming both accesses (stream, operation, byte range,
//! allocation, and the stacks when on), logged with `tracing::error!`, kept in
//! [`Sanitizer::reports`], and *sticky* on the stream of the later access, like a CUDA error:
//! the call that found it and every later call on that stream return it. In panic mode the call
//! panics instead. Off, the allocator pays one predictable branch per allocation and free.
//!
//! Host threads are one actor: the sanitizer cannot see how threads synchronize with each other,
//! so it assumes they do (it may miss a race between threads, never invent one).
//!
//! What it cannot see: work and synchronization made outside cudalloc — a kernel launched
//! through cudarc without a view, `CudaStream::synchronize`, an event of cudarc's, stream calls
//! made on the host backend reached through `as_host()`. Tell it with [`Sanitizer::enqueue`],
//! [`Sanitizer::host_synchronized`] and [`Sanitizer::stream_waited`], or go through the
//! runtime's driver. A cudarc view is one access, on the stream it was made for, when it is made:
//! launching it again later, or on another stream through `launch_builder(&other)`, is not seen
//! (pass `&other` to `device_ptr`, or make a view per launch).
//!
//! Costs and limits: one lock for the whole checker, held across each enqueue so the model's order
//! is the streams' real order (only while the sanitizer is on); one actor per stream ever seen
//! and per producer process whose storages were received, never reclaimed (clocks grow with
//! them: a program that creates a stream per task should reuse streams under the sanitizer);
//! an access to freed bytes is found where an earlier access touched them.
//! CUDA's legacy default stream synchronizes implicitly with *blocking* streams; cudalloc makes
//! non-blocking streams, and that implicit order is not modeled (a library relying on it is
//! reported).
//!
//! Deviation from DESIGN §12: queries (`stream_query`, `event_query`) do not join the host's clock
//! — the allocator polls them to decide reuse, and their answers depend on timing; a verdict that
//! did would too. The allocator's own reuse is covered instead by the free's clock (the table
//! above).

mod asleep;
mod clock;
mod graphs;
mod host;
mod memory;
mod options;
mod report;
mod shadow;
mod stack;
mod state;
mod wrapper;

pub use options::SanitizeOptions;

thread_local! {
    /// What the work a thread enqueues next is, for reports, when the allocator does it on the
    /// program's behalf (`labelled`).
    static LABEL: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the thread-local `key` set to `value`, restored after (also when `f` panics).
fn with_set<T: Copy + 'static, R>(
    key: &'static std::thread::LocalKey<std::cell::Cell<T>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static std::thread::LocalKey<std::cell::Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(key, key.with(|c| c.replace(value)));
    f()
}

/// Runs `f`, whose stream work the sanitizer's reports name `label` instead of the driver call
/// (a lazy clone's copy-on-write copy is one `copy_device_to_device`, named as what it is).
pub(crate) fn labelled<R>(label: &'static str, f: impl FnOnce() -> R) -> R {
    with_set(&LABEL, Some(label), f)
}

/// The label `labelled` set on this thread, else `call`.
fn label_or(call: &'static str) -> &'static str {
    LABEL.with(std::cell::Cell::get).unwrap_or(call)
}

thread_local! {
    /// The allocator's own work on the program's memory runs now (`allocators_own`).
    static ALLOCATORS_OWN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, whose stream work is the allocator's own restoring of the program's bytes (a wake
/// writing back what a sleep offloaded): checked for races like any work, but neither bounds nor
/// copy-on-write sharing concern it — it writes whole blocks, lazy clones' shared ones included.
pub(crate) fn allocators_own<R>(f: impl FnOnce() -> R) -> R {
    with_set(&ALLOCATORS_OWN, true, f)
}
pub use crate::driver::access::{AccessKind, Touch};
pub use report::{AccessReport, HazardKind, HazardReport};
pub use wrapper::SanitizedDriver;

use self::clock::VectorClock;
use self::shadow::Access;
use self::stack::Stack;
use self::state::State;
use crate::driver::{EventId, GraphExecId, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicBool, Ordering};
use crate::sync::os::{Arc, Mutex, MutexGuard};

/// The most reports kept (later ones are counted and logged, not kept).
const MAX_KEPT_REPORTS: usize = 1000;

/// The checker; one per driver (see `src/driver/sanitizer/mod.rs`).
#[derive(Debug)]
pub struct Sanitizer {
    options: SanitizeOptions,
    stacks: AtomicBool,
    state: Mutex<State>,
    /// What captures recorded, for checking their replays (`graphs.rs`).
    graphs: graphs::GraphTouches,
}

impl Sanitizer {
    /// A checker with `options`.
    pub fn new(options: SanitizeOptions) -> Self {
        Sanitizer {
            options,
            stacks: AtomicBool::new(options.stacks),
            state: Mutex::new(State::default()),
            graphs: graphs::GraphTouches::default(),
        }
    }

    /// The options it was made with.
    pub fn options(&self) -> SanitizeOptions {
        self.options
    }

    /// Turns stack capture on or off (the allocator turns it on with history stacks).
    pub fn set_stacks(&self, on: bool) {
        self.stacks.store(on, Ordering::Relaxed);
    }

    /// The hazards found so far (at most the first 1000).
    pub fn reports(&self) -> Vec<HazardReport> {
        self.state.lock().reports.clone()
    }

    /// Takes the hazards found so far, leaving none.
    pub fn take_reports(&self) -> Vec<HazardReport> {
        std::mem::take(&mut self.state.lock().reports)
    }

    /// How many hazards were found (kept or not).
    pub fn hazard_count(&self) -> u64 {
        self.state.lock().hazards
    }

    /// Checks and records work on `stream` touching `touches`, running `enqueue` (the real
    /// enqueue) under the checker's lock so that its order is the streams' real order. A hazard
    /// fails the stream (sticky) and nothing is enqueued. A library calls it for work cudalloc
    /// does not see (a kernel launched through cudarc on raw pointers), with `enqueue` doing the
    /// launch (or `|| Ok(())` right before it).
    pub fn enqueue<T>(
        &self,
        stream: StreamId,
        what: &str,
        touches: &[Touch],
        enqueue: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let mut st = self.state.lock();
        let (slot, k) = self.check(&mut st, stream, what, touches)?;
        let out = enqueue()?;
        self.commit(&mut st, slot, k, what, touches, false);
        Ok(out)
    }

    /// Checks that `touches` would be ordered on `stream` now (a race is reported, sticky, as
    /// for [`Sanitizer::enqueue`]) without recording an access: for steps whose real accesses
    /// happen elsewhere after an event of `stream` (sharing with another process).
    pub(crate) fn check_ordered(
        &self,
        stream: StreamId,
        what: &str,
        touches: &[Touch],
    ) -> Result<()> {
        let mut st = self.state.lock();
        self.check(&mut st, stream, what, touches).map(drop)
    }

    /// As [`Sanitizer::enqueue`] for work that returns when it is done (a blocking copy): checked
    /// and recorded first, run without the lock, then the host knows the stream up to it.
    pub(crate) fn blocking<T>(
        &self,
        stream: StreamId,
        what: &str,
        touches: &[Touch],
        run: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let k = {
            let mut st = self.state.lock();
            let (slot, k) = self.check(&mut st, stream, what, touches)?;
            self.commit(&mut st, slot, k.clone(), what, touches, false);
            k
        };
        let out = run()?;
        self.state.lock().host.join(&k);
        Ok(out)
    }

    fn check(
        &self,
        st: &mut MutexGuard<'_, State>,
        stream: StreamId,
        what: &str,
        touches: &[Touch],
    ) -> Result<(usize, VectorClock)> {
        let slot = st.sticky(stream)?;
        let mut k = st.knowledge(slot);
        k.tick(slot);
        self.check_touches(st, slot, &k, what, touches, None)?;
        Ok((slot, k))
    }

    /// A launch of the instantiated graph `exec` on `stream`, touching `touches`, with `enqueue`
    /// the real launch. CUDA runs the launches of one executable graph one after the other,
    /// whatever their streams: this launch is ordered after the previous one (its stream's clock
    /// joins the previous launch's). Checked and recorded like eager work, except that bytes
    /// freed into a pool that live graphs hold are the graph's to touch (not a use after free).
    pub(crate) fn launch<T>(
        &self,
        exec: GraphExecId,
        born: u64,
        stream: StreamId,
        touches: &[Touch],
        enqueue: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        const WHAT: &str = "a graph replay";
        let mut st = self.state.lock();
        let slot = st.sticky(stream)?;
        let mut k = st.knowledge(slot);
        if let Some(previous) = st.launches.get(&exec.0) {
            k.join(previous);
        }
        k.tick(slot);
        self.check_touches(&mut st, slot, &k, WHAT, touches, Some(born))?;
        let out = enqueue()?;
        self.commit(&mut st, slot, k.clone(), WHAT, touches, true);
        st.launches.insert(exec.0, k);
        Ok(out)
    }

    /// Checks `touches` by actor `slot` carrying clock `k` against what the bytes remember.
    fn check_touches(
        &self,
        st: &mut MutexGuard<'_, State>,
        slot: usize,
        k: &VectorClock,
        what: &str,
        touches: &[Touch],
        replay: Option<u64>,
    ) -> Result<()> {
        self.check_awake(st, slot, what, touches)?;
        for t in touches.iter().filter(|t| t.len > 0) {
            let end = t.start.saturating_add(t.len);
            if let Some((at, taker)) =
                replay.and_then(|born| st.graph_reused_in(t.start, end, born))
            {
                // A replay writes what its capture wrote: bytes its pool freed and handed out
                // since belong to another allocation now.
                let report = HazardReport {
                    kind: HazardKind::UseAfterFree,
                    earlier: AccessReport {
                        kind: "graph-reuse",
                        what: taker.what.clone(),
                        start: at,
                        len: end.saturating_sub(at),
                        allocation: Some(taker.what.clone()),
                        stack: None,
                    },
                    later: self.later_access(st, slot, what, t, None),
                    free: None,
                };
                return Err(self.fail(st, slot, report));
            }
            // The allocator's own copy of a block it holds as allocated (a sleep's offload, a
            // wake's restore) covers the whole block: past the bytes asked for, its tail may still
            // carry the record of an earlier allocation freed there (found by the NVTX regions'
            // randomized run under the sanitizer), and a block a thread's front cache keeps is
            // freed for the program but still the shard's (CI's sleep_wake race under
            // CUDALLOC_SANITIZE=panic): neither is a use after free of the allocator's own.
            let own_live = ALLOCATORS_OWN.with(std::cell::Cell::get);
            if let Some((at, free)) = st
                .freed_in(t.start, end)
                .filter(|(_, free)| !(own_live || replay.is_some() && free.graph_held))
            {
                // Work enqueued on memory the allocator holds as free: a use after free,
                // whatever the stream (the block may be handed out to anyone next).
                let report = HazardReport {
                    kind: HazardKind::UseAfterFree,
                    earlier: AccessReport {
                        kind: "free",
                        what: free.what.clone(),
                        start: at,
                        len: end.saturating_sub(at),
                        allocation: None,
                        stack: None,
                    },
                    later: self.later_access(st, slot, what, t, None),
                    free: Some(free.what.clone()),
                };
                return Err(self.fail(st, slot, report));
            }
            // At the allocation, not the segment: a replay's touches are the capture's (its pool's
            // blocks may have been split differently since), and are not checked.
            let own = ALLOCATORS_OWN.with(std::cell::Cell::get);
            let bound = (replay.is_none() && !own).then(|| st.out_of_bounds(t.start, end));
            if let Some((allocation, outside)) = bound.flatten() {
                let began_inside = st.allocation_at(t.start).is_some();
                let report = HazardReport {
                    kind: HazardKind::OutOfBounds,
                    earlier: AccessReport {
                        kind: if began_inside {
                            "allocation end"
                        } else {
                            "allocation start"
                        },
                        what: allocation.clone(),
                        start: t.start,
                        len: outside,
                        allocation: Some(allocation),
                        stack: None,
                    },
                    later: self.later_access(st, slot, what, t, st.allocation_at(t.start)),
                    free: None,
                };
                return Err(self.fail(st, slot, report));
            }
            // Past the bytes asked for, inside the allocator's rounding of them: past the end of
            // the allocation (a raw write 64 bytes past a 16-byte tensor went unseen when the
            // rounded block was the allocation).
            let rounding = (replay.is_none() && !own)
                .then(|| st.in_rounding_of(t.start))
                .flatten();
            if let Some(allocation) = rounding {
                let report = HazardReport {
                    kind: HazardKind::OutOfBounds,
                    earlier: AccessReport {
                        kind: "allocation end",
                        what: allocation.clone(),
                        start: t.start,
                        len: end.saturating_sub(t.start),
                        allocation: Some(allocation),
                        stack: None,
                    },
                    later: self.later_access(st, slot, what, t, None),
                    free: None,
                };
                return Err(self.fail(st, slot, report));
            }
            let unallocated = (replay.is_none() && !own)
                .then(|| st.unallocated(t.start, end))
                .flatten();
            if let Some((segment, len)) = unallocated {
                let report = HazardReport {
                    kind: HazardKind::OutOfBounds,
                    earlier: AccessReport {
                        kind: "never handed out",
                        what: format!(
                            "the allocator's segment at {segment:#x} (its bytes outside every live \
                             allocation)"
                        ),
                        start: t.start,
                        len,
                        allocation: None,
                        stack: None,
                    },
                    later: self.later_access(st, slot, what, t, None),
                    free: None,
                };
                return Err(self.fail(st, slot, report));
            }
            let cow = (t.kind == AccessKind::Write && replay.is_none() && !own)
                .then(|| st.cow_shared_in(t.start, end));
            if let Some(allocation) = cow.flatten() {
                let report = HazardReport {
                    kind: HazardKind::CowWrite,
                    earlier: AccessReport {
                        kind: "lazy clones",
                        what: allocation.clone(),
                        start: t.start,
                        len: t.len,
                        allocation: Some(allocation.clone()),
                        stack: None,
                    },
                    later: self.later_access(st, slot, what, t, Some(allocation)),
                    free: None,
                };
                return Err(self.fail(st, slot, report));
            }
            if let Some(earlier) = st.conflict(t.start, end, slot, k, t.kind) {
                let allocation = st.allocation_at(t.start);
                let later = self.later_access(st, slot, what, t, allocation);
                let report = HazardReport {
                    kind: HazardKind::Race,
                    earlier: AccessReport::of(&earlier),
                    later,
                    free: None,
                };
                return Err(self.fail(st, slot, report));
            }
        }
        Ok(())
    }

    /// The report of access `t` (`what`) by actor `slot`, found to be the later of a hazard.
    fn later_access(
        &self,
        st: &State,
        slot: usize,
        what: &str,
        t: &Touch,
        allocation: Option<String>,
    ) -> AccessReport {
        AccessReport {
            kind: t.kind.name(),
            what: format!("{what} on {}", st.actors[slot].name),
            start: t.start,
            len: t.len,
            allocation,
            stack: self.stack().as_ref().map(|s| s.render_now()),
        }
    }

    /// Moves actor `slot` to clock `k` and records `touches` as its accesses at its new epoch; a
    /// `replay`'s touches of bytes freed into a pool that live graphs hold are the graph's own and
    /// are not recorded (reuse of those bytes is the graph's pool's
    /// affair: a capture sharing the pool follows the replays, and the bytes go back to the
    /// driver, which synchronizes, once the graphs are gone).
    fn commit(
        &self,
        st: &mut MutexGuard<'_, State>,
        slot: usize,
        k: VectorClock,
        what: &str,
        touches: &[Touch],
        replay: bool,
    ) {
        let epoch = k.get(slot);
        st.actors[slot].clock = k;
        self.record_touches(st, slot, epoch, what, touches, replay);
    }

    /// Records `touches` as accesses of actor `slot` at `epoch` (`what` on the actor's name).
    fn record_touches(
        &self,
        st: &mut MutexGuard<'_, State>,
        slot: usize,
        epoch: u64,
        what: &str,
        touches: &[Touch],
        replay: bool,
    ) {
        let stack = touches
            .iter()
            .any(|t| t.len > 0)
            .then(|| self.stack())
            .flatten();
        for t in touches.iter().filter(|t| t.len > 0) {
            let access = Access {
                slot,
                epoch,
                kind: t.kind,
                what: format!("{what} on {}", st.actors[slot].name),
                start: t.start,
                len: t.len.min(u64::MAX - t.start),
                allocation: st.allocation_at(t.start),
                stack: stack.clone(),
                replay,
            };
            st.record(Arc::new(access), replay);
        }
    }

    fn stack(&self) -> Option<Stack> {
        self.stacks.load(Ordering::Relaxed).then(Stack::capture)
    }

    /// Records a hazard: kept, logged, sticky on `slot`'s stream; the error to return (panics in
    /// panic mode, after releasing the lock).
    fn fail(&self, st: &mut MutexGuard<'_, State>, slot: usize, report: HazardReport) -> Error {
        let text = report.to_string();
        let err = Error::StreamRace(text.clone());
        st.hazards += 1;
        if st.reports.len() < MAX_KEPT_REPORTS {
            st.reports.push(report);
        }
        st.actors[slot].sticky = Some(Error::StreamRace(format!(
            "{} failed earlier (sticky, like a CUDA error): {text}",
            st.actors[slot].name
        )));
        tracing::error!(target: "cudalloc::sanitizer", "{text}");
        // Not while unwinding already (a release during a failing test's teardown): a second
        // panic would abort; the report is kept and logged.
        if self.options.panic && !std::thread::panicking() {
            // The guard is released by the unwinding, before the frames that hold the memory
            // (whose drops report frees and take the lock again); the poisoning is ignored.
            panic!("cudalloc sanitizer: {text}");
        }
        err
    }

    /// `event_record(event, stream)`, run by `record` under the lock.
    pub(crate) fn event_record(
        &self,
        event: EventId,
        stream: StreamId,
        record: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut st = self.state.lock();
        let slot = st.sticky(stream)?;
        let k = st.knowledge(slot);
        record()?;
        st.actors[slot].clock = k.clone();
        st.events.insert(event, k);
        Ok(())
    }

    /// `stream_wait_event(stream, event)`, run by `wait` under the lock.
    pub(crate) fn stream_wait_event(
        &self,
        stream: StreamId,
        event: EventId,
        wait: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut st = self.state.lock();
        let slot = st.sticky(stream)?;
        wait()?;
        if let Some(e) = st.events.get(&event).cloned() {
            st.actors[slot].clock.join(&e);
        }
        Ok(())
    }

    /// The host waits for `stream` (`run` is the blocking call): afterwards it knows everything
    /// enqueued there before the call. Returns the stream's sticky hazard, as CUDA would.
    pub(crate) fn host_waits_stream(
        &self,
        stream: StreamId,
        run: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let clock = {
            let mut st = self.state.lock();
            let slot = st.slot(stream);
            st.knowledge(slot)
        };
        run()?;
        let mut st = self.state.lock();
        st.host.join(&clock);
        let slot = st.slot(stream);
        match &st.actors[slot].sticky {
            Some(err) => Err(err.clone()),
            None => Ok(()),
        }
    }

    /// The host waits for `event`'s latest record.
    pub(crate) fn host_waits_event(
        &self,
        event: EventId,
        run: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let clock = self.state.lock().events.get(&event).cloned();
        run()?;
        if let Some(clock) = clock {
            self.state.lock().host.join(&clock);
        }
        Ok(())
    }

    /// Tells the sanitizer that the host waited for `stream` outside cudalloc (for example
    /// cudarc's `CudaStream::synchronize` on a stream cudalloc imported): the host now knows
    /// everything enqueued there so far. Synchronization through the driver needs no such call.
    pub fn host_synchronized(&self, stream: StreamId) {
        let mut st = self.state.lock();
        let slot = st.slot(stream);
        let clock = st.knowledge(slot);
        st.host.join(&clock);
    }

    /// Tells the sanitizer that `waiter` was made to wait for the work queued so far on `waited`
    /// outside cudalloc (an event recorded and waited through cudarc, say).
    pub fn stream_waited(&self, waiter: StreamId, waited: StreamId) {
        let mut st = self.state.lock();
        let (w, d) = (st.slot(waiter), st.slot(waited));
        let clock = st.knowledge(d);
        st.actors[w].clock.join(&clock);
    }

    /// `alias` is another id of the queue `stream` names (one raw stream imported under a second
    /// id): both are one actor.
    pub(crate) fn alias_stream(&self, alias: StreamId, stream: StreamId) {
        let mut st = self.state.lock();
        let slot = st.slot(stream);
        st.streams.insert(alias, slot);
    }

    /// An event is gone: forget its clock.
    pub(crate) fn event_destroyed(&self, event: EventId) {
        let mut st = self.state.lock();
        st.events.remove(&event);
    }
}
