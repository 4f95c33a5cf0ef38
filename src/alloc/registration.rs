//! Registration: the allocator's memory made ready for transfer engines (NIXL, NCCL, UCX), one
//! registration per segment instead of one per tensor.
//!
//! An engine that moves bytes between machines must register memory before it can use it, and
//! registering costs far more than a transfer descriptor: registering each tensor is the known
//! cost. A caching allocator holds few segments and hands out many tensors from each, so it
//! registers each **region** it maps once, with every attached [`Registrar`], and a tensor's
//! transfer descriptor is its region's registration plus an offset
//! ([`Storage::registered_regions`](crate::Storage::registered_regions)).
//!
//! **Regions.** A whole segment is one region. An expandable segment maps pages and unmaps them
//! one by one when it releases memory, so each mapped page is a region of its own: releasing a
//! page deregisters exactly that page and never disturbs a registration a transfer may be using
//! elsewhere in the segment. A storage in an expandable segment may therefore span several
//! regions (one descriptor each). Every region has a [`SegmentId`], unique in the process and
//! never reused, so a registrar's cache keyed by it cannot hit a stale entry when the driver hands
//! out the same address again.
//!
//! | region | enters the registry | registered with each registrar | deregistered, then |
//! |---|---|---|---|
//! | whole segment | after the driver maps it, before any block of it is handed out | at once (or, for a registrar attached later, by its attach) | before the driver frees it: `empty_cache`, the out-of-memory path, garbage collection, a dropped pool, the last free after the allocator's drop |
//! | expandable page | after the page is mapped, before the grown block is handed out | at once (likewise) | before the page is unmapped (page release, the same paths) |
//!
//! **Failure.** A registrar that fails on a new region makes the allocation that needed the
//! region fail with its [`Error::Registration`] (the region is deregistered from the registrars
//! that took it and given back to the driver), unless it was attached with
//! [`OnRegistrationFailure::CountAndSkip`]: then the failure is counted and the region simply is
//! not registered with that registrar (a transfer through it is refused by the engine). Attaching
//! fails the same way on a region already mapped, and then leaves nothing registered. A registrar
//! that panics is caught: a panic in `register` is that registrar's failure (as an error it
//! returned), one in `deregister` is counted in [`RegistrarStats::failures`] and logged, and the
//! region goes as it would have. The allocation, free, `empty_cache`, sleep or wake that called it
//! goes on with its state whole.
//!
//! **Order and locks.** The registry's lock is held across a registrar's calls, so a region is
//! registered with every registrar exactly once and deregistered before its memory goes, whatever
//! the threads do. A registrar runs on the thread that maps or unmaps (a shard's lock may be held,
//! as PyTorch holds its own across `cudaMalloc` unless `release_lock_on_cudamalloc`) and must not
//! allocate or free through the same allocator, nor begin a stream capture. A shard's lock may be
//! held when the registry's is taken, never the other way round, so the two cannot deadlock.
//!
//! **Processes.** Only this allocator's own memory is registered: memory received from another
//! process is that process's to register. In a forked child the parent's segments are never
//! freed, so nothing is deregistered there; attaching in a child is refused.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Bound;
use std::time::Instant;

use crate::driver::{DeviceAddr, StreamId};
use crate::error::{caught, Error, Result};
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::{Arc, Mutex};

/// Region ids come from one process-wide counter: never reused, across allocators too.
static NEXT_SEGMENT_ID: AtomicU64 = AtomicU64::new(1);
/// Registrar ids likewise.
static NEXT_REGISTRAR_ID: AtomicU64 = AtomicU64::new(1);

/// A mapped region's id: unique in the process and never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentId(pub u64);

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "segment #{}", self.0)
    }
}

/// What kind of mapping a region is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegionKind {
    /// A whole segment from the driver's allocation call.
    Segment,
    /// One mapped page of an expandable segment.
    ExpandablePage,
}

