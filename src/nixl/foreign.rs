//! NIXL's own forms at cudalloc's door, for peers that are not cudalloc (a Python service on the
//! `nixl` wheel, vLLM, Dynamo): a storage's descriptors as NIXL serializes a transfer descriptor
//! list, bare (`nixlSerDes`) or as the Python API's `get_serialized_descs` hands them out (a
//! pickle of the bindings' `nixlXferDList` around those bytes), and read back from a peer the
//! same ways. What a peer sends is untrusted input: sizes, counts and every field are checked,
//! the pickle is read by a fixed-shape reader (no general unpickler, nothing executed), and a
//! bad value is an [`Error::Transfer`] naming what is wrong.
//!
//! NIXL's serialization (`nixlSerDes`), as the engine writes a transfer descriptor list:
//!
//! | bytes | meaning |
//! |---|---|
//! | `nixlSerDes\|` | header |
//! | `nixlDList`, u64 10, `nixlBDList`, `\|` | the list's tag |
//! | `t`, u64 4, u32 memory type, `\|` | 0 `DRAM`, 1 `VRAM` (NIXL's `nixl_mem_t`) |
//! | `n`, u64 8, u64 count, `\|` | descriptors |
//! | u64 24 × count, then count × (u64 address, u64 length, u64 device id), `\|` | the descriptors, packed |
//!
//! Integers are little-endian. The pickle is protocol 4: a frame, the class by module and name
//! (`<package>._bindings`, `nixlXferDList`), an empty `NEWOBJ`, the bytes above as its state,
//! `BUILD`.

use super::descriptor::{MemoryKind, RemoteStorage, MAX_PIECES};
use crate::error::{Error, Result};

const HEADER: &[u8] = b"nixlSerDes|";
const LIST_TAG: &[u8] = b"nixlDList";
const LIST_KIND: &[u8] = b"nixlBDList";
const DESC: usize = 24;
/// The Python wheel's bindings module (`nixl-cu12`); a peer's may name another package.
pub(super) const PYTHON_BINDINGS: &str = "nixl_cu12._bindings";
const CLASS: &str = "nixlXferDList";

fn bad(what: impl std::fmt::Display) -> Error {
    Error::transfer(format!("a NIXL descriptor list: {what}"))
}

/// NIXL's serialization of a transfer descriptor list of `kind` on device `device`.
pub(crate) fn serdes(kind: MemoryKind, device: u64, pieces: &[(u64, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(80 + pieces.len() * DESC);
    out.extend_from_slice(HEADER);
    entry(&mut out, LIST_TAG, LIST_KIND);
    let mem: u32 = match kind {
        MemoryKind::Dram => 0,
        MemoryKind::Vram => 1,
    };
    entry(&mut out, b"t", &mem.to_le_bytes());
    entry(&mut out, b"n", &(pieces.len() as u64).to_le_bytes());
    let mut descs = Vec::with_capacity(pieces.len() * DESC);
    for &(addr, len) in pieces {
        descs.extend_from_slice(&addr.to_le_bytes());
        descs.extend_from_slice(&len.to_le_bytes());
        descs.extend_from_slice(&device.to_le_bytes());
    }
    entry(&mut out, b"", &descs);
    out
}

fn entry(out: &mut Vec<u8>, tag: &[u8], value: &[u8]) {
    out.extend_from_slice(tag);
    out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    out.extend_from_slice(value);
    out.push(b'|');
}

/// A reader over untrusted bytes: every step checks what is left.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| bad(format!("cut short in {what}")))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn expect(&mut self, want: &[u8], what: &str) -> Result<()> {
        if self.take(want.len(), what)? != want {
            return Err(bad(format!("{what} is not NIXL's")));
        }
        Ok(())
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// One `tag, u64 length, value, |` entry whose value must be `len` bytes.
    fn entry(&mut self, tag: &[u8], len: usize, what: &str) -> Result<&'a [u8]> {
        self.expect(tag, what)?;
        let got = self.u64(what)?;
        if got != len as u64 {
            return Err(bad(format!("{what} of {got} bytes (expected {len})")));
        }
        let value = self.take(len, what)?;
        self.expect(b"|", what)?;
        Ok(value)
    }
}

/// One descriptor of a NIXL list: address, length, device id.
pub(crate) type Desc = (u64, u64, u64);

