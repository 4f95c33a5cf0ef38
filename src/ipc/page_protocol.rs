//! The page protocol: how a consumer asks a producer for the chunks (physical pages) under a shared
//! storage of an expandable segment, and the fixed-layout messages both sides exchange over the
//! producer's page socket (`page_server.rs` decides, `page_connections.rs` serves,
//! `page_mappings.rs` asks).
//!
//! One connection carries one request and its answer, in batches the consumer acknowledges:
//!
//! | step | who      | message                                                               |
//! |------|----------|-----------------------------------------------------------------------|
//! | 1    | consumer | request ([`REQUEST_SIZE`] bytes): the storage's key, its pages and the page secret, as the handle names them |
//! | 2    | producer | checks the peer's user, the request, that the storage is still shared with these pages, the secret, that a count is held on its slot |
//! | 3    | producer | batch *k*: a [`REPLY_SIZE`]-byte header, one [`RECORD_SIZE`]-byte record per page, and the batch's descriptors (`SCM_RIGHTS`), in page order |
//! | 4    | consumer | acknowledgement of batch *k* ([`ACK_SIZE`] bytes), once its descriptors are in its hands; then step 3 for *k* + 1 |
//! | —    | producer | a refusal is one header with a non-zero status, no records and no descriptors |
//!
//! The producer sends batch *k* + 1 only after the acknowledgement of batch *k*: at most one batch
//! (at most [`PageSocketLimits::window_bytes`] of pages) is ever in a peer's receive queue per
//! connection, so a peer that stops reading pins at most that much memory (`page_connections.rs`).
//!
//! Request layout: magic `cdalPRQ2` · slot u32 · generation u32 · page size u64 · first page u64 ·
//! page count u64 · page secret (16 bytes) · ref-counter file name (64 bytes, NUL padded).
//! Answer header: magic `cdalPRP2` · status u32 · batch number u32 · page count u64 · pages in this
//! batch u32 · descriptors in this batch u32. Page record: descriptor index (in this batch) u32 ·
//! zero u32 · byte offset of the page's chunk in that descriptor's file u64 — a batch carries one
//! descriptor per distinct file, so pages whose chunks share a file (the host backend's arenas,
//! `shm/vm.rs`) share a descriptor; CUDA's chunks are one file each, at offset 0.
//! Acknowledgement: magic `cdalPAK1` · batch number u32 · zero u32. Every field is checked on
//! arrival; both sides bound every wait by [`PageSocketLimits::deadline`], and an error that comes
//! from a deadline says "timeout" and names the step.
//!
//! The socket's name follows from the ref-counter file's (`cudalloc-<pid>-<nonce>-ref<n>` →
//! `cudalloc-<pid>-<nonce>-pages0`): one socket per producer allocator, nothing extra on the wire.

use std::time::Duration;

use super::wire::{validate_ref_file_name, WirePages, PAGE_SECRET_SIZE, REF_FILE_TAG};
use crate::codec;
use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicU64, Ordering};

/// The most pages (and descriptors) one answer batch carries (the kernel allows 253 descriptors).
pub(crate) const BATCH: usize = crate::shm::socket::MAX_FDS;
/// Tag of page-socket names.
pub(crate) const SOCKET_TAG: &str = "pages";
/// Bytes of a request.
pub(crate) const REQUEST_SIZE: usize = 120;
/// Bytes of an answer header.
pub(crate) const REPLY_SIZE: usize = 32;
/// Bytes of one page record of an answer batch.
pub(crate) const RECORD_SIZE: usize = 16;
/// Bytes of an acknowledgement.
pub(crate) const ACK_SIZE: usize = 16;
/// The largest answer message: a header and a full batch of records.
pub(crate) const MAX_MESSAGE: usize = REPLY_SIZE + BATCH * RECORD_SIZE;

/// Magic of requests (the first bytes a producer checks).
pub(crate) const REQUEST_MAGIC: [u8; 8] = *b"cdalPRQ2";
const REPLY_MAGIC: [u8; 8] = *b"cdalPRP2";
const ACK_MAGIC: [u8; 8] = *b"cdalPAK1";
const SECRET_AT: usize = 40;
const NAME_AT: usize = SECRET_AT + PAGE_SECRET_SIZE;