/// A region of device memory mapped by the allocator: what a [`Registrar`] registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Region {
    /// Its id, never reused.
    pub id: SegmentId,
    /// The device.
    pub device: usize,
    /// The first byte.
    pub base: DeviceAddr,
    /// Its size in bytes.
    pub size: u64,
    /// A whole segment or an expandable page.
    pub kind: RegionKind,
    /// The stream whose shard owns it.
    pub stream: StreamId,
}

/// Something that registers the allocator's memory with a transfer engine.
///
/// [`register`](Registrar::register) is called once for every region mapped while the registrar
/// is attached (and, at attach, for every region mapped before), and
/// [`deregister`](Registrar::deregister) once for each region it registered, before the region's
/// memory is unmapped or freed, or when the registrar is detached. See the module docs for the
/// threads and locks it runs under.
pub trait Registrar: Send + Sync {
    /// A short name for statistics and errors (`"nixl"`, `"nccl"`).
    fn name(&self) -> &str;

    /// Registers `region`. An error fails the allocation that mapped it (or is counted and
    /// skipped, as attached); build it with [`Error::registration`].
    fn register(&self, region: &Region) -> Result<()>;

    /// Deregisters `region` (registered by this registrar). It cannot fail the unmap that follows:
    /// a failure is the registrar's to log.
    fn deregister(&self, region: &Region);
}

/// What a registrar's failure on a new region does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnRegistrationFailure {
    /// The allocation that mapped the region fails with the registrar's error (the default).
    #[default]
    FailAllocation,
    /// The failure is counted ([`RegistrarStats::failures`]) and the region stays unregistered
    /// with this registrar; the allocation succeeds.
    CountAndSkip,
}

/// An attached registrar's handle, for [`detach_registrar`](crate::Runtime::detach_registrar).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegistrarId(pub u64);

/// One registrar's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegistrarStats {
    /// Its id.
    pub id: RegistrarId,
    /// Its name.
    pub name: String,
    /// Successful registrations, ever.
    pub registrations: u64,
    /// Deregistrations, ever.
    pub deregistrations: u64,
    /// Registrations that failed, ever (each failed an allocation or was skipped, as attached;
    /// a panic in `register` counts as one), and deregistrations that panicked.
    pub failures: u64,
    /// Regions registered now.
    pub registered_regions: u64,
    /// Bytes registered now.
    pub registered_bytes: u64,
    /// Time spent in its `register` calls, in nanoseconds (failed ones included).
    pub registration_ns: u64,
    /// Time spent in its `deregister` calls, in nanoseconds.
    pub deregistration_ns: u64,
}

/// The registration figures of an allocator ([`registration_stats`](crate::Runtime::registration_stats)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegistrationStats {
    /// Regions mapped now (segments and expandable pages), registered or not.
    pub mapped_regions: u64,
    /// Their bytes.
    pub mapped_bytes: u64,
    /// Each attached registrar, in attach order.
    pub registrars: Vec<RegistrarStats>,
}

/// A storage's bytes within one registered region: what a transfer descriptor names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegisteredRegion {
    /// The region (its id is the token its registrations are keyed by).
    pub region: Region,
    /// Where the bytes start, from the region's base.
    pub offset: u64,
    /// How many bytes of the storage lie in this region.
    pub len: u64,
}

impl RegisteredRegion {
    /// The address of the first byte.
    pub fn addr(&self) -> DeviceAddr {
        DeviceAddr(self.region.base.0 + self.offset)
    }
}

struct Attached {
    id: RegistrarId,
    registrar: Arc<dyn Registrar>,
    on_failure: OnRegistrationFailure,
    stats: RegistrarStats,
}

struct Record {
    region: Region,
    /// The registrars that hold a registration of it.
    registered_with: Vec<RegistrarId>,
}

#[derive(Default)]
struct RegistryState {
    /// Every mapped region, by (device, base).
    regions: BTreeMap<(usize, u64), Record>,
    registrars: Vec<Attached>,
}

/// Every region an allocator has mapped, and the registrars attached to it.
#[derive(Default)]
pub(crate) struct Registry {
    state: Mutex<RegistryState>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.state.lock();
        f.debug_struct("Registry")
            .field("regions", &st.regions.len())
            .field("registrars", &st.registrars.len())
            .finish()
    }
}

