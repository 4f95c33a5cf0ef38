//! Consumer side of sharing expandable memory: fetching the chunks under a received storage from the
//! producer's page socket and mapping them — only those pages, into a reservation of their size —
//! with a cache so storages on the same pages share one mapping.
//!
//! A received storage of an expandable segment names its pages (`WirePages`: page size, first page
//! in the producer, count). Opening it maps exactly those pages here, contiguous, and the storage is
//! at `offset` in them: a consumer of 1,000 storages of 1 MiB from one 4 GiB segment reserves the
//! pages under them, never the producer's whole range (PyTorch's expandable-segment sharing
//! reserves the whole segment per import and pulls descriptors with `pidfd_getfd`).
//!
//! **Cache.** Mappings are shared per (driver, producer socket, device, page size, first page,
//! count) — the *exact* span, not any span that contains it. Why exact is safe: a span's pages are
//! the pages under its first storage's block, so every user's block touches every page of the
//! span; a user holds its count (`pending` while opening, its lease after) until after it leaves the
//! span (its mapping drops before its lease, `consumer.rs`); a page touched by an allocated block is
//! never unmapped by the producer. So from a span's creation until its last user leaves, every one
//! of its pages stays mapped in the producer with the same chunk, and a storage joining it sees the
//! same memory. A span merely *containing* the new storage's pages would not have that guarantee:
//! pages outside the remaining users' blocks may have been unmapped and remapped with new chunks.
//!
//! | span users | opening a storage on the same pages  | last user dropped                        |
//! |------------|--------------------------------------|------------------------------------------|
//! | none       | fetch, reserve, import + map each page, release the chunk handles | —        |
//! | n ≥ 1      | joins (n + 1)                         | unmap (after queued work), free the reservation |
//!
//! The cache key leaves out the handle's page secret: two storages on the same pages have
//! different secrets but one mapping.
//!
//! **Fetching.** One connection to the producer's page socket per fetch: the request (with the
//! handle's page secret), then per batch the header, its page records and descriptors, each page
//! imported and mapped, then the acknowledgement that lets the producer send the next batch
//! (`page_protocol.rs`). Every step is bounded by [`PageSocketLimits::deadline`]; a step that runs
//! past it fails with an error that says "timeout" and names the step and the producer. A
//! connection refused as busy is a retryable error. Any error drops the connection, and with it
//! whatever descriptors were still queued for us.

use std::collections::HashMap;

use super::page_protocol::{
    self, PageRecord, PageRequest, PageSocketLimits, ReplyHeader, BATCH, MAX_MESSAGE, RECORD_SIZE,
    REPLY_SIZE,
};
use super::wire::{WireHandle, WirePages};
use crate::driver::{DeviceAddr, Driver, ExportedChunk};
use crate::error::{Error, Result};
use crate::process::PerProcess;
use crate::shm::socket;
use crate::sync::os::{Arc, Mutex};

/// A driver's identity in the mapping tables, of pages here and of whole segments
/// (`consumer.rs`): its address, stable while a mapping holds the driver.
pub(super) fn driver_key(driver: &Arc<dyn Driver>) -> usize {
    Arc::as_ptr(driver) as *const () as usize
}

/// The pages of a span without the secret: (page size, first page, count).
type SpanPages = (u64, u64, u64);

/// (driver address, page socket name, device, pages).
type SpanKey = (usize, String, usize, SpanPages);

fn span_pages(pages: &WirePages) -> SpanPages {
    (pages.page, pages.first, pages.count)
}

#[derive(Debug)]
struct SpanEntry {
    base: DeviceAddr,
    users: u64,
}

/// Page spans of other processes mapped in this process.
static SPANS: PerProcess<Mutex<Option<HashMap<SpanKey, SpanEntry>>>> =
    PerProcess::new(|| Mutex::new(None));

/// One user of a mapped page span; the span is unmapped when the last user drops.
#[derive(Debug)]
pub(crate) struct PageMapping {
    driver: Arc<dyn Driver>,
    key: SpanKey,
    /// Where the first page is mapped here.
    pub base: DeviceAddr,
}

