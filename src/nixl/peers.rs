//! Peers: the envelope of an agent's metadata, the checks on a peer's bytes before NIXL parses
//! them, and what an agent knows of each peer.
//!
//! **The envelope.** [`NixlAgent::metadata`](super::NixlAgent::metadata) is NIXL's metadata behind
//! a 16-byte header: a magic and the agent's registration generation when it was read (bumped by
//! every registration and deregistration). A description ([`RemoteStorage`](super::RemoteStorage))
//! carries the generation it was made at, so a peer whose copy of the owner's metadata is older
//! than the description refuses the transfer with an error that says so — instead of NIXL's
//! "no backend had the required registrations".
//!
//! **Before NIXL parses anything**, the bytes are checked: their size, the magic, and the start of
//! NIXL's own layout (`nixlSerDes|Agent`, a 64-bit length, the agent's name, `|`): the name must be
//! UTF-8 of 1 to [`MAX_AGENT_NAME`](super::MAX_AGENT_NAME) bytes (nixl-sys would panic on one that
//! is not UTF-8).
//!
//! | peer state | transfers | `load_peer` again | `forget_peer` |
//! |---|---|---|---|
//! | unknown | refused | loads it | error |
//! | loaded at generation g | descriptions of generation ≤ g accepted, counted while in flight | refused while any is in flight (NIXL would drop the connection under them), else replaces g | likewise |

use std::collections::HashMap;

use super::descriptor::MAX_AGENT_NAME;
use crate::codec::{put, u64_at};
use crate::error::{Error, Result};
use crate::sync::os::Mutex;

const MAGIC: &[u8; 8] = b"CNXLMD01";
const ENVELOPE: usize = 16;
const NIXL_HEADER: &[u8] = b"nixlSerDes|Agent";

/// This agent's metadata in its envelope.
pub(crate) fn seal(generation: u64, nixl: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; ENVELOPE];
    put(&mut out, 0, MAGIC);
    put(&mut out, 8, &generation.to_le_bytes());
    out.extend_from_slice(nixl);
    out
}

/// A peer's metadata, checked: its generation, NIXL's bytes and the agent name in them. A
/// cudalloc agent's comes in the envelope; a foreign peer's (NIXL's own `get_agent_metadata`)
/// bare, with generation 0 (descriptions of its memory carry no generation either).
pub(crate) fn open(bytes: &[u8], max: usize) -> Result<(u64, &[u8], String)> {
    let bad = |what: String| Error::transfer(format!("peer metadata: {what}"));
    if bytes.len() <= NIXL_HEADER.len() + 8 || bytes.len() > max {
        return Err(bad(format!(
            "{} bytes (more than {} and at most {max})",
            bytes.len(),
            NIXL_HEADER.len() + 8
        )));
    }
    let (generation, nixl) = if bytes.starts_with(MAGIC) {
        if bytes.len() <= ENVELOPE + NIXL_HEADER.len() + 8 {
            return Err(bad(format!("an envelope of {} bytes", bytes.len())));
        }
        (u64_at(bytes, 8), &bytes[ENVELOPE..])
    } else if bytes.starts_with(NIXL_HEADER) {
        (0, bytes)
    } else {
        return Err(bad(
            "neither a cudalloc NIXL agent's metadata nor NIXL's own".into(),
        ));
    };
    if !nixl.starts_with(NIXL_HEADER) {
        return Err(bad("not NIXL's serialized layout".into()));
    }
    let len = u64_at(nixl, NIXL_HEADER.len());
    let start = NIXL_HEADER.len() + 8;
    let name_len = usize::try_from(len)
        .ok()
        .filter(|&n| (1..=MAX_AGENT_NAME).contains(&n))
        .ok_or_else(|| bad(format!("an agent name of {len} bytes")))?;
    let name = nixl
        .get(start..start + name_len)
        .ok_or_else(|| bad("the agent name runs past the end".into()))?;
    if nixl.get(start + name_len) != Some(&b'|') {
        return Err(bad("no separator after the agent name".into()));
    }
    let name = std::str::from_utf8(name)
        .map_err(|_| bad("the agent name is not UTF-8".into()))?
        .to_owned();
    Ok((generation, nixl, name))
}

#[derive(Debug)]
struct Peer {
    generation: u64,
    in_flight: usize,
}

/// What an agent knows of its peers (see the module docs' table).
#[derive(Debug, Default)]
pub(crate) struct Peers {
    known: Mutex<HashMap<String, Peer>>,
}