impl Attached {
    fn register(&mut self, record: &mut Record) -> Result<()> {
        let started = Instant::now();
        let outcome = caught(|| self.registrar.register(&record.region)).unwrap_or_else(|panic| {
            Err(Error::registration(
                &self.stats.name,
                std::io::Error::other(format!("the registrar panicked: {panic}")),
            ))
        });
        self.stats.registration_ns += nanos(started);
        match outcome {
            Ok(()) => {
                self.stats.registrations += 1;
                self.stats.registered_regions += 1;
                self.stats.registered_bytes += record.region.size;
                record.registered_with.push(self.id);
                Ok(())
            }
            Err(err) => {
                self.stats.failures += 1;
                tracing::warn!(registrar = %self.stats.name, region = %record.region.id,
                    base = record.region.base.0, size = record.region.size, %err,
                    "registering a region failed");
                match self.on_failure {
                    OnRegistrationFailure::FailAllocation => Err(err),
                    OnRegistrationFailure::CountAndSkip => Ok(()),
                }
            }
        }
    }

    fn deregister(&mut self, record: &mut Record) {
        let Some(at) = record.registered_with.iter().position(|&r| r == self.id) else {
            return;
        };
        record.registered_with.swap_remove(at);
        let started = Instant::now();
        if let Err(panic) = caught(|| self.registrar.deregister(&record.region)) {
            // The region goes anyway: counted as deregistered, the panic as a failure.
            self.stats.failures += 1;
            tracing::warn!(registrar = %self.stats.name, region = %record.region.id, %panic,
                "deregistering a region panicked");
        }
        self.stats.deregistration_ns += nanos(started);
        self.stats.deregistrations += 1;
        self.stats.registered_regions -= 1;
        self.stats.registered_bytes -= record.region.size;
    }
}

