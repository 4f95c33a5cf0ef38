//! The bounds on reading a trace. A trace file is untrusted input: whatever its bytes, reading it
//! takes memory and time bounded by its size and by these limits, and every limit it passes is an
//! [`InvalidArgument`](crate::ErrorKind::InvalidArgument) error whose message names the limit and
//! its value (`… (limit MAX_GZIP_LAYERS = 2)`) — never a panic, an abort on a failed allocation, a
//! stack overflow or a hang.
//!
//! | limit | value | bounds |
//! |---|---|---|
//! | [`MAX_TRACE_BYTES`] | 1 GiB | the bytes of a trace: the file as read, and every decompressed layer |
//! | [`MAX_GZIP_LAYERS`] | 2 | gzip layers inside one another (a trace is compressed once; twice happens) |
//! | [`MAX_GZIP_RATIO`], [`GZIP_FLOOR_BYTES`] | 64×, 32 MiB | all decompressed layers together: at most 64 times the compressed bytes, or 32 MiB when that is more (and [`MAX_TRACE_BYTES`]) — a gzip "bomb" stops there (real traces compress far less: the ResNet-50 `torch.profiler` trace in `shared/traces`, 30×); decompress a trace that compresses better yourself |
//! | [`MAX_TRACE_EVENTS`] | 2²⁵ (33,554,432) | events kept from a trace: JSON lines, CSV lines, `[memory]` events, snapshot trace entries |
//! | [`MAX_TRACE_STREAMS`] | 65,536 | distinct (device, stream) pairs that allocate (each is a stream of the replay) |
//! | [`MAX_SIM_DEVICES`] | 1,024 | devices (`driver::sim`) |
//! | [`MAX_PICKLE_DEPTH`] | 64 | nesting of lists, tuples, dicts and sets in a pickle (a snapshot nests 8 deep) |
//! | [`PICKLE_MEMORY_RATIO`], [`PICKLE_MEMORY_FLOOR`], [`MAX_PICKLE_MEMORY`] | 16×, 1 MiB, 4 GiB | the pickle reader's own structures (values, containers, their items, its stack and memo): at most 16 times the pickle's bytes, or 1 MiB when that is more, and 4 GiB |
//! | [`MAX_JSON_DEPTH`] | 128 | nesting of JSON parsed into fields: `serde_json`'s recursion limit (its `unbounded_depth` feature is enabled nowhere in the build); what is skipped, or kept as raw text, `serde_json` passes over with a loop, at any depth, in constant stack |
//!
//! What else holds without a named limit: a length prefix in a pickle is checked against the
//! bytes left before anything is taken (strings are borrowed from the input, never copied); the
//! pickle reader is a loop over opcodes with an explicit stack (no recursion), keeps containers by
//! index (a memo reference is an index, never a copy, so a small pickle cannot expand into a big
//! tree), and the snapshot is read at fixed depths, no big dict twice; JSON is read without building
//! trees (typed fields, unknown ones skipped, `[memory]` events kept one at a time); a CSV line is
//! split into its first seven fields only. Buffers grow with `try_reserve`: a failed allocation
//! is an error too.

use std::borrow::Cow;
use std::io::Read;

use crate::error::{Error, Result};

/// The most bytes of a trace: the file as read, and every decompressed layer.
pub const MAX_TRACE_BYTES: u64 = 1 << 30;
/// The most gzip layers inside one another.
pub const MAX_GZIP_LAYERS: usize = 2;
/// All decompressed layers together hold at most this many times the compressed bytes (or
/// [`GZIP_FLOOR_BYTES`], when that is more; never more than [`MAX_TRACE_BYTES`]).
pub const MAX_GZIP_RATIO: u64 = 64;
/// What any gzip'd trace may decompress to, whatever its compressed size.
pub const GZIP_FLOOR_BYTES: u64 = 32 << 20;
/// The most events kept from a trace (lines, `[memory]` events, snapshot trace entries).
pub const MAX_TRACE_EVENTS: usize = 1 << 25;
/// The most distinct (device, stream) pairs that allocate.
pub const MAX_TRACE_STREAMS: usize = 1 << 16;
/// The most simulated devices (a trace naming device 10⁹ is corrupt, not a machine).
pub const MAX_SIM_DEVICES: usize = crate::driver::sim::MAX_SIM_DEVICES;
/// The deepest nesting of containers in a pickle.
pub const MAX_PICKLE_DEPTH: usize = 64;
/// The pickle reader's structures hold at most this many times the pickle's bytes (or
/// [`PICKLE_MEMORY_FLOOR`], when that is more; never more than [`MAX_PICKLE_MEMORY`]).
pub const PICKLE_MEMORY_RATIO: u64 = 16;
/// What the pickle reader's structures may hold, whatever the pickle's size.
pub const PICKLE_MEMORY_FLOOR: u64 = 1 << 20;
/// The most bytes the pickle reader's structures hold.
pub const MAX_PICKLE_MEMORY: u64 = 4 << 30;
/// The deepest nesting of JSON parsed into fields (`serde_json`'s recursion limit, which applies;
/// skipped values are passed over without recursion).
pub const MAX_JSON_DEPTH: usize = 128;