/// Limits of the page sockets of this process, as producer and as consumer (process-wide; a
/// producer's serving thread reads them for every connection, a consumer for every open).
///
/// | limit | default | what happens past it |
/// |-------|---------|----------------------|
/// | `deadline` | 5 s | producer: a connection whose peer does not take its next step in time — the whole request after connecting, the acknowledgement of a batch after it was sent — is closed, logged as a timeout; consumer: a connect, a send or a read of an answer batch that waits longer fails with an error that says "timeout" and names the step (the deadline is per read, `SO_RCVTIMEO`: a producer that trickles bytes stretches a batch, bounded by its size × the deadline) |
/// | `max_connections` | 64 | a new connection past it gets a "busy" refusal and is closed at once (never queued) |
/// | `max_connections_per_peer` | 16 | the same, per peer process (`SO_PEERCRED` pid) — and a peer with a connection still lingering (below) is refused until it reads or closes; peers whose pid the producer's pid namespace cannot see all read pid 0 and share this one budget |
/// | `window_bytes` | 64 MiB | bytes of pages in one answer batch (at least one page): what one connection can have in the peer's queue unacknowledged |
/// | `max_unread_bytes` | 1 GiB | bytes of pages sent and not yet read over all connections; a batch that would pass it waits (within its connection's deadline) |
///
/// A connection whose peer stops reading is closed for service at its deadline but *lingers*
/// (its descriptor kept, counted in the limits above) until the peer reads what is queued or
/// closes: the descriptors in its receive queue keep their chunks' memory alive, so what unread
/// peers pin is bounded by `max_unread_bytes` in all, `max_connections_per_peer × window_bytes`
/// per peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PageSocketLimits {
    /// How long the other side may take for its next step (see the table).
    pub deadline: Duration,
    /// Connections served (or lingering) at once by one page socket.
    pub max_connections: u32,
    /// Connections of one peer process at once.
    pub max_connections_per_peer: u32,
    /// Bytes of pages in one batch: unacknowledged bytes per connection.
    pub window_bytes: u64,
    /// Bytes of pages sent and not yet read, over all connections of one page socket.
    pub max_unread_bytes: u64,
}

impl PageSocketLimits {
    /// The defaults (see the table above).
    pub const DEFAULT: PageSocketLimits = PageSocketLimits {
        deadline: Duration::from_secs(5),
        max_connections: 64,
        max_connections_per_peer: 16,
        window_bytes: 64 << 20,
        max_unread_bytes: 1 << 30,
    };

    /// The limits in force in this process.
    pub fn current() -> Self {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PageSocketLimits {
            deadline: Duration::from_millis(get(&LIMITS[0])),
            max_connections: u32::try_from(get(&LIMITS[1])).unwrap_or(u32::MAX),
            max_connections_per_peer: u32::try_from(get(&LIMITS[2])).unwrap_or(u32::MAX),
            window_bytes: get(&LIMITS[3]),
            max_unread_bytes: get(&LIMITS[4]),
        }
    }

