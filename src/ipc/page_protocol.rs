//! The page protocol: how a consumer asks a producer for the chunks (physical pages) under a shared
//! storage of an expandable segment, and the fixed-layout messages both sides exchange over the
//! producer's page socket (`page_server.rs` serves, `page_mappings.rs` asks).
//!
//! One connection carries one request and its answer:
//!
//! | step | who      | message                                                               |
//! |------|----------|-----------------------------------------------------------------------|
//! | 1    | consumer | request ([`REQUEST_SIZE`] bytes): the storage's key and its pages as the handle names them |
//! | 2    | producer | checks the peer's user, the request, that the storage is still shared with these pages |
//! | 3    | producer | answer batches: a [`REPLY_SIZE`]-byte header + up to [`BATCH`] descriptors each, in page order |
//! | —    | producer | a refusal is one header with a non-zero status and no descriptors     |
//!
//! Request layout: magic `cdalPRQ1` · slot u32 · generation u32 · page size u64 · first page u64 ·
//! page count u64 · ref-counter file name (64 bytes, NUL padded). Reply header: magic `cdalPRP1` ·
//! status u32 · batch number u32 · page count u64 · descriptors in this batch u64. Every field is
//! checked on arrival; both sides time out ([`TIMEOUT`]) rather than wait on a silent peer.
//!
//! The socket's name follows from the ref-counter file's (`cudalloc-<pid>-<nonce>-ref<n>` →
//! `cudalloc-<pid>-<nonce>-pages0`): one socket per producer allocator, nothing extra on the wire.

use std::time::Duration;

use super::wire::{validate_ref_file_name, WirePages, REF_FILE_TAG};
use crate::codec;
use crate::error::{Error, Result};

/// Descriptors per answer message (the kernel allows 253).
pub(crate) const BATCH: usize = crate::shm::socket::MAX_FDS;
/// How long either side waits for the other.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(5);
/// Tag of page-socket names.
pub(crate) const SOCKET_TAG: &str = "pages";
/// Bytes of a request.
pub(crate) const REQUEST_SIZE: usize = 104;
/// Bytes of an answer header.
pub(crate) const REPLY_SIZE: usize = 32;

const REQUEST_MAGIC: [u8; 8] = *b"cdalPRQ1";
const REPLY_MAGIC: [u8; 8] = *b"cdalPRP1";
const NAME_AT: usize = 40;

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
        Ok(PageRequest {
            ref_file,
            slot: codec::u32_at(b, 8),
            generation: codec::u32_at(b, 12),
            pages: WirePages {
                page: codec::u64_at(b, 16),
                first: codec::u64_at(b, 24),
                count: codec::u64_at(b, 32),
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
}

impl Refusal {
    fn from_code(code: u32) -> Option<Self> {
        [
            Refusal::Malformed,
            Refusal::NotShared,
            Refusal::OtherPages,
            Refusal::ExportFailed,
        ]
        .into_iter()
        .find(|r| *r as u32 == code)
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
        }
    }
}

/// An answer header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplyHeader {
    /// `None`: descriptors follow.
    pub refusal: Option<Refusal>,
    pub batch: u32,
    pub count: u64,
    pub in_batch: u64,
}

impl ReplyHeader {
    pub(crate) fn encode(&self) -> [u8; REPLY_SIZE] {
        let mut b = [0u8; REPLY_SIZE];
        codec::put(&mut b, 0, &REPLY_MAGIC);
        let status = self.refusal.map_or(0, |r| r as u32);
        codec::put(&mut b, 8, &status.to_le_bytes());
        codec::put(&mut b, 12, &self.batch.to_le_bytes());
        codec::put(&mut b, 16, &self.count.to_le_bytes());
        codec::put(&mut b, 24, &self.in_batch.to_le_bytes());
        b
    }

    /// Decodes header `batch` of an answer for `count` pages; a refusal is an error that says why.
    pub(crate) fn parse(b: &[u8], batch: u32, count: u64) -> Result<Self> {
        if b.len() != REPLY_SIZE || b[0..8] != REPLY_MAGIC {
            return Err(Error::bad_handle("the page socket answered something else"));
        }
        let status = codec::u32_at(b, 8);
        if status != 0 {
            let why = Refusal::from_code(status)
                .map_or("the producer refused (unknown status)", Refusal::describe);
            return Err(Error::bad_handle(format!(
                "opening expandable memory: {why}"
            )));
        }
        let header = ReplyHeader {
            refusal: None,
            batch: codec::u32_at(b, 12),
            count: codec::u64_at(b, 16),
            in_batch: codec::u64_at(b, 24),
        };
        let expected = count
            .saturating_sub(u64::from(batch) * BATCH as u64)
            .min(BATCH as u64);
        if header.batch != batch || header.count != count || header.in_batch != expected {
            return Err(Error::bad_handle(format!(
                "the page socket's answer is out of order (batch {} of {} pages with {} \
                 descriptors; expected batch {batch} of {count} with {expected})",
                header.batch, header.count, header.in_batch
            )));
        }
        Ok(header)
    }
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
            },
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
        let h = ReplyHeader {
            refusal: None,
            batch: 2,
            count: 130,
            in_batch: 2,
        };
        assert_eq!(ReplyHeader::parse(&h.encode(), 2, 130).unwrap(), h);
        assert!(ReplyHeader::parse(&h.encode(), 1, 130).is_err(), "order");
        let short = ReplyHeader { in_batch: 1, ..h };
        assert!(ReplyHeader::parse(&short.encode(), 2, 130).is_err());
        let refused = ReplyHeader {
            refusal: Some(Refusal::NotShared),
            ..h
        };
        let err = ReplyHeader::parse(&refused.encode(), 2, 130).unwrap_err();
        assert!(err.to_string().contains("no longer shares"), "{err}");
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
