//! [`RemoteStorage`]: a storage as its owner describes it to a peer (the agent that registered
//! it, NIXL's memory type and device, the address ranges of its regions), its byte encoding for any
//! channel, and the pairing of a local storage's regions with a remote one's into descriptors of
//! equal length.
//!
//! The encoding is read as untrusted input: a fixed header, a bounded agent name, a bounded number
//! of pieces, checked arithmetic and a checksum; anything else is an [`Error::Transfer`] naming
//! what is wrong. Decoding cannot make a transfer touch memory the peer did not register: NIXL
//! checks every descriptor against the peer's registrations.

use crate::codec::{checksum, put, u16_at, u32_at, u64_at};
use crate::error::{Error, Result};

const MAGIC: u32 = 0x4C58_4E43; // "CNXL"
const VERSION: u16 = 1;
const SEED: u64 = 0x6E69_786C_2D72_7331;
/// Header: magic u32, version u16, name length u16, memory type u8, 7 reserved, device u64,
/// piece count u32, 4 reserved, the owner's registration generation u64.
const HEADER: usize = 40;
const PIECE: usize = 16;
/// Longest agent name accepted.
pub const MAX_AGENT_NAME: usize = 256;
/// Most pieces (regions) one storage may span: one per 2 MiB page of an expandable segment, so
/// storages up to 2 TiB (the encoding is then 16 MiB).
pub const MAX_PIECES: usize = 1 << 20;

/// NIXL's memory type of a [`RemoteStorage`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Host memory (the host backend's device memory is host shared memory).
    Dram,
    /// Device memory.
    Vram,
}

/// NIXL's memory type of a [`MemoryKind`].
pub(super) fn mem_type(kind: MemoryKind) -> nixl_sys::MemType {
    match kind {
        MemoryKind::Dram => nixl_sys::MemType::Dram,
        MemoryKind::Vram => nixl_sys::MemType::Vram,
    }
}

/// A storage of another agent, as its owner described it ([`NixlAgent::describe`]): the target
/// or source of this side's transfers.
///
/// [`NixlAgent::describe`]: super::NixlAgent::describe
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteStorage {
    agent: String,
    kind: MemoryKind,
    device: u64,
    pieces: Vec<(u64, u64)>,
    nbytes: u64,
    generation: u64,
}

impl RemoteStorage {
    /// A description from its parts (the owner's agent, NIXL's memory type and device id, the
    /// address ranges); checked like decoded bytes. NIXL still refuses ranges the owner did not
    /// register.
    pub fn new(
        agent: String,
        kind: MemoryKind,
        device: u64,
        pieces: Vec<(u64, u64)>,
    ) -> Result<Self> {
        if agent.is_empty() || agent.len() > MAX_AGENT_NAME {
            return Err(Error::transfer(format!(
                "an agent name of {} bytes (1 to {MAX_AGENT_NAME})",
                agent.len()
            )));
        }
        if pieces.is_empty() || pieces.len() > MAX_PIECES {
            return Err(Error::transfer(format!(
                "a storage description with {} pieces (1 to {MAX_PIECES})",
                pieces.len()
            )));
        }
        let mut nbytes = 0u64;
        for &(addr, len) in &pieces {
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(Error::transfer(format!(
                    "a piece of {len} bytes at {addr:#x} (empty or past the address space)"
                )));
            }
            nbytes = nbytes
                .checked_add(len)
                .ok_or_else(|| Error::transfer("the pieces' sizes overflow"))?;
        }
        Ok(RemoteStorage {
            agent,
            kind,
            device,
            pieces,
            nbytes,
            generation: 0,
        })
    }

    /// The same description, stamped with the owner's registration generation when it was made
    /// (a peer whose copy of the owner's metadata is older refuses it with a clear error).
    pub(crate) fn with_generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self
    }

    /// The owner's registration generation when it described the storage
    /// ([`NixlAgent::generation`](super::NixlAgent::generation)); 0 for a description built with
    /// [`RemoteStorage::new`].
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The agent that owns it.
    pub fn agent(&self) -> &str {
        &self.agent
    }

    /// Its size in bytes.
    pub fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// NIXL's memory type of it.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// NIXL's device id of it.
    pub fn device(&self) -> u64 {
        self.device
    }

    /// Its address ranges, one per region of the owner's it lies in.
    pub fn pieces(&self) -> &[(u64, u64)] {
        &self.pieces
    }

    /// The bytes to send to the peer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let name = self.agent.as_bytes();
        let body = HEADER + name.len() + self.pieces.len() * PIECE;
        let mut out = vec![0u8; body + 8];
        put(&mut out, 0, &MAGIC.to_le_bytes());
        put(&mut out, 4, &VERSION.to_le_bytes());
        put(&mut out, 6, &(name.len() as u16).to_le_bytes());
        out[8] = match self.kind {
            MemoryKind::Dram => 0,
            MemoryKind::Vram => 1,
        };
        put(&mut out, 16, &self.device.to_le_bytes());
        put(&mut out, 24, &(self.pieces.len() as u32).to_le_bytes());
        put(&mut out, 32, &self.generation.to_le_bytes());
        put(&mut out, HEADER, name);
        let mut at = HEADER + name.len();
        for &(addr, len) in &self.pieces {
            put(&mut out, at, &addr.to_le_bytes());
            put(&mut out, at + 8, &len.to_le_bytes());
            at += PIECE;
        }
        let sum = checksum(SEED, &out[..body]);
        put(&mut out, body, &sum.to_le_bytes());
        out
    }

    /// Reads bytes a peer sent (untrusted: every field is checked).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = |what: String| Error::transfer(format!("a storage description: {what}"));
        if bytes.len() < HEADER + 8 {
            return Err(bad(format!("{} bytes is too short", bytes.len())));
        }
        if u32_at(bytes, 0) != MAGIC {
            return Err(bad("not a cudalloc storage description".into()));
        }
        if u16_at(bytes, 4) != VERSION {
            return Err(bad(format!("version {}", u16_at(bytes, 4))));
        }
        let name_len = usize::from(u16_at(bytes, 6));
        let count = u32_at(bytes, 24) as usize;
        if name_len > MAX_AGENT_NAME || count > MAX_PIECES {
            return Err(bad(format!("{name_len}-byte name, {count} pieces")));
        }
        let body = HEADER + name_len + count * PIECE;
        if bytes.len() != body + 8 {
            return Err(bad(format!(
                "{} bytes where its header says {}",
                bytes.len(),
                body + 8
            )));
        }
        if checksum(SEED, &bytes[..body]) != u64_at(bytes, body) {
            return Err(bad("checksum mismatch".into()));
        }
        let kind = match bytes[8] {
            0 => MemoryKind::Dram,
            1 => MemoryKind::Vram,
            other => return Err(bad(format!("memory type {other}"))),
        };
        let agent = std::str::from_utf8(&bytes[HEADER..HEADER + name_len])
            .map_err(|_| bad("the agent name is not UTF-8".into()))?
            .to_owned();
        let pieces = (0..count)
            .map(|i| {
                let at = HEADER + name_len + i * PIECE;
                (u64_at(bytes, at), u64_at(bytes, at + 8))
            })
            .collect();
        Ok(RemoteStorage::new(agent, kind, u64_at(bytes, 16), pieces)?
            .with_generation(u64_at(bytes, 32)))
    }
}