    /// Makes these the limits of this process (page sockets already serving apply them to their
    /// next connections). Every limit must be at least 1 (the deadline at least 1 ms).
    pub fn set(self) -> Result<()> {
        let deadline_ms = u64::try_from(self.deadline.as_millis()).unwrap_or(u64::MAX);
        if deadline_ms == 0
            || self.max_connections == 0
            || self.max_connections_per_peer == 0
            || self.window_bytes == 0
            || self.max_unread_bytes == 0
        {
            return Err(Error::invalid(format!(
                "page socket limits must all be at least 1 (the deadline at least 1 ms): {self:?}"
            )));
        }
        let values = [
            deadline_ms,
            u64::from(self.max_connections),
            u64::from(self.max_connections_per_peer),
            self.window_bytes,
            self.max_unread_bytes,
        ];
        for (cell, value) in LIMITS.iter().zip(values) {
            cell.store(value, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Pages of `page` bytes in one batch: as many as the window and the unread budget allow, at
    /// least one, at most [`BATCH`].
    pub(crate) fn pages_per_batch(&self, page: u64) -> u64 {
        let bytes = self.window_bytes.min(self.max_unread_bytes);
        (bytes / page.max(1)).clamp(1, BATCH as u64)
    }
}

impl Default for PageSocketLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The limits, as atomics (fork-safe, no lock): deadline in ms, connections, per peer, window,
/// unread budget.
static LIMITS: [AtomicU64; 5] = {
    let d = PageSocketLimits::DEFAULT;
    [
        AtomicU64::new(d.deadline.as_millis() as u64),
        AtomicU64::new(d.max_connections as u64),
        AtomicU64::new(d.max_connections_per_peer as u64),
        AtomicU64::new(d.window_bytes),
        AtomicU64::new(d.max_unread_bytes),
    ]
};

/// The name of the page socket that serves the storages of ref-counter file `ref_file`.
pub(crate) fn socket_name(ref_file: &str) -> Result<String> {
    validate_ref_file_name(ref_file)?;
    let (stem, _) = ref_file
        .rsplit_once(REF_FILE_TAG)
        .ok_or_else(|| Error::bad_handle("ref-counter file name without its tag"))?;
    Ok(format!("{stem}-{SOCKET_TAG}0"))
}

/// What a consumer asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PageRequest {
    pub ref_file: String,
    pub slot: u32,
    pub generation: u32,
    /// The pages, with the handle's page secret.
    pub pages: WirePages,
}

impl PageRequest {
    pub(crate) fn encode(&self) -> [u8; REQUEST_SIZE] {
        let mut b = [0u8; REQUEST_SIZE];
        codec::put(&mut b, 0, &REQUEST_MAGIC);
        codec::put(&mut b, 8, &self.slot.to_le_bytes());
        codec::put(&mut b, 12, &self.generation.to_le_bytes());
        codec::put(&mut b, 16, &self.pages.page.to_le_bytes());
        codec::put(&mut b, 24, &self.pages.first.to_le_bytes());
        codec::put(&mut b, 32, &self.pages.count.to_le_bytes());
        codec::put(&mut b, SECRET_AT, &self.pages.secret);
        let name = self.ref_file.as_bytes();
        codec::put(
            &mut b,
            NAME_AT,
            &name[..name.len().min(REQUEST_SIZE - NAME_AT)],
        );
        b
    }

    /// Decodes a request (from a process we do not trust).
    pub(crate) fn parse(b: &[u8]) -> Result<Self> {
        if b.len() != REQUEST_SIZE || b[0..8] != REQUEST_MAGIC {
            return Err(Error::bad_handle("not a page request"));
        }
        let raw = &b[NAME_AT..];
        let len = raw.iter().position(|&c| c == 0).unwrap_or(raw.len());
        if raw[len..].iter().any(|&c| c != 0) {
            return Err(Error::bad_handle("page request: name not NUL padded"));
        }
        let ref_file = std::str::from_utf8(&raw[..len])
            .map_err(|_| Error::bad_handle("page request: name is not UTF-8"))?
            .to_owned();
        validate_ref_file_name(&ref_file)?;
        let mut secret = [0u8; PAGE_SECRET_SIZE];
        secret.copy_from_slice(&b[SECRET_AT..NAME_AT]);
        Ok(PageRequest {
            ref_file,
            slot: codec::u32_at(b, 8),
            generation: codec::u32_at(b, 12),
            pages: WirePages {
                page: codec::u64_at(b, 16),
                first: codec::u64_at(b, 24),
                count: codec::u64_at(b, 32),
                secret,
            },
        })
    }
}

/// Why a producer refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Refusal {
    /// The request did not parse.
    Malformed = 1,
    /// No storage with that key is shared (freed, never shared, or a stale generation).
    NotShared = 2,
    /// The storage is shared with other pages than the request names.
    OtherPages = 3,
    /// Exporting a chunk failed in the producer.
    ExportFailed = 4,
    /// The page socket is at one of its connection limits ([`PageSocketLimits`]).
    Busy = 5,
    /// The request does not carry the storage's page secret.
    Unauthorized = 6,
    /// Nobody holds a count on the storage's slot (every handle released or reclaimed).
    NoCount = 7,
}

impl Refusal {
    const ALL: [Refusal; 7] = [
        Refusal::Malformed,
        Refusal::NotShared,
        Refusal::OtherPages,
        Refusal::ExportFailed,
        Refusal::Busy,
        Refusal::Unauthorized,
        Refusal::NoCount,
    ];

    fn from_code(code: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|r| *r as u32 == code)
    }

    fn describe(self) -> &'static str {
        match self {
            Refusal::Malformed => "the producer could not read the request",
            Refusal::NotShared => {
                "the producer no longer shares this storage (freed or stale handle)"
            }
            Refusal::OtherPages => {
                "the producer shares this storage with other pages than the handle names"
            }
            Refusal::ExportFailed => "the producer could not export a chunk",
            Refusal::Busy => {
                "the producer's page socket is at its limit of connections (of all peers, or of \
                 this process, or this process left descriptors unread); retry later"
            }
            Refusal::Unauthorized => {
                "the request does not carry this storage's page secret (only processes given \
                 one of its handles may fetch its pages)"
            }
            Refusal::NoCount => {
                "nobody holds a count on this storage any more (its handles were released or \
                 reclaimed): its pages are not served"
            }
        }
    }

    /// The error a consumer reports for this refusal: a busy socket is worth retrying (a driver
    /// failure), anything else is a handle that cannot be opened.
    fn into_error(self) -> Error {
        let message = format!("opening expandable memory: {}", self.describe());
        match self {
            Refusal::Busy => Error::host_os("page socket", message),
            _ => Error::bad_handle(message),
        }
    }
}