/// A descriptor list NIXL serialized: its memory type and its descriptors. At most
/// [`MAX_PIECES`] descriptors; nothing may follow the list.
pub(crate) fn parse_serdes(bytes: &[u8]) -> Result<(MemoryKind, Vec<Desc>)> {
    let mut r = Reader { bytes, at: 0 };
    r.expect(HEADER, "the header")?;
    if r.entry(LIST_TAG, LIST_KIND.len(), "the list tag")? != LIST_KIND {
        return Err(bad("not a descriptor list"));
    }
    let mem = r.entry(b"t", 4, "the memory type")?;
    let kind = match u32::from_le_bytes([mem[0], mem[1], mem[2], mem[3]]) {
        0 => MemoryKind::Dram,
        1 => MemoryKind::Vram,
        other => {
            return Err(bad(format!(
                "memory type {other} (DRAM 0 and VRAM 1 are served)"
            )))
        }
    };
    let count = r.entry(b"n", 8, "the count")?;
    let count = u64::from_le_bytes([
        count[0], count[1], count[2], count[3], count[4], count[5], count[6], count[7],
    ]);
    let count = usize::try_from(count)
        .ok()
        .filter(|&c| (1..=MAX_PIECES).contains(&c))
        .ok_or_else(|| bad(format!("{count} descriptors (1 to {MAX_PIECES})")))?;
    let packed = r.entry(b"", count * DESC, "the descriptors")?;
    if r.at != bytes.len() {
        return Err(bad(format!("{} bytes after the list", bytes.len() - r.at)));
    }
    let descs = packed
        .chunks_exact(DESC)
        .map(|d| {
            let word = |i: usize| {
                let mut a = [0u8; 8];
                a.copy_from_slice(&d[i * 8..i * 8 + 8]);
                u64::from_le_bytes(a)
            };
            (word(0), word(1), word(2))
        })
        .collect();
    Ok((kind, descs))
}

// Pickle opcodes of the fixed shape (protocol 4).
const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const SHORT_BINUNICODE: u8 = 0x8c;
const MEMOIZE: u8 = 0x94;
const STACK_GLOBAL: u8 = 0x93;
const EMPTY_TUPLE: u8 = b')';
const NEWOBJ: u8 = 0x81;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const BUILD: u8 = b'b';
const STOP: u8 = b'.';