fn nanos(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl RegistryState {
    /// Deregisters `record` from every registrar that holds it (the latest attached first).
    fn deregister_all(&mut self, record: &mut Record) {
        for attached in self.registrars.iter_mut().rev() {
            attached.deregister(record);
        }
    }
}

impl Registry {
    /// Enters freshly mapped regions `(base, size)` of `device` and registers them with every
    /// registrar. On a failure that fails the allocation, nothing of them stays registered or
    /// entered, and the caller gives the memory back.
    pub(super) fn map(
        &self,
        device: usize,
        stream: StreamId,
        kind: RegionKind,
        regions: impl IntoIterator<Item = (u64, u64)>,
    ) -> Result<()> {
        let mut st = self.state.lock();
        let mut entered: Vec<(usize, u64)> = Vec::new();
        for (base, size) in regions {
            let mut record = Record {
                region: Region {
                    id: SegmentId(NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed)),
                    device,
                    base: DeviceAddr(base),
                    size,
                    kind,
                    stream,
                },
                registered_with: Vec::new(),
            };
            let mut failed = None;
            for attached in st.registrars.iter_mut() {
                if let Err(err) = attached.register(&mut record) {
                    failed = Some(err);
                    break;
                }
            }
            if let Some(err) = failed {
                st.deregister_all(&mut record);
                for key in entered {
                    if let Some(mut earlier) = st.regions.remove(&key) {
                        st.deregister_all(&mut earlier);
                    }
                }
                return Err(err);
            }
            st.regions.insert((device, base), record);
            entered.push((device, base));
        }
        Ok(())
    }

    /// The segment at `base` of `device` moved to the shard of `stream` (`cross_stream.rs`):
    /// the memory stays mapped and registered, only its owning stream changes.
    pub(super) fn rehome(&self, device: usize, base: u64, stream: StreamId) {
        if let Some(record) = self.state.lock().regions.get_mut(&(device, base)) {
            record.region.stream = stream;
        }
    }

    /// Deregisters and forgets every region of `device` inside `[base, base + size)`, before the
    /// caller unmaps or frees it.
    pub(super) fn unmap(&self, device: usize, base: u64, size: u64) {
        let mut st = self.state.lock();
        let end = base.saturating_add(size);
        let keys: Vec<(usize, u64)> = st
            .regions
            .range((device, base)..(device, end))
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            if let Some(mut record) = st.regions.remove(&key) {
                st.deregister_all(&mut record);
            }
        }
    }

    /// Attaches `registrar`, registering every region mapped so far (all or nothing when a
    /// failure fails).
    pub(super) fn attach(
        &self,
        registrar: Arc<dyn Registrar>,
        on_failure: OnRegistrationFailure,
    ) -> Result<RegistrarId> {
        let id = RegistrarId(NEXT_REGISTRAR_ID.fetch_add(1, Ordering::Relaxed));
        let mut attached = Attached {
            id,
            stats: RegistrarStats {
                id,
                name: registrar.name().to_owned(),
                registrations: 0,
                deregistrations: 0,
                failures: 0,
                registered_regions: 0,
                registered_bytes: 0,
                registration_ns: 0,
                deregistration_ns: 0,
            },
            registrar,
            on_failure,
        };
        let mut st = self.state.lock();
        let same = |a: &Attached| {
            std::ptr::addr_eq(Arc::as_ptr(&a.registrar), Arc::as_ptr(&attached.registrar))
        };
        if st.registrars.iter().any(same) {
            return Err(Error::invalid(format!(
                "registrar {} is attached already (attached twice it would register every region twice)",
                attached.stats.name
            )));
        }
        let mut failed = None;
        for record in st.regions.values_mut() {
            if let Err(err) = attached.register(record) {
                failed = Some(err);
                break;
            }
        }
        if let Some(err) = failed {
            for record in st.regions.values_mut() {
                attached.deregister(record);
            }
            return Err(err);
        }
        st.registrars.push(attached);
        Ok(id)
    }

    /// Detaches registrar `id`, deregistering every region it holds. False if it is not attached.
    pub(super) fn detach(&self, id: RegistrarId) -> bool {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let Some(at) = st.registrars.iter().position(|a| a.id == id) else {
            return false;
        };
        let mut attached = st.registrars.remove(at);
        for record in st.regions.values_mut() {
            attached.deregister(record);
        }
        true
    }

    /// The figures.
    pub(super) fn stats(&self) -> RegistrationStats {
        let st = self.state.lock();
        RegistrationStats {
            mapped_regions: st.regions.len() as u64,
            mapped_bytes: st.regions.values().map(|r| r.region.size).sum(),
            registrars: st.registrars.iter().map(|a| a.stats.clone()).collect(),
        }
    }

    /// The regions `[addr, addr + len)` of `device` lies in, with its bytes in each, in address
    /// order; an error if any byte is in no mapped region of this allocator.
    pub(super) fn regions_of(
        &self,
        device: usize,
        addr: u64,
        len: u64,
    ) -> Result<Vec<RegisteredRegion>> {
        let end = addr
            .checked_add(len)
            .ok_or_else(|| Error::invalid(format!("bytes at {addr:#x} + {len} overflow")))?;
        let st = self.state.lock();
        let first = st
            .regions
            .range((Bound::Unbounded, Bound::Included((device, addr))))
            .next_back()
            .filter(|((d, _), r)| *d == device && r.region.base.0 + r.region.size > addr);
        let Some((&(_, start), _)) = first else {
            return Err(Error::invalid(format!(
                "address {addr:#x} on device {device} is in no segment this allocator mapped \
                 (memory received from another process is registered by that process)"
            )));
        };
        let mut out = Vec::new();
        let mut at = addr;
        for ((_, base), record) in st
            .regions
            .range((device, start)..(device, end.max(start + 1)))
        {
            if *base > at {
                break;
            }
            let region_end = record.region.base.0 + record.region.size;
            let piece_end = region_end.min(end);
            out.push(RegisteredRegion {
                region: record.region,
                offset: at - base,
                len: piece_end - at,
            });
            at = piece_end;
            if at >= end {
                break;
            }
        }
        if at < end || out.is_empty() {
            return Err(Error::invalid(format!(
                "bytes [{at:#x}, {end:#x}) on device {device} are in no mapped region of this \
                 allocator (a hole between pages)"
            )));
        }
        Ok(out)
    }
}
