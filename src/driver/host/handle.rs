//! The host backend's 64-byte IPC handles (the counterpart of CUDA's opaque `CUipcMemHandle` and
//! `CUipcEventHandle`).
//!
//! | bytes  | field                                              |
//! |--------|----------------------------------------------------|
//! | 0..8   | magic: `cdalHMEM` (memory) or `cdalHEVT` (event)   |
//! | 8..10  | layout version (2), little endian                  |
//! | 10..12 | device ordinal in the exporting process            |
//! | 12..16 | exporting process id                               |
//! | 16..24 | the exporting driver's random nonce                |
//! | 24..32 | object number (segment number / event chunk number)|
//! | 32..40 | segment size (memory) / cell slot (event)          |
//! | 40..48 | zero (memory) / the event's latest record at export (event) |
//! | 48..56 | zero                                               |
//! | 56..64 | checksum of bytes 0..56                            |
//!
//! The shared-memory name is derived from (pid, nonce, kind, object number), never read from the
//! handle, so a handle cannot point the opener at an arbitrary file. Decoding checks every field.
//! An event handle carries the sequence number of the record it was exported after: the opener
//! waits for exactly that record, never for whatever the shared `recorded` counter says (which any
//! process of the same user can write; see `foreign_event.rs`).

use crate::codec;
use crate::driver::IPC_HANDLE_SIZE;
use crate::error::{Error, Result};

const VERSION: u16 = 2;

/// Which object a handle names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum HandleKind {
    /// A memory segment.
    Memory,
    /// An event chunk cell.
    Event,
}

impl HandleKind {
    fn magic(self) -> [u8; 8] {
        match self {
            HandleKind::Memory => *b"cdalHMEM",
            HandleKind::Event => *b"cdalHEVT",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            HandleKind::Memory => "seg",
            HandleKind::Event => "evt",
        }
    }
}

/// The decoded contents of a host handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct HostHandle {
    pub kind: HandleKind,
    pub device: u16,
    pub pid: u32,
    pub nonce: u64,
    pub object: u64,
    /// Segment size (memory) or cell slot (event).
    pub extra: u64,
    /// The event's latest record when it was exported (0 for memory handles).
    pub record: u64,
}

/// The shared-memory name of object `object` of `kind` made by the driver (`pid`, `nonce`).
pub(crate) fn object_name(kind: HandleKind, pid: u32, nonce: u64, object: u64) -> String {
    crate::shm::object_name(pid, nonce, kind.tag(), object)
}

/// Seed of the host handles' checksum.
const CHECKSUM_SEED: u64 = 0x6364_616c;

fn checksum(bytes: &[u8]) -> u64 {
    codec::checksum(CHECKSUM_SEED, bytes)
}

impl HostHandle {
    /// The name of the shared-memory object this handle names.
    pub(crate) fn object_name(&self) -> String {
        object_name(self.kind, self.pid, self.nonce, self.object)
    }

    pub(crate) fn encode(&self) -> [u8; IPC_HANDLE_SIZE] {
        let mut b = [0u8; IPC_HANDLE_SIZE];
        codec::put(&mut b, 0, &self.kind.magic());
        codec::put(&mut b, 8, &VERSION.to_le_bytes());
        codec::put(&mut b, 10, &self.device.to_le_bytes());
        codec::put(&mut b, 12, &self.pid.to_le_bytes());
        codec::put(&mut b, 16, &self.nonce.to_le_bytes());
        codec::put(&mut b, 24, &self.object.to_le_bytes());
        codec::put(&mut b, 32, &self.extra.to_le_bytes());
        codec::put(&mut b, 40, &self.record.to_le_bytes());
        let sum = checksum(&b[0..56]);
        codec::put(&mut b, 56, &sum.to_le_bytes());
        b
    }

    pub(crate) fn decode(kind: HandleKind, b: &[u8; IPC_HANDLE_SIZE]) -> Result<Self> {
        let u64_at = |at: usize| codec::u64_at(b, at);
        let what = match kind {
            HandleKind::Memory => "memory",
            HandleKind::Event => "event",
        };
        if b[0..8] != kind.magic() {
            return Err(Error::bad_handle(format!(
                "not a host-backend {what} handle (bad magic)"
            )));
        }
        let version = codec::u16_at(b, 8);
        if version != VERSION {
            return Err(Error::bad_handle(format!(
                "host {what} handle layout version {version}, this build reads {VERSION}"
            )));
        }
        let reserved = match kind {
            HandleKind::Memory => &b[40..56],
            HandleKind::Event => &b[48..56],
        };
        if reserved.iter().any(|&x| x != 0) || u64_at(56) != checksum(&b[0..56]) {
            return Err(Error::bad_handle(format!(
                "host {what} handle is corrupt (checksum)"
            )));
        }
        let pid = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        if pid == 0 {
            return Err(Error::bad_handle(format!("host {what} handle names pid 0")));
        }
        Ok(HostHandle {
            kind,
            device: u16::from_le_bytes([b[10], b[11]]),
            pid,
            nonce: u64_at(16),
            object: u64_at(24),
            extra: u64_at(32),
            record: match kind {
                HandleKind::Memory => 0,
                HandleKind::Event => u64_at(40),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> HostHandle {
        HostHandle {
            kind: HandleKind::Memory,
            device: 1,
            pid: 42,
            nonce: 7,
            object: 3,
            extra: 4096,
            record: 0,
        }
    }

    #[test]
    fn round_trips() {
        let h = sample();
        assert_eq!(
            HostHandle::decode(HandleKind::Memory, &h.encode()).unwrap(),
            h
        );
        assert_eq!(h.object_name(), "cudalloc-42-0000000000000007-seg3");
    }

    #[test]
    fn every_single_byte_flip_is_rejected() {
        let bytes = sample().encode();
        for i in 0..IPC_HANDLE_SIZE {
            for bit in 0..8 {
                let mut b = bytes;
                b[i] ^= 1 << bit;
                assert!(
                    HostHandle::decode(HandleKind::Memory, &b).is_err(),
                    "byte {i} bit {bit}"
                );
            }
        }
        assert!(HostHandle::decode(HandleKind::Event, &bytes).is_err());
    }

    #[test]
    fn event_handles_carry_their_record_and_memory_handles_none() {
        let event = HostHandle {
            kind: HandleKind::Event,
            extra: 5,
            record: 41,
            ..sample()
        };
        assert_eq!(
            HostHandle::decode(HandleKind::Event, &event.encode()).unwrap(),
            event
        );
        // A memory handle with bytes in the record field is corrupt.
        let memory = HostHandle {
            record: 1,
            ..sample()
        };
        assert!(HostHandle::decode(HandleKind::Memory, &memory.encode()).is_err());
    }
}