impl Peers {
    /// Whether `name`'s metadata may be replaced or forgotten now.
    pub(crate) fn may_replace(&self, name: &str) -> Result<()> {
        match self.known.lock().get(name) {
            Some(p) if p.in_flight > 0 => Err(Error::transfer(format!(
                "{} transfers with {name} are in flight: wait for them before its metadata is \
                 replaced or forgotten (NIXL drops the connection under them)",
                p.in_flight
            ))),
            _ => Ok(()),
        }
    }

    pub(crate) fn loaded(&self, name: &str, generation: u64) {
        self.known.lock().insert(
            name.to_owned(),
            Peer {
                generation,
                in_flight: 0,
            },
        );
    }

    /// Knows `name` at generation 0 (metadata that reached NIXL by its listener) unless it is
    /// known already: a known peer keeps its generation and its transfers in flight.
    pub(crate) fn learn(&self, name: &str) {
        self.known.lock().entry(name.to_owned()).or_insert(Peer {
            generation: 0,
            in_flight: 0,
        });
    }

    pub(crate) fn forget(&self, name: &str) -> bool {
        self.known.lock().remove(name).is_some()
    }

    pub(crate) fn len(&self) -> usize {
        self.known.lock().len()
    }

    /// A transfer with `name` of descriptions up to `generation` begins (or an error says why not).
    pub(crate) fn begin(&self, name: &str, generation: u64, what: &str) -> Result<()> {
        let mut known = self.known.lock();
        let Some(peer) = known.get_mut(name) else {
            return Err(Error::transfer(format!(
                "{what} with {name}, whose metadata this agent has not loaded"
            )));
        };
        if generation > peer.generation {
            return Err(Error::transfer(format!(
                "{what} with {name}: its storage was described at registration generation \
                 {generation}, after the metadata loaded here (generation {}); load {name}'s \
                 fresh metadata first",
                peer.generation
            )));
        }
        peer.in_flight += 1;
        Ok(())
    }

    /// A transfer with `name` ended.
    pub(crate) fn end(&self, name: &str) {
        if let Some(peer) = self.known.lock().get_mut(name) {
            peer.in_flight = peer.in_flight.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nixl_like(name: &[u8]) -> Vec<u8> {
        let mut v = NIXL_HEADER.to_vec();
        v.extend_from_slice(&(name.len() as u64).to_le_bytes());
        v.extend_from_slice(name);
        v.extend_from_slice(b"|Conns...");
        v
    }

    #[test]
    fn opens_what_it_sealed_and_refuses_names_nixl_sys_would_panic_on() {
        let md = seal(9, &nixl_like(b"agent-1"));
        let (generation, nixl, name) = open(&md, 1 << 20).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((generation, name.as_str()), (9, "agent-1"));
        assert_eq!(nixl, &md[ENVELOPE..]);
        for bad in [
            seal(1, &nixl_like(&[0xFF, 0xFE])),
            seal(1, &nixl_like(b"")),
            seal(1, &nixl_like(&[b'x'; 300])),
            seal(1, b"nixlSerDes|Agent\x09\0\0\0\0\0\0\0short"),
            seal(1, b"somethingElse|Agent\x01\0\0\0\0\0\0\0a|"),
            nixl_like(&[0xFF, 0xFE]),
            b"somethingElse|Agent\x01\0\0\0\0\0\0\0a|".to_vec(),
        ] {
            assert!(open(&bad, 1 << 20).is_err());
        }
        // A foreign peer's metadata is NIXL's own, bare: generation 0.
        let bare = nixl_like(b"python-peer");
        let (generation, nixl, name) = open(&bare, 1 << 20).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (generation, name.as_str(), nixl),
            (0, "python-peer", &bare[..])
        );
        assert!(open(&md, md.len() - 1).is_err(), "over the size limit");
        // Every truncation is an error, never a panic.
        for cut in 0..md.len() {
            let _ = open(&md[..cut], 1 << 20);
        }
    }

    #[test]
    fn transfers_wait_for_fresh_metadata_and_block_its_replacement() {
        let peers = Peers::default();
        assert!(peers.begin("p", 0, "a write").is_err(), "unknown peer");
        peers.loaded("p", 5);
        assert!(
            peers.begin("p", 6, "a write").is_err(),
            "described after the metadata"
        );
        peers
            .begin("p", 5, "a write")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(peers.may_replace("p").is_err());
        peers.end("p");
        assert!(peers.may_replace("p").is_ok());
    }
}