/// Pairs `local` and `remote` ranges of equal total length into `(local, remote, len)`
/// descriptors, split wherever either side crosses from one region to the next.
pub(crate) fn pair(local: &[(u64, u64)], remote: &[(u64, u64)]) -> Result<Vec<(u64, u64, u64)>> {
    let total = |v: &[(u64, u64)]| v.iter().map(|p| p.1).sum::<u64>();
    let (l, r) = (total(local), total(remote));
    if l != r {
        return Err(Error::transfer(format!(
            "a local storage of {l} bytes against a remote one of {r}"
        )));
    }
    let mut out = Vec::with_capacity(local.len().max(remote.len()));
    let (mut li, mut ri) = (0, 0);
    let (mut lo, mut ro) = (0u64, 0u64);
    while li < local.len() && ri < remote.len() {
        let (la, ll) = local[li];
        let (ra, rl) = remote[ri];
        let len = (ll - lo).min(rl - ro);
        out.push((la + lo, ra + ro, len));
        lo += len;
        ro += len;
        if lo == ll {
            li += 1;
            lo = 0;
        }
        if ro == rl {
            ri += 1;
            ro = 0;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RemoteStorage {
        RemoteStorage::new(
            "peer-1".into(),
            MemoryKind::Dram,
            0,
            vec![(0x1000, 0x800), (0x2000_0000, 0x100)],
        )
        .unwrap_or_else(|e| panic!("{e}"))
        .with_generation(17)
    }

    #[test]
    fn round_trips_and_rejects_every_damage() {
        let s = sample();
        let bytes = s.to_bytes();
        assert_eq!(RemoteStorage::from_bytes(&bytes).ok(), Some(s));
        // Every single-byte change and every truncation is refused, never a panic.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x5A;
            assert!(RemoteStorage::from_bytes(&b).is_err(), "byte {i}");
            assert!(
                RemoteStorage::from_bytes(&bytes[..i]).is_err(),
                "cut at {i}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(RemoteStorage::from_bytes(&long).is_err());
    }

    #[test]
    fn refuses_what_cannot_be_a_storage() {
        let bad = |pieces: Vec<(u64, u64)>| {
            RemoteStorage::new("p".into(), MemoryKind::Dram, 0, pieces).is_err()
        };
        assert!(bad(vec![]));
        assert!(bad(vec![(0x1000, 0)]));
        assert!(bad(vec![(u64::MAX - 1, 4)]));
        assert!(bad(vec![(0, u64::MAX), (0x10, u64::MAX)]));
        assert!(RemoteStorage::new(String::new(), MemoryKind::Dram, 0, vec![(1, 1)]).is_err());
        assert!(RemoteStorage::new("x".repeat(300), MemoryKind::Dram, 0, vec![(1, 1)]).is_err());
    }

    #[test]
    fn pairs_split_at_both_sides_boundaries() {
        let local = [(100, 30), (500, 10)];
        let remote = [(1000, 10), (2000, 30)];
        let pairs = pair(&local, &remote).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            pairs,
            vec![(100, 1000, 10), (110, 2000, 20), (500, 2020, 10)]
        );
        assert!(pair(&local, &[(0, 39)]).is_err());
    }
}
