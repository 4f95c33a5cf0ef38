//! The IPC handle's wire format: a versioned, fixed-layout byte encoding.
//!
//! | bytes     | field                                                     |
//! |-----------|-----------------------------------------------------------|
//! | 0..8      | magic `cdalIPC1`                                          |
//! | 8..10     | layout version (2), little endian                         |
//! | 10        | backend: 1 host, 2 cuda, 3 simulated (which cannot share: only empty handles) |
//! | 11        | flags: bit 0 = carries an event, bit 1 = empty storage, bit 2 = expandable pages |
//! | 12..16    | device ordinal                                            |
//! | 16..20    | producer pid                                              |
//! | 20..24    | slot in the ref-counter file                              |
//! | 24..88    | the segment's 64-byte memory handle; with bit 2: the pages (below) |
//! | 88..96    | segment size                                              |
//! | 96..104   | byte offset of the storage in the segment                 |
//! | 104..112  | storage size in bytes                                     |
//! | 112..176  | ref-counter file name, NUL padded                         |
//! | 176..240  | event handle (zero without an event)                      |
//! | 240..244  | the slot's generation (a handle of an older storage in a reused slot is stale) |
//! | 244..248  | zero                                                      |
//! | 248..256  | expiry, unix time in ms (0: no time-to-live)              |
//! | 256..264  | checksum of bytes 0..256                                  |
//!
//! Memory of an expandable segment is not one driver allocation but pages (chunks of physical
//! memory), so bytes 24..88 name the pages under the storage instead: magic `cdalPGS1`, page size,
//! address of the first page in the producer, page count, the storage's page secret (16 bytes,
//! never zero), then zero. The segment is those pages (`segment size = count × page`, `offset` from
//! the first page); the consumer fetches their descriptors from the producer's page socket
//! (`page_server.rs`), which serves them only to a request that carries the secret: it is in no
//! file, only in the producer's memory and in the handles of the storage.
//!
//! [`WireHandle::parse`] trusts nothing and never panics: every field is checked (magic,
//! version, backend, flags, pid, name pattern, `offset + nbytes <= segment size` without overflow,
//! zero padding, checksum). What the bytes *name* (the file, the slot) is checked when the handle is
//! opened (`refcount.rs`).

use crate::codec;
use crate::driver::{Backend, IPC_HANDLE_SIZE};
use crate::error::{Error, Result};
use crate::shm;

/// Encoded size of a handle.
pub const WIRE_SIZE: usize = 264;
const MAGIC: [u8; 8] = *b"cdalIPC1";
const VERSION: u16 = 2;
const SUMMED: usize = 256;
const PAGES_MAGIC: [u8; 8] = *b"cdalPGS1";
/// Largest page size a handle may name (1 GiB): larger is no driver's granularity.
const MAX_PAGE: u64 = 1 << 30;
/// Smallest page size a handle may name (4 KiB).
const MIN_PAGE: u64 = 4096;
const NAME_BYTES: usize = 64;
/// Suffix pattern of ref-counter file names: `cudalloc-<pid>-<nonce>-ref<n>`.
pub(crate) use crate::shm::REF_FILE_TAG;

