//! The host backend's virtual-memory API (expandable segments), made of real memory: reservations
//! are inaccessible mappings, chunks are `memfd`s mapped over them (`shm/vm.rs`), and the
//! bookkeeping is the one both backends share (`driver/vm_space.rs`), kept in the segment table so
//! one read lock checks any range — a segment's or a reservation's — before work is enqueued.
//!
//! | chunk state                 | in the chunk table | mapped | capacity charged | poisoned |
//! |-----------------------------|--------------------|--------|------------------|----------|
//! | created                     | yes                | no     | yes              | —        |
//! | mapped                      | yes                | yes    | yes              | —        |
//! | released while mapped       | no                 | yes    | no               | at its last unmap |
//! | released and unmapped       | no                 | no     | no               | yes (owned chunks, poison-on-free) |
//!
//! Unmapping takes the mappings out of the table first (no new work can name them), drains every
//! stream, and only then makes the pages inaccessible — the rule `segments.rs` follows for frees.

use super::segments::HostChunk;
use super::{kernels, HostDriver};
use crate::driver::{ChunkId, DeviceAddr, ExportedChunk};
use crate::error::{Error, Result};
use crate::shm::vm::{Chunk, Reservation};
use crate::sync::os::atomic::Ordering;
use crate::sync::os::Arc;

/// Granularity of the host backend's virtual memory: CUDA's on current GPUs.
pub(crate) const GRANULARITY: u64 = 2 << 20;

fn check_granular(what: &str, size: u64) -> Result<()> {
    if size == 0 || !size.is_multiple_of(GRANULARITY) {
        return Err(Error::invalid(format!(
            "{what} of {size} bytes: a positive multiple of the granularity ({GRANULARITY} bytes)"
        )));
    }
    Ok(())
}

impl HostDriver {
    fn chunk(&self, chunk: ChunkId) -> Result<Arc<HostChunk>> {
        self.chunks.get(chunk.0)
    }

    /// Poisons an owned chunk nobody maps or holds any more (poison-on-free).
    fn retire(&self, chunk: Arc<HostChunk>) {
        if !self.config.poison_on_free || chunk.charged == 0 {
            return;
        }
        if let Some(last) = Arc::into_inner(chunk) {
            let poisoned = last.chunk.with_mapping(|addr, len| {
                // SAFETY: `addr` is a fresh private view of the chunk's `len` bytes, mapped for the
                // duration of this call; nothing in this process maps the chunk any more.
                unsafe { kernels::poison(addr, len) }
            });
            if let Err(err) = poisoned {
                tracing::debug!(%err, "poisoning a released chunk failed");
            }
        }
    }

    /// A new chunk id for `chunk` (`charged`: bytes counted against capacity, 0 if imported).
    fn register_chunk(&self, device: usize, chunk: Chunk, charged: u64) -> ChunkId {
        let id = self.fresh_id();
        self.chunks.insert(
            id,
            Arc::new(HostChunk {
                device,
                chunk,
                charged,
            }),
        );
        ChunkId(id)
    }

    pub(super) fn granularity(&self, device: usize) -> Result<u64> {
        self.check_device(device)?;
        Ok(GRANULARITY)
    }

    pub(super) fn reserve(&self, device: usize, size: u64) -> Result<DeviceAddr> {
        self.captures.check_unsafe("vm_reserve")?;
        self.check_device(device)?;
        check_granular("a reservation", size)?;
        let reservation = Arc::new(Reservation::new(size)?);
        let base = reservation.base();
        self.segments.with_vm(|vm| {
            vm.space.insert(base, device, size);
            vm.reservations.insert(base, reservation);
        });
        Ok(DeviceAddr(base))
    }

    pub(super) fn free_reservation(&self, base: DeviceAddr) -> Result<()> {
        self.captures.check_unsafe("vm_free_reservation")?;
        self.segments.with_vm(|vm| {
            vm.space.remove(base.0)?;
            vm.reservations.remove(&base.0);
            Ok(())
        })
    }

