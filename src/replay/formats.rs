//! Reading allocation traces: four formats into one list of [`TraceOp`]s.
//!
//! | format | how it is recognized | allocations | frees paired to allocations by |
//! |---|---|---|---|
//! | cudalloc JSON lines ([`crate::alloc::trace_json_lines`]) | lines of `{"action": …}` | `alloc` | address (`free_requested`; `free_completed` when no request was recorded) |
//! | PyTorch snapshot (`torch.cuda.memory._snapshot()` pickled; `snapshot.rs`) | pickle protocol byte | `device_traces` `alloc` | address, as above |
//! | `torch.profiler` Chrome trace (`profile_memory=True`; `kineto.rs`) | JSON with `traceEvents` | `[memory]` events of CUDA devices with `Bytes > 0` | `Addr` when present, else size — the most recent live allocation of that size |
//! | RMM `logging_resource_adaptor` CSV | header `Thread,Time,Action,Pointer,Size,Stream` | `allocate` | pointer |
//!
//! Any of them may be gzip-compressed. A file is untrusted input: a malformed line or value is an
//! error naming where it is, never a panic; a free that matches no live allocation is counted
//! (`unmatched_frees`) and skipped, as is an allocation of 0 bytes. Reading is bounded in memory,
//! depth and time by the limits of [`super::limits`] (file and decompressed size, gzip layers,
//! events, streams, devices, pickle nesting and memory, JSON nesting).

use super::builder::{trace_action, Builder, EventCount, TraceFormat};
use super::limits::{self, bad};
use super::{kineto, snapshot, Trace};
use crate::error::Result;

/// Reads the trace in the file at `path` (any of the formats, possibly gzip'd; at most
/// [`limits::MAX_TRACE_BYTES`]).
pub fn load(path: &std::path::Path) -> Result<Trace> {
    parse(&limits::read_file(path)?)
}

/// Reads a trace from its bytes (any of the formats, possibly gzip'd), within the limits of
/// [`super::limits`].
pub fn parse(bytes: &[u8]) -> Result<Trace> {
    let bytes = limits::inflate(bytes)?;
    let bytes = &bytes[..];
    if bytes.first() == Some(&0x80) {
        return snapshot::pytorch_snapshot(bytes);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8 text and not a pickle"))?;
    let start = text.trim_start();
    if start.starts_with("Thread,Time,Action,Pointer,Size,Stream") {
        return rmm_csv(start);
    }
    if start.starts_with('{') {
        let first_line = start.lines().next().unwrap_or("");
        if serde_json::from_str::<Line<'_>>(first_line).is_ok_and(|l| l.action.is_some()) {
            return cudalloc_json_lines(start);
        }
        return kineto::kineto(start);
    }
    Err(bad(
        "unknown format (expected cudalloc JSON lines, a PyTorch snapshot pickle, a torch.profiler \
         Chrome trace or an RMM CSV log)",
    ))
}

/// One line of cudalloc's JSON lines: the fields read, others skipped unread (no tree is built;
/// a field's value is checked as JSON, within `serde_json`'s nesting limit, and kept as text).
#[derive(serde::Deserialize)]
struct Line<'a> {
    #[serde(borrow, default)]
    action: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    device: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    addr: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    size: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a serde_json::value::RawValue>,
}

/// A field that is a non-negative integer (anything else reads as absent).
fn u64_field(raw: Option<&serde_json::value::RawValue>) -> Option<u64> {
    serde_json::from_str(raw?.get()).ok()
}

fn cudalloc_json_lines(text: &str) -> Result<Trace> {
    let mut b = Builder::default();
    let mut events = EventCount::default();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        events.one()?;
        let at = |what: &str| bad(format!("line {}: {what}", n + 1));
        let v: Line<'_> = serde_json::from_str(line).map_err(|e| at(&format!("not JSON ({e})")))?;
        let action = v.action.ok_or_else(|| at("no \"action\""))?;
        let device = usize::try_from(u64_field(v.device).unwrap_or(0)).map_err(|_| at("device"))?;
        let addr = u64_field(v.addr).ok_or_else(|| at("no \"addr\""))?;
        let size = u64_field(v.size).ok_or_else(|| at("no \"size\""))?;
        let stream = u64_field(v.stream).unwrap_or(0);
        trace_action(&mut b, device, action.as_bytes(), addr, size, stream)?;
    }
    b.finish(TraceFormat::CudallocJsonLines)
}

fn number(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

fn rmm_csv(text: &str) -> Result<Trace> {
    let mut b = Builder::default();
    let mut events = EventCount::default();
    for (n, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        events.one()?;
        let at = |what: &str| bad(format!("line {}: {what}", n + 1));
        // The first six fields; the rest of the line (if any) stays unsplit.
        let mut cols = [""; 6];
        let mut found = 0;
        for (slot, col) in cols.iter_mut().zip(line.splitn(7, ',')) {
            *slot = col;
            found += 1;
        }
        if found < 6 {
            return Err(at("expected Thread,Time,Action,Pointer,Size,Stream"));
        }
        let addr = number(cols[3]).ok_or_else(|| at("pointer"))?;
        let size = number(cols[4]).ok_or_else(|| at("size"))?;
        let stream = number(cols[5]).unwrap_or(0);
        match cols[2].trim() {
            "allocate" => b.alloc_at(0, addr, size, stream)?,
            "free" => b.free_or_count(0, addr)?,
            "allocate failure" => {}
            other => return Err(at(&format!("unknown action {other:?}"))),
        }
    }
    b.finish(TraceFormat::RmmCsv)
}