/// The decoded fields of a handle (pure data; owning nothing). Not public: a handle travels as
/// [`IpcHandle::into_bytes`](super::IpcHandle::into_bytes) and is rebuilt by
/// [`IpcHandle::from_bytes`](super::IpcHandle::from_bytes) (the one door, which validates), in
/// whatever format carries bytes (serde included).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WireHandle {
    /// Backend of the producer.
    pub backend: Backend,
    /// Device ordinal.
    pub device: u32,
    /// Producer process id.
    pub producer_pid: u32,
    /// Slot in the ref-counter file.
    pub slot: u32,
    /// The whole segment's memory handle.
    pub memory: [u8; IPC_HANDLE_SIZE],
    /// Size of the whole segment.
    pub segment_size: u64,
    /// Offset of the storage in the segment.
    pub offset: u64,
    /// Size of the storage.
    pub nbytes: u64,
    /// Name of the ref-counter file in `/dev/shm`.
    pub ref_file: String,
    /// The producer's interprocess event, if the handle carries one.
    pub event: Option<[u8; IPC_HANDLE_SIZE]>,
    /// Generation of the slot when the handle was made: a handle whose storage was freed and whose
    /// slot now serves another storage is stale and refused.
    pub generation: u32,
    /// Unix time (ms) after which the handle is refused and its count reclaimed (0: never).
    pub expires_ms: u64,
    /// For memory of an expandable segment: the pages under the storage (`memory` is then zero).
    pub pages: Option<WirePages>,
}

/// Bytes of a storage's page secret.
pub const PAGE_SECRET_SIZE: usize = 16;

/// The pages of a producer's expandable segment under a shared storage.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WirePages {
    /// Bytes per page (a power of two, 4 KiB to 1 GiB).
    pub page: u64,
    /// Address of the first page in the producer's address space (a multiple of `page`).
    pub first: u64,
    /// Number of pages (at least one); `count × page` is the handle's segment size.
    pub count: u64,
    /// The storage's page secret (random, never all zero): the producer's page socket serves the
    /// pages only to a request that carries it — only processes given a handle know it.
    pub secret: [u8; PAGE_SECRET_SIZE],
}

impl std::fmt::Debug for WirePages {
    /// Everything but the secret (handles end up in logs).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WirePages")
            .field("page", &self.page)
            .field("first", &self.first)
            .field("count", &self.count)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl WirePages {
    fn encode(&self) -> [u8; IPC_HANDLE_SIZE] {
        let mut b = [0u8; IPC_HANDLE_SIZE];
        codec::put(&mut b, 0, &PAGES_MAGIC);
        codec::put(&mut b, 8, &self.page.to_le_bytes());
        codec::put(&mut b, 16, &self.first.to_le_bytes());
        codec::put(&mut b, 24, &self.count.to_le_bytes());
        codec::put(&mut b, 32, &self.secret);
        b
    }

    /// Decodes and checks the pages of a handle whose segment has `segment_size` bytes.
    fn parse(b: &[u8], segment_size: u64) -> Result<Self> {
        if b.len() != IPC_HANDLE_SIZE || b[0..8] != PAGES_MAGIC {
            return Err(bad("expandable handle without its page description"));
        }
        let secret_end = 32 + PAGE_SECRET_SIZE;
        if b[secret_end..].iter().any(|&c| c != 0) {
            return Err(bad("reserved page-description bytes are not zero"));
        }
        let mut secret = [0u8; PAGE_SECRET_SIZE];
        secret.copy_from_slice(&b[32..secret_end]);
        if secret == [0; PAGE_SECRET_SIZE] {
            return Err(bad(
                "expandable handle without its page secret (made by an older cudalloc?)",
            ));
        }
        let pages = WirePages {
            page: codec::u64_at(b, 8),
            first: codec::u64_at(b, 16),
            count: codec::u64_at(b, 24),
            secret,
        };
        if !pages.page.is_power_of_two() || !(MIN_PAGE..=MAX_PAGE).contains(&pages.page) {
            return Err(bad(format!(
                "page size {} is not a power of two from {MIN_PAGE} to {MAX_PAGE}",
                pages.page
            )));
        }
        if !pages.first.is_multiple_of(pages.page) || pages.first == 0 {
            return Err(bad(format!(
                "first page {:#x} is not a page address",
                pages.first
            )));
        }
        let bytes = pages.count.checked_mul(pages.page);
        if pages.count == 0
            || bytes != Some(segment_size)
            || pages.first.checked_add(segment_size).is_none()
        {
            return Err(bad(format!(
                "{} pages of {} bytes at {:#x} do not make the handle's {segment_size}-byte segment",
                pages.count, pages.page, pages.first
            )));
        }
        Ok(pages)
    }
}

/// Seed of the wire handle's checksum.
const CHECKSUM_SEED: u64 = 0x4950_4331;

fn checksum(bytes: &[u8]) -> u64 {
    codec::checksum(CHECKSUM_SEED, bytes)
}

fn bad(what: impl std::fmt::Display) -> Error {
    Error::bad_handle(what)
}

/// Checks that `name` is a ref-counter file name of ours.
pub(crate) fn validate_ref_file_name(name: &str) -> Result<()> {
    shm::validate_name(name)?;
    let digits = name.rsplit_once(REF_FILE_TAG).map(|(_, n)| n).unwrap_or("");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad(format!(
            "{name:?} is not a cudalloc ref-counter file name"
        )));
    }
    Ok(())
}