    pub(super) fn create_chunk(&self, device: usize, size: u64) -> Result<ChunkId> {
        self.captures.check_unsafe("vm_create_chunk")?;
        self.check_device(device)?;
        check_granular("a chunk", size)?;
        let total = self.config.memory_per_device;
        let used = &self.used[device];
        let oom = |message: String| Error::OutOfMemory {
            device,
            requested: size,
            message,
        };
        used.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
            u.checked_add(size).filter(|&n| n <= total)
        })
        .map_err(|u| {
            oom(format!(
                "a chunk of {size} bytes; capacity {total}, in use {u}"
            ))
        })?;
        let chunk = Chunk::create(size).map_err(|err| {
            used.fetch_sub(size, Ordering::SeqCst);
            if crate::shm::is_no_space(&err) || crate::shm::vm::is_out_of_descriptors(&err) {
                oom(err.to_string())
            } else {
                err
            }
        })?;
        Ok(self.register_chunk(device, chunk, size))
    }

    pub(super) fn release_chunk(&self, chunk: ChunkId) -> Result<()> {
        self.captures.check_unsafe("vm_release_chunk")?;
        let chunk = self.chunks.remove(chunk.0)?;
        self.used[chunk.device].fetch_sub(chunk.charged, Ordering::SeqCst);
        self.retire(chunk);
        Ok(())
    }

    pub(super) fn map(&self, addr: DeviceAddr, chunk: ChunkId) -> Result<()> {
        self.captures.check_unsafe("vm_map")?;
        let chunk = self.chunk(chunk)?;
        let len = chunk.chunk.len();
        self.segments.with_vm(|vm| {
            let device = vm.space.check_map(addr.0, len, GRANULARITY)?;
            if device != chunk.device {
                return Err(Error::invalid(format!(
                    "a chunk of device {} cannot be mapped into a reservation of device {device}",
                    chunk.device
                )));
            }
            let (&base, reservation) = vm
                .reservations
                .range(..=addr.0)
                .next_back()
                .ok_or_else(|| Error::invalid("reservation vanished"))?;
            reservation.map(addr.0 - base, &chunk.chunk)?;
            vm.space.insert_mapping(addr.0, len, Arc::clone(&chunk))
        })
    }

    pub(super) fn unmap(&self, addr: DeviceAddr, size: u64) -> Result<()> {
        self.captures.check_unsafe("vm_unmap")?;
        let (taken, reservation) = self.segments.with_vm(|vm| {
            let taken = vm.space.take_mappings(addr.0, size)?;
            let reservation = vm
                .reservations
                .range(..=addr.0)
                .next_back()
                .map(|(&base, r)| (base, Arc::clone(r)))
                .ok_or_else(|| Error::invalid("reservation vanished"))?;
            Ok::<_, Error>((taken, reservation))
        })?;
        // Nothing new can name the range; let what was queued on it finish first.
        let drained = self.synchronize_all();
        let (base, reservation) = reservation;
        let unmapped = reservation.unmap(addr.0 - base, size);
        self.segments
            .with_vm(|vm| vm.space.finish_unmap(addr.0, size));
        for (_, _, chunk) in taken {
            self.retire(chunk);
        }
        drained.and(unmapped)
    }

    pub(super) fn export_chunk(&self, chunk: ChunkId) -> Result<ExportedChunk> {
        let chunk = self.chunk(chunk)?;
        if chunk.charged == 0 {
            return Err(Error::invalid(
                "a chunk imported from another process cannot be exported again",
            ));
        }
        let (fd, offset) = chunk.chunk.export()?;
        Ok(ExportedChunk { fd, offset })
    }

    pub(super) fn import_chunk(
        &self,
        device: usize,
        exported: ExportedChunk,
        size: u64,
    ) -> Result<ChunkId> {
        self.check_device(device)?;
        check_granular("an imported chunk", size)?;
        if !exported.offset.is_multiple_of(GRANULARITY) {
            return Err(Error::bad_handle(format!(
                "an imported chunk at offset {} is not aligned to the granularity ({GRANULARITY} bytes)",
                exported.offset
            )));
        }
        let chunk = Chunk::import(exported.fd, exported.offset, size)?;
        Ok(self.register_chunk(device, chunk, 0))
    }
}