/// An answer header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplyHeader {
    /// `None`: records and descriptors follow.
    pub refusal: Option<Refusal>,
    pub batch: u32,
    /// Pages of the whole answer.
    pub count: u64,
    /// Pages (records) in this batch.
    pub pages: u32,
    /// Descriptors in this batch.
    pub fds: u32,
}

impl ReplyHeader {
    /// The header of a refusal.
    pub(crate) fn refusal(refusal: Refusal, count: u64) -> Self {
        ReplyHeader {
            refusal: Some(refusal),
            batch: 0,
            count,
            pages: 0,
            fds: 0,
        }
    }

    pub(crate) fn encode(&self) -> [u8; REPLY_SIZE] {
        let mut b = [0u8; REPLY_SIZE];
        codec::put(&mut b, 0, &REPLY_MAGIC);
        let status = self.refusal.map_or(0, |r| r as u32);
        codec::put(&mut b, 8, &status.to_le_bytes());
        codec::put(&mut b, 12, &self.batch.to_le_bytes());
        codec::put(&mut b, 16, &self.count.to_le_bytes());
        codec::put(&mut b, 24, &self.pages.to_le_bytes());
        codec::put(&mut b, 28, &self.fds.to_le_bytes());
        b
    }

    /// Decodes header `batch` of an answer for `count` pages of which `done` arrived before; a
    /// refusal is an error that says why.
    pub(crate) fn parse(b: &[u8], batch: u32, count: u64, done: u64) -> Result<Self> {
        if b.len() != REPLY_SIZE || b[0..8] != REPLY_MAGIC {
            return Err(Error::bad_handle("the page socket answered something else"));
        }
        let status = codec::u32_at(b, 8);
        if status != 0 {
            return Err(Refusal::from_code(status).map_or_else(
                || {
                    Error::bad_handle(
                        "opening expandable memory: the producer refused (unknown status)",
                    )
                },
                Refusal::into_error,
            ));
        }
        let header = ReplyHeader {
            refusal: None,
            batch: codec::u32_at(b, 12),
            count: codec::u64_at(b, 16),
            pages: codec::u32_at(b, 24),
            fds: codec::u32_at(b, 28),
        };
        let left = count.saturating_sub(done);
        let pages = u64::from(header.pages);
        let fits = header.batch == batch
            && header.count == count
            && (1..=left.min(BATCH as u64)).contains(&pages)
            && (1..=header.pages).contains(&header.fds);
        if !fits {
            return Err(Error::bad_handle(format!(
                "the page socket's answer is out of order (batch {} of {} pages with {} pages and \
                 {} descriptors; expected batch {batch} of {count} with 1 to {} pages)",
                header.batch,
                header.count,
                header.pages,
                header.fds,
                left.min(BATCH as u64)
            )));
        }
        Ok(header)
    }
}

/// Where one page of a batch is: which of the batch's descriptors, at which byte offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PageRecord {
    pub fd_index: u32,
    pub offset: u64,
}

impl PageRecord {
    pub(crate) fn encode(&self) -> [u8; RECORD_SIZE] {
        let mut b = [0u8; RECORD_SIZE];
        codec::put(&mut b, 0, &self.fd_index.to_le_bytes());
        codec::put(&mut b, 8, &self.offset.to_le_bytes());
        b
    }

    /// Decodes a record of a batch of `fds` descriptors.
    pub(crate) fn parse(b: &[u8], fds: u32) -> Result<Self> {
        if b.len() != RECORD_SIZE || b[4..8].iter().any(|&c| c != 0) {
            return Err(Error::bad_handle(
                "a page record of the answer is malformed",
            ));
        }
        let record = PageRecord {
            fd_index: codec::u32_at(b, 0),
            offset: codec::u64_at(b, 8),
        };
        if record.fd_index >= fds {
            return Err(Error::bad_handle(format!(
                "a page record names descriptor {} of a batch of {fds}",
                record.fd_index
            )));
        }
        Ok(record)
    }
}

/// The message of answer batch `header`: the header, then one record per page.
pub(crate) fn encode_batch(header: &ReplyHeader, records: &[PageRecord]) -> Vec<u8> {
    let mut out = Vec::with_capacity(REPLY_SIZE + records.len() * RECORD_SIZE);
    out.extend_from_slice(&header.encode());
    for record in records {
        out.extend_from_slice(&record.encode());
    }
    out
}