impl PageMapping {
    /// Maps the pages `wire` names on `device` (or joins the mapping of the same pages).
    pub(super) fn open(
        driver: &Arc<dyn Driver>,
        wire: &WireHandle,
        pages: WirePages,
        device: usize,
    ) -> Result<PageMapping> {
        let socket_name = page_protocol::socket_name(&wire.ref_file)?;
        let key = (driver_key(driver), socket_name, device, span_pages(&pages));
        if let Some(joined) = Self::join(driver, &key) {
            return Ok(joined);
        }
        // Fetch and map without the table's lock (a slow producer must not stall other opens);
        // if another thread mapped the same span meanwhile, join it and drop ours.
        let base = fetch_and_map(driver.as_ref(), wire, &key.1, pages, device)?;
        let size = pages.count * pages.page;
        let mut table = SPANS.lock();
        let spans = table.get_or_insert_with(HashMap::new);
        if let Some(entry) = spans.get_mut(&key) {
            entry.users += 1;
            let joined = entry.base;
            drop(table);
            unmap(driver.as_ref(), base, size);
            return Ok(PageMapping {
                driver: Arc::clone(driver),
                key,
                base: joined,
            });
        }
        spans.insert(key.clone(), SpanEntry { base, users: 1 });
        Ok(PageMapping {
            driver: Arc::clone(driver),
            key,
            base,
        })
    }

    fn join(driver: &Arc<dyn Driver>, key: &SpanKey) -> Option<PageMapping> {
        let mut table = SPANS.lock();
        let entry = table.as_mut()?.get_mut(key)?;
        entry.users += 1;
        Some(PageMapping {
            driver: Arc::clone(driver),
            key: key.clone(),
            base: entry.base,
        })
    }

    /// Page spans mapped through `driver` now, and their bytes of address space.
    pub(super) fn mapped(driver: &Arc<dyn Driver>) -> (usize, u64) {
        let key = driver_key(driver);
        SPANS.lock().as_ref().map_or((0, 0), |spans| {
            spans
                .keys()
                .filter(|k| k.0 == key)
                .fold((0, 0), |(n, bytes), k| (n + 1, bytes + k.3 .2 * k.3 .0))
        })
    }
}

impl Drop for PageMapping {
    fn drop(&mut self) {
        let mut table = SPANS.lock();
        let Some(entry) = table.as_mut().and_then(|spans| spans.get_mut(&self.key)) else {
            return;
        };
        entry.users = entry.users.saturating_sub(1);
        if entry.users > 0 {
            return;
        }
        if let Some(spans) = table.as_mut() {
            spans.remove(&self.key);
        }
        drop(table);
        let (page, _, count) = self.key.3;
        unmap(self.driver.as_ref(), self.base, count * page);
    }
}

/// Unmaps a span and frees its reservation (errors are logged: nothing else can be done at drop).
fn unmap(driver: &dyn Driver, base: DeviceAddr, size: u64) {
    let done = driver
        .vm()
        .vm_unmap(base, size)
        .and_then(|()| driver.vm().vm_free_reservation(base));
    if let Err(err) = done {
        tracing::warn!(%err, "unmapping another process's pages failed");
    }
}

/// A reservation with the pages mapped so far; dropped before completion, it unmaps them and frees
/// the reservation.
struct PartialSpan<'a> {
    driver: &'a dyn Driver,
    base: DeviceAddr,
    page: u64,
    mapped: u64,
    done: bool,
}

impl Drop for PartialSpan<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let unmapped = if self.mapped > 0 {
            self.driver
                .vm()
                .vm_unmap(self.base, self.mapped * self.page)
        } else {
            Ok(())
        };
        if let Err(err) = unmapped.and_then(|()| self.driver.vm().vm_free_reservation(self.base)) {
            tracing::warn!(%err, "undoing a partial page mapping failed");
        }
    }
}

