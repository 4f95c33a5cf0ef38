//! The host backend's table of mapped segments: the ones it allocated (owned) and the ones it
//! opened from other processes' handles.
//!
//! Every operation that touches device memory first checks its ranges against this table *while
//! holding the table's read lock*, and enqueues its work before releasing it. Freeing (or closing) a
//! segment takes the write lock to remove it — so no new work can name it — and only then drains
//! every stream and unmaps. Hence a queued operation never touches unmapped memory.
//!
//! | segment state      | in table | mapped | name in /dev/shm         |
//! |--------------------|----------|--------|--------------------------|
//! | owned, live        | yes      | yes    | yes (others may open it) |
//! | owned, being freed | no       | yes    | yes until poisoned       |
//! | freed              | no       | no     | no                       |
//! | opened             | yes      | yes    | owner's business         |
//! | closed             | no       | no     | owner's business         |

use std::collections::{BTreeMap, HashSet};

use crate::driver::vm_space::VmSpace;
use crate::driver::{ranges, DeviceAddr};
use crate::error::{Error, Result};
use crate::shm::vm::{Chunk, Reservation};
use crate::shm::SharedMemory;
use crate::sync::os::{Arc, RwLock, RwLockReadGuard};

/// Identity of an opened foreign segment: (exporting pid, its driver nonce, segment number).
pub(crate) type ForeignKey = (u32, u64, u64);

/// Where a segment came from.
#[derive(Debug)]
pub(crate) enum Origin {
    /// Allocated here by `malloc`; `object` is its number in names and handles.
    Owned { object: u64 },
    /// Opened from another process's handle.
    Opened { key: ForeignKey },
}

/// One mapped segment.
#[derive(Debug)]
pub(crate) struct Segment {
    pub device: usize,
    pub shm: SharedMemory,
    pub origin: Origin,
}

impl Segment {
    fn base(&self) -> u64 {
        self.shm.as_ptr() as u64
    }
}

/// A chunk of the host backend's virtual memory (see `vm.rs`).
#[derive(Debug)]
pub(crate) struct HostChunk {
    pub device: usize,
    pub chunk: Chunk,
    /// Bytes charged to the device's capacity (0 for an imported chunk).
    pub charged: u64,
}

/// Reservations and what is mapped in them.
#[derive(Debug, Default)]
pub(crate) struct VmTables {
    pub space: VmSpace<Arc<HostChunk>>,
    pub reservations: BTreeMap<u64, Arc<Reservation>>,
}

#[derive(Debug, Default)]
struct Tables {
    by_base: BTreeMap<u64, Segment>,
    opened: HashSet<ForeignKey>,
    vm: VmTables,
}

/// All segments mapped by one host driver.
#[derive(Debug, Default)]
pub(crate) struct SegmentTable {
    inner: RwLock<Tables>,
}

/// A read view of the table: ranges checked through it stay mapped while it is held.
pub(crate) struct SegmentsView<'a> {
    tables: RwLockReadGuard<'a, Tables>,
}

impl SegmentsView<'_> {
    /// Checks that `[ptr, ptr + len)` lies inside one segment, or is mapped throughout inside a
    /// reservation; returns the address to access.
    pub(crate) fn check(&self, ptr: DeviceAddr, len: u64) -> Result<usize> {
        // The empty range at the null address (an empty storage's) touches nothing.
        if len == 0 && ptr.0 == 0 {
            return Ok(0);
        }
        if self.tables.vm.space.contains(ptr.0, len) {
            self.tables.vm.space.covered(ptr, len)?;
        } else {
            let (_, segment) = ranges::containing(&self.tables.by_base, |s| s.shm.len(), ptr, len)?;
            // A segment another process truncated is an error for every access enqueued after the
            // cut (its size says so; see `shm/guard.rs`). Work that ran after the cut but was
            // enqueued before touched private pages instead — survived, no signal.
            segment.shm.check_intact()?;
        }
        usize::try_from(ptr.0).map_err(|_| Error::invalid("pointer exceeds the address space"))
    }

    /// Device, number and size of the owned segment based at `ptr`.
    pub(crate) fn owned_at(&self, ptr: DeviceAddr) -> Result<(usize, u64, u64)> {
        match self.tables.by_base.get(&ptr.0) {
            Some(Segment {
                device,
                shm,
                origin: Origin::Owned { object },
            }) => Ok((*device, *object, shm.len())),
            Some(_) => Err(Error::invalid(format!(
                "segment {ptr} was opened from another process; only its owner can export it"
            ))),
            None => Err(Error::invalid(format!(
                "pointer {ptr} is not the base of a segment allocated by this driver \
                 (IPC handles name whole segments)"
            ))),
        }
    }
}

impl SegmentTable {
    /// A read view; hold it from checking ranges until the work is enqueued.
    pub(crate) fn view(&self) -> SegmentsView<'_> {
        SegmentsView {
            tables: self.inner.read(),
        }
    }

    /// Adds a segment; returns its base address.
    pub(crate) fn insert(&self, segment: Segment) -> DeviceAddr {
        let base = segment.base();
        let mut t = self.inner.write();
        if let Origin::Opened { key } = segment.origin {
            t.opened.insert(key);
        }
        t.by_base.insert(base, segment);
        DeviceAddr(base)
    }

    /// Whether a foreign segment is currently open.
    pub(crate) fn is_open(&self, key: &ForeignKey) -> bool {
        self.inner.read().opened.contains(key)
    }

    /// Removes the owned segment based at `ptr` (it stays mapped until the returned value drops).
    pub(crate) fn remove_owned(&self, ptr: DeviceAddr) -> Result<Segment> {
        let mut t = self.inner.write();
        match t.by_base.get(&ptr.0) {
            Some(Segment {
                origin: Origin::Owned { .. },
                ..
            }) => {}
            Some(_) => return Err(ranges::opened_not_owned(ptr)),
            None => return Err(ranges::not_a_segment_base(ptr)),
        }
        t.by_base
            .remove(&ptr.0)
            .ok_or_else(|| Error::invalid("segment vanished"))
    }

    /// Removes the opened segment based at `ptr`.
    pub(crate) fn remove_opened(&self, ptr: DeviceAddr) -> Result<Segment> {
        let mut t = self.inner.write();
        let key = match t.by_base.get(&ptr.0) {
            Some(Segment {
                origin: Origin::Opened { key },
                ..
            }) => *key,
            _ => {
                return Err(Error::invalid(format!(
                    "pointer {ptr} is not the base of a segment opened from an IPC handle"
                )))
            }
        };
        t.opened.remove(&key);
        t.by_base
            .remove(&ptr.0)
            .ok_or_else(|| Error::invalid("segment vanished"))
    }

    /// Runs `f` on the virtual-memory tables with the table's write lock held.
    pub(crate) fn with_vm<R>(&self, f: impl FnOnce(&mut VmTables) -> R) -> R {
        f(&mut self.inner.write().vm)
    }

    /// Removes everything (driver teardown).
    pub(crate) fn drain(&self) -> Vec<Segment> {
        let mut t = self.inner.write();
        t.opened.clear();
        t.vm.space.drain();
        t.vm.reservations.clear();
        std::mem::take(&mut t.by_base).into_values().collect()
    }
}