/// `serdes` as the Python API's `get_serialized_descs` returns it: a pickle of the bindings'
/// `nixlXferDList` (module `module`, e.g. [`PYTHON_BINDINGS`]) with those bytes as its state.
pub(crate) fn pickle(serdes: &[u8], module: &str) -> Vec<u8> {
    let mut body = Vec::with_capacity(serdes.len() + 64);
    for name in [module, CLASS] {
        body.push(SHORT_BINUNICODE);
        body.push(name.len() as u8);
        body.extend_from_slice(name.as_bytes());
        body.push(MEMOIZE);
    }
    body.extend_from_slice(&[STACK_GLOBAL, MEMOIZE, EMPTY_TUPLE, NEWOBJ, MEMOIZE]);
    if let Ok(n) = u8::try_from(serdes.len()) {
        body.extend_from_slice(&[SHORT_BINBYTES, n]);
    } else if let Ok(n) = u32::try_from(serdes.len()) {
        body.push(BINBYTES);
        body.extend_from_slice(&n.to_le_bytes());
    } else {
        body.push(BINBYTES8);
        body.extend_from_slice(&(serdes.len() as u64).to_le_bytes());
    }
    body.extend_from_slice(serdes);
    body.extend_from_slice(&[MEMOIZE, BUILD, STOP]);
    let mut out = vec![PROTO, 4, FRAME];
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// The `nixlSerDes` bytes inside a pickle of `nixlXferDList` (the shape [`pickle`] writes and
/// the Python API's `get_serialized_descs` makes, framed or not, any package's `_bindings`).
pub(crate) fn unpickle(bytes: &[u8]) -> Result<&[u8]> {
    let mut r = Reader { bytes, at: 0 };
    r.expect(&[PROTO], "the pickle's protocol")?;
    let proto = r.take(1, "the pickle's protocol")?[0];
    if !(4..=5).contains(&proto) {
        return Err(bad(format!("pickle protocol {proto} (4 or 5 expected)")));
    }
    if r.bytes.get(r.at) == Some(&FRAME) {
        // A framing hint: CPython frames the small opcodes and writes a large state's bytes
        // after the frame, so a frame may end before the pickle does, never after it.
        r.at += 1;
        let len = r.u64("the pickle's frame")?;
        if len > (bytes.len() - r.at) as u64 {
            return Err(bad("a pickle frame past the end"));
        }
    }
    let mut names = [""; 2];
    for name in &mut names {
        r.expect(&[SHORT_BINUNICODE], "the pickled class")?;
        let n = usize::from(r.take(1, "the pickled class")?[0]);
        *name = std::str::from_utf8(r.take(n, "the pickled class")?)
            .map_err(|_| bad("a class name that is not UTF-8"))?;
        r.expect(&[MEMOIZE], "the pickled class")?;
    }
    if !names[0].ends_with("._bindings") || names[1] != CLASS {
        return Err(bad(format!(
            "a pickle of {}.{} (a NIXL bindings' {CLASS} expected)",
            names[0], names[1]
        )));
    }
    r.expect(
        &[STACK_GLOBAL, MEMOIZE, EMPTY_TUPLE, NEWOBJ, MEMOIZE],
        "the pickled object",
    )?;
    let op = r.take(1, "the pickled state")?[0];
    let len = match op {
        SHORT_BINBYTES => u64::from(r.take(1, "the pickled state")?[0]),
        BINBYTES => {
            let b = r.take(4, "the pickled state")?;
            u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        BINBYTES8 => r.u64("the pickled state")?,
        other => {
            return Err(bad(format!(
                "pickle opcode {other:#x} where the state's bytes go"
            )))
        }
    };
    let len = usize::try_from(len).map_err(|_| bad("a state past the address space"))?;
    let state = r.take(len, "the pickled state")?;
    r.expect(&[MEMOIZE, BUILD, STOP], "the pickle's end")?;
    if r.at != bytes.len() {
        return Err(bad("bytes after the pickle's end"));
    }
    Ok(state)
}

impl RemoteStorage {
    /// The description as NIXL serializes a transfer descriptor list, wrapped as the Python
    /// API's `get_serialized_descs` returns it (what a foreign peer's `deserialize_descs` reads:
    /// one descriptor per piece, the device id of each). The agent's name travels beside it
    /// (NIXL's lists do not carry it).
    pub fn to_nixl_descs(&self) -> Vec<u8> {
        let serdes = serdes(self.kind(), self.device(), self.pieces());
        pickle(&serdes, PYTHON_BINDINGS)
    }

    /// A description of agent `agent`'s memory from a descriptor list NIXL serialized — as its
    /// Python API's `get_serialized_descs` returns it, or bare — of one device (untrusted input:
    /// checked as `RemoteStorage::from_bytes` is). Generation 0: a foreign peer's metadata
    /// carries none.
    pub fn from_nixl_descs(agent: &str, bytes: &[u8]) -> Result<Self> {
        let serdes = if bytes.starts_with(b"nixlSerDes|") {
            bytes
        } else {
            unpickle(bytes)?
        };
        let (kind, descs) = parse_serdes(serdes)?;
        let device = descs[0].2;
        if descs.iter().any(|d| d.2 != device) {
            return Err(Error::transfer(
                "a NIXL descriptor list spanning devices (one storage is on one device)",
            ));
        }
        let pieces = descs
            .into_iter()
            .map(|(addr, len, _)| (addr, len))
            .collect();
        Self::new(agent.to_owned(), kind, device, pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes the `nixl-cu12` 1.5.1 wheel's `get_serialized_descs` returned for two VRAM
    /// descriptors `(0x1000, 16, 3), (0x2000, 32, 3)`, recorded once from the wheel.
    const FROM_THE_WHEEL: &[u8] = b"\x80\x04\x95\xb0\x00\x00\x00\x00\x00\x00\x00\x8c\x13nixl_cu12._bindings\x94\x8c\rnixlXferDList\x94\x93\x94)\x81\x94C\x80nixlSerDes|nixlDList\n\x00\x00\x00\x00\x00\x00\x00nixlBDList|t\x04\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00|n\x08\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00|0\x00\x00\x00\x00\x00\x00\x00\x00\x10\x00\x00\x00\x00\x00\x00\x10\x00\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x00\x00\x00\x00\x00 \x00\x00\x00\x00\x00\x00 \x00\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x00\x00\x00\x00|\x94b.";

    #[test]
    fn the_wheels_bytes_are_read_and_written_the_same() {
        let state = unpickle(FROM_THE_WHEEL).unwrap();
        let (kind, descs) = parse_serdes(state).unwrap();
        assert_eq!(kind, MemoryKind::Vram);
        assert_eq!(descs, vec![(0x1000, 16, 3), (0x2000, 32, 3)]);
        let ours = serdes(MemoryKind::Vram, 3, &[(0x1000, 16), (0x2000, 32)]);
        assert_eq!(ours, state);
        assert_eq!(pickle(&ours, PYTHON_BINDINGS), FROM_THE_WHEEL);
    }

    #[test]
    fn every_cut_and_every_flipped_byte_is_an_error_or_the_same_list() {
        let good = parse_serdes(unpickle(FROM_THE_WHEEL).unwrap()).unwrap();
        for cut in 0..FROM_THE_WHEEL.len() {
            assert!(unpickle(&FROM_THE_WHEEL[..cut])
                .and_then(parse_serdes)
                .is_err());
        }
        for i in 0..FROM_THE_WHEEL.len() {
            let mut b = FROM_THE_WHEEL.to_vec();
            b[i] ^= 0xff;
            if let Ok(list) = unpickle(&b).and_then(parse_serdes) {
                // Only the addresses, lengths and devices may change undetected here: NIXL checks
                // them against the registrations.
                assert_eq!(list.1.len(), good.1.len(), "byte {i}");
            }
        }
        let empty = serdes(MemoryKind::Dram, 0, &[]);
        assert!(parse_serdes(&empty).is_err(), "no descriptor");
        assert!(unpickle(&pickle(&[0; 300], "os._bindings")).is_ok());
        let evil = pickle(b"x", "builtins");
        assert!(unpickle(&evil).is_err(), "only a NIXL bindings' class");
        // CPython frames a large state's opcodes only, writing its bytes after the frame.
        let mut big = pickle(&[7; 100_000], PYTHON_BINDINGS);
        big[3..11].copy_from_slice(&38u64.to_le_bytes());
        assert_eq!(unpickle(&big).unwrap().len(), 100_000);
        let past = big.len() as u64;
        big[3..11].copy_from_slice(&past.to_le_bytes());
        assert!(unpickle(&big).is_err(), "a frame past the end");
    }
}
