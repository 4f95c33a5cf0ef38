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

use std::collections::{HashMap, HashSet};

use super::limits::{self, bad, exceeded, MAX_SIM_DEVICES, MAX_TRACE_EVENTS, MAX_TRACE_STREAMS};
use super::{kineto, snapshot, Trace, TraceOp};
use crate::error::Result;

/// Which format a trace was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TraceFormat {
    /// cudalloc's trace ring as JSON lines.
    CudallocJsonLines,
    /// A pickled PyTorch memory snapshot (its `device_traces`).
    PytorchSnapshot,
    /// A `torch.profiler` Chrome trace with memory events.
    KinetoChrome,
    /// An RMM `logging_resource_adaptor` CSV log.
    RmmCsv,
}

impl TraceFormat {
    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::CudallocJsonLines => "cudalloc trace (JSON lines)",
            TraceFormat::PytorchSnapshot => "PyTorch memory snapshot (pickle)",
            TraceFormat::KinetoChrome => "torch.profiler Chrome trace",
            TraceFormat::RmmCsv => "RMM log (CSV)",
        }
    }
}

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

/// Counts events read from a trace against [`MAX_TRACE_EVENTS`].
#[derive(Default)]
pub(super) struct EventCount(usize);

impl EventCount {
    /// One more event.
    pub fn one(&mut self) -> Result<()> {
        self.0 += 1;
        if self.0 > MAX_TRACE_EVENTS {
            return Err(exceeded(
                format!("more than {MAX_TRACE_EVENTS} events"),
                "MAX_TRACE_EVENTS",
                MAX_TRACE_EVENTS,
            ));
        }
        Ok(())
    }
}

/// Turns events into operations, pairing frees with live allocations.
#[derive(Default)]
pub(super) struct Builder {
    ops: Vec<TraceOp>,
    next_id: u64,
    by_addr: HashMap<(usize, u64), u64>,
    /// Live allocations by (device, size), most recent last (for traces without addresses).
    by_size: HashMap<(usize, u64), Vec<u64>>,
    streams: HashSet<(usize, u64)>,
    unmatched_frees: u64,
    devices: usize,
}

impl Builder {
    fn alloc(&mut self, device: usize, size: u64, stream: u64) -> Result<Option<u64>> {
        if size == 0 {
            return Ok(None);
        }
        if device >= MAX_SIM_DEVICES {
            return Err(exceeded(
                format!("device ordinal {device} is not plausible"),
                "MAX_SIM_DEVICES",
                MAX_SIM_DEVICES,
            ));
        }
        if self.streams.insert((device, stream)) && self.streams.len() > MAX_TRACE_STREAMS {
            return Err(exceeded(
                format!("more than {MAX_TRACE_STREAMS} streams allocate"),
                "MAX_TRACE_STREAMS",
                MAX_TRACE_STREAMS,
            ));
        }
        self.next_id += 1;
        let id = self.next_id;
        self.devices = self.devices.max(device + 1);
        self.push(TraceOp::Alloc {
            id,
            device,
            size,
            stream,
        })?;
        Ok(Some(id))
    }

    fn push(&mut self, op: TraceOp) -> Result<()> {
        if self.ops.len() >= MAX_TRACE_EVENTS {
            return Err(exceeded(
                format!("more than {MAX_TRACE_EVENTS} operations"),
                "MAX_TRACE_EVENTS",
                MAX_TRACE_EVENTS,
            ));
        }
        self.ops
            .try_reserve(1)
            .map_err(|_| bad("cannot allocate memory for the operations"))?;
        self.ops.push(op);
        Ok(())
    }

    pub fn alloc_at(&mut self, device: usize, addr: u64, size: u64, stream: u64) -> Result<()> {
        if let Some(id) = self.alloc(device, size, stream)? {
            if let Some(old) = self.by_addr.insert((device, addr), id) {
                // The trace lost this address's free: the old allocation stays live.
                tracing::debug!(old, addr, "trace: address reused without a free");
            }
        }
        Ok(())
    }

    fn free_at(&mut self, device: usize, addr: u64) -> Result<bool> {
        match self.by_addr.remove(&(device, addr)) {
            Some(id) => self.push(TraceOp::Free { id }).map(|()| true),
            None => Ok(false),
        }
    }

    /// Frees the allocation at `addr`, or counts an unmatched free.
    pub fn free_or_count(&mut self, device: usize, addr: u64) -> Result<()> {
        if !self.free_at(device, addr)? {
            self.unmatched_frees += 1;
        }
        Ok(())
    }

    pub fn alloc_sized(&mut self, device: usize, size: u64, stream: u64) -> Result<()> {
        if let Some(id) = self.alloc(device, size, stream)? {
            self.by_size.entry((device, size)).or_default().push(id);
        }
        Ok(())
    }

    pub fn free_sized(&mut self, device: usize, size: u64) -> Result<()> {
        match self.by_size.get_mut(&(device, size)).and_then(Vec::pop) {
            Some(id) => self.push(TraceOp::Free { id }),
            None => {
                self.unmatched_frees += 1;
                Ok(())
            }
        }
    }

    pub fn finish(self, format: TraceFormat) -> Result<Trace> {
        if self.ops.is_empty() {
            return Err(bad(format!(
                "no allocations found in this {}",
                format.name()
            )));
        }
        Ok(Trace {
            format,
            ops: self.ops,
            unmatched_frees: self.unmatched_frees,
            devices: self.devices.max(1),
        })
    }
}

/// Events with PyTorch's trace actions (snapshots and cudalloc's JSON lines).
pub(super) fn trace_action(
    b: &mut Builder,
    device: usize,
    action: &[u8],
    addr: u64,
    size: u64,
    stream: u64,
) -> Result<()> {
    match action {
        b"alloc" => b.alloc_at(device, addr, size, stream),
        b"free_requested" => b.free_or_count(device, addr),
        // Only when the request was not recorded (the ring dropped it, or history was
        // alloc-only): otherwise the address is no longer live and this is no event.
        b"free_completed" => b.free_at(device, addr).map(|_| ()),
        _ => Ok(()), // segment_*, oom, snapshot: the allocator under replay decides those
    }
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