/// A malformed trace (`what` says where and why).
pub(super) fn bad(what: impl std::fmt::Display) -> Error {
    Error::invalid(format!("trace: {what}"))
}

/// A trace past one of the limits: `what` happened, `name` is the limit, `value` its value.
pub(super) fn exceeded(
    what: impl std::fmt::Display,
    name: &str,
    value: impl std::fmt::Display,
) -> Error {
    bad(format!("{what} (limit {name} = {value})"))
}

/// How much a gzip'd trace of `compressed` bytes may decompress to, all layers together.
pub(super) fn gzip_allowance(compressed: usize) -> u64 {
    (compressed as u64)
        .saturating_mul(MAX_GZIP_RATIO)
        .clamp(GZIP_FLOOR_BYTES, MAX_TRACE_BYTES)
}

/// Why [`read_bounded`] stopped short.
pub(super) enum Short {
    /// The reader failed.
    Io(std::io::Error),
    /// More than the limit.
    Limit,
    /// The buffer could not grow to this many bytes.
    Alloc(usize),
}

impl Short {
    /// The error: `io` says what an I/O failure was reading, `limit` what passing the limit is.
    fn into_error(
        self,
        io: impl FnOnce(std::io::Error) -> Error,
        limit: impl FnOnce() -> Error,
    ) -> Error {
        match self {
            Short::Io(e) => io(e),
            Short::Limit => limit(),
            Short::Alloc(n) => bad(format!("cannot allocate {n} bytes for the trace")),
        }
    }
}

/// Reads all of `reader`, refusing more than `limit` bytes.
pub(super) fn read_bounded(
    mut reader: impl Read,
    limit: u64,
) -> std::result::Result<Vec<u8>, Short> {
    const CHUNK: usize = 1 << 16;
    let mut out: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; CHUNK];
    loop {
        let n = match reader.read(&mut chunk) {
            Ok(0) => return Ok(out),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Short::Io(e)),
        };
        if out.len() as u64 + n as u64 > limit {
            return Err(Short::Limit);
        }
        out.try_reserve(n)
            .map_err(|_| Short::Alloc(out.len() + n))?;
        out.extend_from_slice(&chunk[..n]);
    }
}

/// The gzip magic.
const GZIP: [u8; 2] = [0x1f, 0x8b];

/// `bytes` with its gzip layers (if any) taken off, within the limits above.
pub(super) fn inflate(bytes: &[u8]) -> Result<Cow<'_, [u8]>> {
    if bytes.len() as u64 > MAX_TRACE_BYTES {
        return Err(exceeded(
            format!("{} bytes", bytes.len()),
            "MAX_TRACE_BYTES",
            MAX_TRACE_BYTES,
        ));
    }
    let allowance = gzip_allowance(bytes.len());
    let mut used = 0u64;
    let mut layers = 0usize;
    let mut current = Cow::Borrowed(bytes);
    while current.starts_with(&GZIP) {
        layers += 1;
        if layers > MAX_GZIP_LAYERS {
            return Err(exceeded(
                "more gzip layers inside one another",
                "MAX_GZIP_LAYERS",
                MAX_GZIP_LAYERS,
            ));
        }
        let decoder = flate2::read::MultiGzDecoder::new(&current[..]);
        let out = read_bounded(decoder, allowance - used).map_err(|short| {
            short.into_error(
                |e| bad(format!("gzip: {e}")),
                || {
                    exceeded(
                        format!(
                            "the gzip'd trace of {} bytes decompresses to more than {allowance} \
                             bytes (decompress it yourself if it is genuine)",
                            bytes.len()
                        ),
                        "MAX_GZIP_RATIO",
                        format!(
                            "{MAX_GZIP_RATIO}, with GZIP_FLOOR_BYTES = {GZIP_FLOOR_BYTES} and \
                             MAX_TRACE_BYTES = {MAX_TRACE_BYTES}"
                        ),
                    )
                },
            )
        })?;
        used += out.len() as u64;
        current = Cow::Owned(out);
    }
    Ok(current)
}

/// Reads the file at `path`, at most [`MAX_TRACE_BYTES`].
pub(super) fn read_file(path: &std::path::Path) -> Result<Vec<u8>> {
    let cannot = |e: std::io::Error| bad(format!("cannot read {}: {e}", path.display()));
    let too_big = || {
        exceeded(
            format!("{} is larger than {MAX_TRACE_BYTES} bytes", path.display()),
            "MAX_TRACE_BYTES",
            MAX_TRACE_BYTES,
        )
    };
    let file = std::fs::File::open(path).map_err(cannot)?;
    if file.metadata().is_ok_and(|m| m.len() > MAX_TRACE_BYTES) {
        return Err(too_big());
    }
    read_bounded(file, MAX_TRACE_BYTES).map_err(|short| short.into_error(cannot, too_big))
}