/// The acknowledgement of batch `batch`.
pub(crate) fn encode_ack(batch: u32) -> [u8; ACK_SIZE] {
    let mut b = [0u8; ACK_SIZE];
    codec::put(&mut b, 0, &ACK_MAGIC);
    codec::put(&mut b, 8, &batch.to_le_bytes());
    b
}

/// Decodes an acknowledgement; `None` if it is not one.
pub(crate) fn parse_ack(b: &[u8]) -> Option<u32> {
    (b.len() == ACK_SIZE && b[0..8] == ACK_MAGIC && b[12..16] == [0; 4])
        .then(|| codec::u32_at(b, 8))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn request() -> PageRequest {
        PageRequest {
            ref_file: "cudalloc-77-00000000000000ab-ref3".into(),
            slot: 4,
            generation: 9,
            pages: WirePages {
                page: 2 << 20,
                first: 0x7f00_0000_0000,
                count: 130,
                secret: [0x5a; PAGE_SECRET_SIZE],
            },
        }
    }

    fn header(batch: u32, pages: u32) -> ReplyHeader {
        ReplyHeader {
            refusal: None,
            batch,
            count: 130,
            pages,
            fds: pages,
        }
    }

    #[test]
    fn requests_and_headers_round_trip_and_corruption_is_refused() {
        let r = request();
        assert_eq!(PageRequest::parse(&r.encode()).unwrap(), r);
        let mut bad_name = r.encode();
        bad_name[NAME_AT] = b'/';
        assert!(PageRequest::parse(&bad_name).is_err());
        assert!(PageRequest::parse(&r.encode()[..50]).is_err());
        let h = header(2, 2);
        assert_eq!(ReplyHeader::parse(&h.encode(), 2, 130, 128).unwrap(), h);
        assert!(
            ReplyHeader::parse(&h.encode(), 1, 130, 128).is_err(),
            "order"
        );
        assert!(
            ReplyHeader::parse(&header(2, 3).encode(), 2, 130, 128).is_err(),
            "more pages than are left"
        );
        let no_fds = ReplyHeader { fds: 0, ..h };
        assert!(ReplyHeader::parse(&no_fds.encode(), 2, 130, 128).is_err());
        let refused = ReplyHeader::refusal(Refusal::NotShared, 130);
        let err = ReplyHeader::parse(&refused.encode(), 0, 130, 0).unwrap_err();
        assert!(err.to_string().contains("no longer shares"), "{err}");
        let busy = ReplyHeader::refusal(Refusal::Busy, 130);
        let err = ReplyHeader::parse(&busy.encode(), 0, 130, 0).unwrap_err();
        assert!(err.is_retryable(), "a busy socket is worth retrying: {err}");
    }

    #[test]
    fn records_and_acknowledgements_round_trip() {
        let r = PageRecord {
            fd_index: 3,
            offset: 2 << 20,
        };
        assert_eq!(PageRecord::parse(&r.encode(), 4).unwrap(), r);
        assert!(PageRecord::parse(&r.encode(), 3).is_err(), "no such fd");
        let mut reserved = r.encode();
        reserved[5] = 1;
        assert!(PageRecord::parse(&reserved, 4).is_err());
        assert_eq!(parse_ack(&encode_ack(7)), Some(7));
        assert_eq!(parse_ack(&[0; ACK_SIZE]), None);
        let message = encode_batch(&header(0, 2), &[r, r]);
        assert_eq!(message.len(), REPLY_SIZE + 2 * RECORD_SIZE);
    }

    #[test]
    fn limits_are_validated_and_batches_fit_the_window() {
        let zero = PageSocketLimits {
            max_connections: 0,
            ..PageSocketLimits::DEFAULT
        };
        assert!(zero.set().is_err());
        let small = PageSocketLimits {
            window_bytes: 5 << 20,
            ..PageSocketLimits::DEFAULT
        };
        assert_eq!(small.pages_per_batch(2 << 20), 2);
        assert_eq!(small.pages_per_batch(8 << 20), 1, "at least one page");
        assert_eq!(
            PageSocketLimits::DEFAULT.pages_per_batch(4096),
            BATCH as u64
        );
    }

    #[test]
    fn the_socket_name_follows_from_the_ref_file() {
        assert_eq!(
            socket_name("cudalloc-77-00000000000000ab-ref12").unwrap(),
            "cudalloc-77-00000000000000ab-pages0"
        );
        assert!(socket_name("../cudalloc-77-ref1").is_err());
    }
}