impl WireHandle {
    /// A handle of an empty storage (no memory, no slot).
    pub fn empty(backend: Backend, device: u32, producer_pid: u32) -> Self {
        WireHandle {
            backend,
            device,
            producer_pid,
            slot: 0,
            memory: [0; IPC_HANDLE_SIZE],
            segment_size: 0,
            offset: 0,
            nbytes: 0,
            ref_file: String::new(),
            event: None,
            generation: 0,
            expires_ms: 0,
            pages: None,
        }
    }

    /// Whether this is the handle of an empty storage.
    pub fn is_empty(&self) -> bool {
        self.ref_file.is_empty() && self.nbytes == 0
    }

    /// Encodes the handle (`WIRE_SIZE` bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; WIRE_SIZE];
        codec::put(&mut b, 0, &MAGIC);
        codec::put(&mut b, 8, &VERSION.to_le_bytes());
        b[10] = match self.backend {
            Backend::Host => 1,
            Backend::Cuda => 2,
            Backend::Simulated => 3,
        };
        b[11] = u8::from(self.event.is_some())
            | (u8::from(self.is_empty()) << 1)
            | (u8::from(self.pages.is_some()) << 2);
        codec::put(&mut b, 12, &self.device.to_le_bytes());
        codec::put(&mut b, 16, &self.producer_pid.to_le_bytes());
        codec::put(&mut b, 20, &self.slot.to_le_bytes());
        match &self.pages {
            Some(pages) => codec::put(&mut b, 24, &pages.encode()),
            None => codec::put(&mut b, 24, &self.memory),
        }
        codec::put(&mut b, 88, &self.segment_size.to_le_bytes());
        codec::put(&mut b, 96, &self.offset.to_le_bytes());
        codec::put(&mut b, 104, &self.nbytes.to_le_bytes());
        let name = self.ref_file.as_bytes();
        let n = name.len().min(NAME_BYTES);
        codec::put(&mut b, 112, &name[..n]);
        if let Some(event) = &self.event {
            codec::put(&mut b, 176, event);
        }
        codec::put(&mut b, 240, &self.generation.to_le_bytes());
        codec::put(&mut b, 248, &self.expires_ms.to_le_bytes());
        let sum = checksum(&b[0..SUMMED]);
        codec::put(&mut b, SUMMED, &sum.to_le_bytes());
        b
    }

    /// Decodes and validates `bytes` (see the module docs). Never panics.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != WIRE_SIZE {
            return Err(bad(format!(
                "a handle has {WIRE_SIZE} bytes, got {}",
                bytes.len()
            )));
        }
        let u32_at = |at: usize| codec::u32_at(bytes, at);
        let u64_at = |at: usize| codec::u64_at(bytes, at);
        if bytes[0..8] != MAGIC {
            return Err(bad("not a cudalloc IPC handle (bad magic)"));
        }
        let version = codec::u16_at(bytes, 8);
        if version != VERSION {
            return Err(bad(format!(
                "handle layout version {version}; this build reads {VERSION}"
            )));
        }
        if u64_at(SUMMED) != checksum(&bytes[0..SUMMED]) {
            return Err(bad("handle is corrupt (checksum mismatch)"));
        }
        let backend = match bytes[10] {
            1 => Backend::Host,
            2 => Backend::Cuda,
            3 => Backend::Simulated,
            other => return Err(bad(format!("unknown backend code {other}"))),
        };
        let flags = bytes[11];
        let has_event = flags & 1 != 0;
        let empty = flags & 2 != 0;
        let expandable = flags & 4 != 0;
        if flags & !0b111 != 0 || (empty && (has_event || expandable)) {
            return Err(bad(format!("unknown flags {flags:#x}")));
        }
        let producer_pid = u32_at(16);
        if producer_pid == 0 || producer_pid > i32::MAX as u32 {
            return Err(bad(format!(
                "producer pid {producer_pid} is not a process id"
            )));
        }
        let segment_size = u64_at(88);
        let offset = u64_at(96);
        let nbytes = u64_at(104);
        match offset.checked_add(nbytes) {
            Some(end) if end <= segment_size => {}
            _ => {
                return Err(bad(format!(
                    "storage at offset {offset} with {nbytes} bytes does not fit its segment of {segment_size} bytes"
                )))
            }
        }
        let raw_name = &bytes[112..176];
        let len = raw_name.iter().position(|&c| c == 0).unwrap_or(NAME_BYTES);
        if raw_name[len..].iter().any(|&c| c != 0) {
            return Err(bad("ref-counter file name is not NUL padded"));
        }
        let ref_file = std::str::from_utf8(&raw_name[..len])
            .map_err(|_| bad("ref-counter file name is not UTF-8"))?
            .to_owned();
        if empty {
            if !ref_file.is_empty()
                || segment_size != 0
                || nbytes != 0
                || bytes[20..88].iter().any(|&c| c != 0)
            {
                return Err(bad(
                    "an empty-storage handle must name no segment, slot or file",
                ));
            }
        } else {
            validate_ref_file_name(&ref_file)?;
        }
        if bytes[244..248].iter().any(|&c| c != 0) {
            return Err(bad("reserved handle bytes are not zero"));
        }
        let mut memory = [0u8; IPC_HANDLE_SIZE];
        let pages = if expandable {
            Some(WirePages::parse(&bytes[24..88], segment_size)?)
        } else {
            memory.copy_from_slice(&bytes[24..88]);
            None
        };
        let event = if has_event {
            let mut e = [0u8; IPC_HANDLE_SIZE];
            e.copy_from_slice(&bytes[176..240]);
            Some(e)
        } else {
            if bytes[176..240].iter().any(|&c| c != 0) {
                return Err(bad("event bytes present but the event flag is clear"));
            }
            None
        };
        Ok(WireHandle {
            backend,
            device: u32_at(12),
            producer_pid,
            slot: u32_at(20),
            memory,
            segment_size,
            offset,
            nbytes,
            ref_file,
            event,
            generation: u32_at(240),
            expires_ms: u64_at(248),
            pages,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WireHandle {
        WireHandle {
            backend: Backend::Host,
            device: 0,
            producer_pid: 1234,
            slot: 7,
            memory: [3; 64],
            segment_size: 2 << 20,
            offset: 4096,
            nbytes: 512,
            ref_file: "cudalloc-1234-00000000000000ab-ref0".into(),
            event: Some([9; 64]),
            generation: 5,
            expires_ms: 1_700_000_000_000,
            pages: None,
        }
    }

    fn expandable() -> WireHandle {
        WireHandle {
            memory: [0; 64],
            segment_size: 3 << 21,
            offset: (2 << 21) + 4096,
            nbytes: 1 << 20,
            pages: Some(WirePages {
                page: 2 << 20,
                first: 0x7f00_0000_0000,
                count: 3,
                secret: [0xc3; PAGE_SECRET_SIZE],
            }),
            ..sample()
        }
    }

    #[test]
    fn round_trips() {
        let h = sample();
        assert_eq!(WireHandle::parse(&h.encode()).unwrap(), h);
        let plain = WireHandle {
            event: None,
            ..sample()
        };
        assert_eq!(WireHandle::parse(&plain.encode()).unwrap(), plain);
        let empty = WireHandle::empty(Backend::Host, 0, 77);
        assert_eq!(WireHandle::parse(&empty.encode()).unwrap(), empty);
        let pages = expandable();
        assert_eq!(WireHandle::parse(&pages.encode()).unwrap(), pages);
    }

    #[test]
    fn rejects_page_descriptions_that_do_not_add_up() {
        let with = |page: u64, first: u64, count: u64| {
            let h = WireHandle {
                pages: Some(WirePages {
                    page,
                    first,
                    count,
                    secret: [1; PAGE_SECRET_SIZE],
                }),
                ..expandable()
            };
            WireHandle::parse(&h.encode())
        };
        let page = 2 << 20;
        assert!(with(page, 0x7f00_0000_0000, 3).is_ok());
        for (what, result) in [
            (
                "count does not match the segment",
                with(page, 0x7f00_0000_0000, 2),
            ),
            ("no pages", with(page, 0x7f00_0000_0000, 0)),
            (
                "count × page overflows",
                with(page, 0x7f00_0000_0000, u64::MAX / 2),
            ),
            (
                "page not a power of two",
                with(3 << 20, 0x7f00_0000_0000, 2),
            ),
            ("page too small", with(512, 0x7f00_0000_0000, 12288)),
            ("unaligned first page", with(page, 0x7f00_0000_1000, 3)),
            ("null first page", with(page, 0, 3)),
            ("range wraps", with(page, u64::MAX - page + 1, 3)),
        ] {
            assert!(result.is_err(), "{what}");
        }
        let mut bytes = expandable().encode();
        bytes[24] ^= 1; // magic of the page description
        let sum = checksum(&bytes[0..SUMMED]);
        bytes[SUMMED..].copy_from_slice(&sum.to_le_bytes());
        assert!(WireHandle::parse(&bytes).is_err());
        let secretless = WireHandle {
            pages: expandable().pages.map(|p| WirePages {
                secret: [0; PAGE_SECRET_SIZE],
                ..p
            }),
            ..expandable()
        };
        let err = WireHandle::parse(&secretless.encode()).unwrap_err();
        assert!(err.to_string().contains("page secret"), "{err}");
        let mut flags = expandable().encode();
        flags[11] = 0b110; // expandable and empty
        let sum = checksum(&flags[0..SUMMED]);
        flags[SUMMED..].copy_from_slice(&sum.to_le_bytes());
        assert!(WireHandle::parse(&flags).is_err());
    }

    #[test]
    fn rejects_what_it_must() {
        let bad_name = |name: &str| {
            WireHandle {
                ref_file: name.into(),
                ..sample()
            }
            .encode()
        };
        for name in [
            "../../etc/passwd",
            "cudalloc-1-2-seg3",
            "cudalloc-..-ref1",
            "x-ref1",
            "cudalloc-1-ref",
        ] {
            assert!(WireHandle::parse(&bad_name(name)).is_err(), "{name}");
        }
        let overflow = WireHandle {
            offset: u64::MAX,
            nbytes: 2,
            ..sample()
        }
        .encode();
        assert!(WireHandle::parse(&overflow).is_err());
        let outside = WireHandle {
            offset: 2 << 20,
            nbytes: 1,
            ..sample()
        }
        .encode();
        assert!(WireHandle::parse(&outside).is_err());
        assert!(WireHandle::parse(&[0u8; 10]).is_err());
        let mut flipped = sample().encode();
        flipped[100] ^= 1;
        assert!(WireHandle::parse(&flipped).is_err());
    }
}