/// Asks the producer for the chunks of `pages`, reserves their size here and maps each one.
fn fetch_and_map(
    driver: &dyn Driver,
    wire: &WireHandle,
    socket_name: &str,
    pages: WirePages,
    device: usize,
) -> Result<DeviceAddr> {
    let granularity = driver.vm().vm_granularity(device)?;
    if granularity == 0 || !pages.page.is_multiple_of(granularity) {
        return Err(Error::bad_handle(format!(
            "the producer's pages of {} bytes are not a multiple of this device's granularity \
             ({granularity} bytes)",
            pages.page
        )));
    }
    let size = pages
        .count
        .checked_mul(pages.page)
        .ok_or_else(|| Error::bad_handle("page span overflows"))?;
    let pid = wire.producer_pid;
    let limits = PageSocketLimits::current();
    let stream = socket::TimedStream::connect(
        socket_name,
        limits.deadline,
        format!("the page socket of process {pid}"),
    )?;
    let request = PageRequest {
        ref_file: wire.ref_file.clone(),
        slot: wire.slot,
        generation: wire.generation,
        pages,
    };
    stream.write_all(&request.encode(), "sending the page request")?;
    let mut span = PartialSpan {
        driver,
        base: driver.vm().vm_reserve(device, size)?,
        page: pages.page,
        mapped: 0,
        done: false,
    };
    let mut message = vec![0u8; MAX_MESSAGE];
    let mut batch = 0u32;
    while span.mapped < pages.count {
        let waiting = format!("waiting for batch {batch} of the answer");
        let (mut len, fds) = stream.recv_fds(&mut message, BATCH, &waiting)?;
        if len == 0 {
            return Err(Error::host_os(
                "recvmsg",
                format!(
                    "the page socket of process {pid} closed the connection before batch {batch} \
                     (the producer stopped, or closed it at its deadline)"
                ),
            ));
        }
        if len < REPLY_SIZE {
            stream.read_exact(&mut message[len..REPLY_SIZE], &waiting)?;
            len = REPLY_SIZE;
        }
        let header = ReplyHeader::parse(&message[..REPLY_SIZE], batch, pages.count, span.mapped)?;
        let whole = REPLY_SIZE + header.pages as usize * RECORD_SIZE;
        if len > whole {
            return Err(Error::bad_handle(format!(
                "the page socket sent {len} bytes for a batch of {whole}"
            )));
        }
        stream.read_exact(&mut message[len..whole], &waiting)?;
        if fds.len() != header.fds as usize {
            return Err(Error::bad_handle(format!(
                "the page socket announced {} descriptors and sent {}",
                header.fds,
                fds.len()
            )));
        }
        // Each page: a chunk at an offset of one of the batch's descriptors (chunks of one file
        // share its descriptor).
        for raw in message[REPLY_SIZE..whole].chunks(RECORD_SIZE) {
            let record = PageRecord::parse(raw, header.fds)?;
            let file = fds
                .get(record.fd_index as usize)
                .ok_or_else(|| Error::bad_handle("a page record names a missing descriptor"))?
                .try_clone()
                .map_err(|e| Error::host_os("dup", e))?;
            let exported = ExportedChunk {
                fd: file,
                offset: record.offset,
            };
            let chunk = driver.vm().vm_import_chunk(device, exported, pages.page)?;
            let at = DeviceAddr(span.base.0 + span.mapped * pages.page);
            let mapped = driver.vm().vm_map(at, chunk);
            // The mapping keeps the memory; the imported handle is not needed any more.
            let released = driver.vm().vm_release_chunk(chunk);
            mapped?;
            span.mapped += 1;
            released?;
        }
        drop(fds);
        let acknowledging = format!("acknowledging batch {batch}");
        let acked = stream.write_all(&page_protocol::encode_ack(batch), &acknowledging);
        match acked {
            // The last acknowledgement only tells the producer it may close: every page is here.
            Err(err) if span.mapped == pages.count => {
                tracing::debug!(%err, "the last page acknowledgement was not taken");
            }
            other => other?,
        }
        batch = batch
            .checked_add(1)
            .ok_or_else(|| Error::bad_handle("too many batches"))?;
    }
    span.done = true;
    Ok(span.base)
}
