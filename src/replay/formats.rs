//! Reading allocation traces: four formats into one list of [`TraceOp`]s.
//!
//! | format | how it is recognized | allocations | frees paired to allocations by |
//! |---|---|---|---|
//! | cudalloc JSON lines ([`crate::alloc::trace_json_lines`]) | lines of `{"action": …}` | `alloc` | address (`free_requested`; `free_completed` when no request was recorded) |
//! | PyTorch snapshot (`torch.cuda.memory._snapshot()` pickled) | pickle protocol byte | `device_traces` `alloc` | address, as above |
//! | `torch.profiler` Chrome trace (`profile_memory=True`) | JSON with `traceEvents` | `[memory]` events of CUDA devices with `Bytes > 0` | `Addr` when present, else size — the most recent live allocation of that size |
//! | RMM `logging_resource_adaptor` CSV | header `Thread,Time,Action,Pointer,Size,Stream` | `allocate` | pointer |
//!
//! Any of them may be gzip-compressed. A file is untrusted input: a malformed line or value is an
//! error naming where it is, never a panic; a free that matches no live allocation is counted
//! (`unmatched_frees`) and skipped, as is an allocation of 0 bytes.

use std::collections::HashMap;
use std::io::Read;

use super::{Trace, TraceOp};
use crate::error::{Error, Result};

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

fn bad(what: impl std::fmt::Display) -> Error {
    Error::invalid(format!("trace: {what}"))
}

/// Reads the trace in the file at `path` (any of the formats, possibly gzip'd).
pub fn load(path: &std::path::Path) -> Result<Trace> {
    let bytes =
        std::fs::read(path).map_err(|e| bad(format!("cannot read {}: {e}", path.display())))?;
    parse(&bytes)
}

/// Reads a trace from its bytes (any of the formats, possibly gzip'd).
pub fn parse(bytes: &[u8]) -> Result<Trace> {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut out)
            .map_err(|e| bad(format!("gzip: {e}")))?;
        return parse(&out);
    }
    if bytes.first() == Some(&0x80) {
        return pytorch_snapshot(bytes);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8 text and not a pickle"))?;
    let start = text.trim_start();
    if start.starts_with("Thread,Time,Action,Pointer,Size,Stream") {
        return rmm_csv(start);
    }
    if start.starts_with('{') {
        let first_line = start.lines().next().unwrap_or("");
        if serde_json::from_str::<serde_json::Value>(first_line)
            .is_ok_and(|v| v.get("action").is_some())
        {
            return cudalloc_json_lines(start);
        }
        return kineto(start);
    }
    Err(bad(
        "unknown format (expected cudalloc JSON lines, a PyTorch snapshot pickle, a torch.profiler \
         Chrome trace or an RMM CSV log)",
    ))
}

/// Turns events into operations, pairing frees with live allocations.
#[derive(Default)]
struct Builder {
    ops: Vec<TraceOp>,
    next_id: u64,
    by_addr: HashMap<(usize, u64), u64>,
    /// Live allocations by (device, size), most recent last (for traces without addresses).
    by_size: HashMap<(usize, u64), Vec<u64>>,
    unmatched_frees: u64,
    devices: usize,
}

impl Builder {
    fn alloc(&mut self, device: usize, size: u64, stream: u64) -> Option<u64> {
        if size == 0 {
            return None;
        }
        self.next_id += 1;
        let id = self.next_id;
        self.devices = self.devices.max(device + 1);
        self.ops.push(TraceOp::Alloc {
            id,
            device,
            size,
            stream,
        });
        Some(id)
    }

    fn alloc_at(&mut self, device: usize, addr: u64, size: u64, stream: u64) {
        if let Some(id) = self.alloc(device, size, stream) {
            if let Some(old) = self.by_addr.insert((device, addr), id) {
                // The trace lost this address's free: the old allocation stays live.
                tracing::debug!(old, addr, "trace: address reused without a free");
            }
        }
    }

    fn free_at(&mut self, device: usize, addr: u64) -> bool {
        match self.by_addr.remove(&(device, addr)) {
            Some(id) => {
                self.ops.push(TraceOp::Free { id });
                true
            }
            None => false,
        }
    }

    /// Frees the allocation at `addr`, or counts an unmatched free.
    fn free_or_count(&mut self, device: usize, addr: u64) {
        if !self.free_at(device, addr) {
            self.unmatched_frees += 1;
        }
    }

    fn alloc_sized(&mut self, device: usize, size: u64, stream: u64) {
        if let Some(id) = self.alloc(device, size, stream) {
            self.by_size.entry((device, size)).or_default().push(id);
        }
    }

    fn free_sized(&mut self, device: usize, size: u64) {
        match self.by_size.get_mut(&(device, size)).and_then(Vec::pop) {
            Some(id) => self.ops.push(TraceOp::Free { id }),
            None => self.unmatched_frees += 1,
        }
    }

    fn finish(self, format: TraceFormat) -> Result<Trace> {
        if self.devices > crate::driver::sim::MAX_SIM_DEVICES {
            return Err(bad(format!(
                "device ordinal {} is not plausible (at most {} devices)",
                self.devices - 1,
                crate::driver::sim::MAX_SIM_DEVICES
            )));
        }
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
fn trace_action(b: &mut Builder, device: usize, action: &str, addr: u64, size: u64, stream: u64) {
    match action {
        "alloc" => b.alloc_at(device, addr, size, stream),
        "free_requested" => b.free_or_count(device, addr),
        // Only when the request was not recorded (the ring dropped it, or history was
        // alloc-only): otherwise the address is no longer live and this is no event.
        "free_completed" => {
            b.free_at(device, addr);
        }
        _ => {} // segment_*, oom, snapshot: the allocator under replay decides those
    }
}

fn cudalloc_json_lines(text: &str) -> Result<Trace> {
    let mut b = Builder::default();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |what: &str| bad(format!("line {}: {what}", n + 1));
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(&format!("not JSON ({e})")))?;
        let field = |key: &str| v.get(key).and_then(serde_json::Value::as_u64);
        let action = v
            .get("action")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| at("no \"action\""))?;
        let device = usize::try_from(field("device").unwrap_or(0)).map_err(|_| at("device"))?;
        let addr = field("addr").ok_or_else(|| at("no \"addr\""))?;
        let size = field("size").ok_or_else(|| at("no \"size\""))?;
        trace_action(
            &mut b,
            device,
            action,
            addr,
            size,
            field("stream").unwrap_or(0),
        );
    }
    b.finish(TraceFormat::CudallocJsonLines)
}

fn pytorch_snapshot(bytes: &[u8]) -> Result<Trace> {
    use serde_pickle::{HashableValue as H, Value as V};
    let value = serde_pickle::value_from_slice(bytes, serde_pickle::DeOptions::new())
        .map_err(|e| bad(format!("pickle: {e}")))?;
    let V::Dict(top) = value else {
        return Err(bad("a PyTorch snapshot is a dict"));
    };
    let traces = match top.get(&H::String("device_traces".into())) {
        Some(V::List(devices)) => devices,
        _ => {
            return Err(bad(
                "this snapshot has no device_traces (record it with torch.cuda.memory._record_memory_history())",
            ))
        }
    };
    let int = |entry: &std::collections::BTreeMap<H, V>, key: &str| -> Option<u64> {
        match entry.get(&H::String(key.into()))? {
            V::I64(i) => u64::try_from(*i).ok(),
            V::Int(big) => u64::try_from(big).ok(),
            _ => None,
        }
    };
    let mut b = Builder::default();
    // Entries of all devices in time order (each device's list is in order already).
    let mut events = Vec::new();
    for (device, list) in traces.iter().enumerate() {
        let V::List(entries) = list else {
            return Err(bad(format!("device_traces[{device}] is not a list")));
        };
        for (i, e) in entries.iter().enumerate() {
            let V::Dict(entry) = e else {
                return Err(bad(format!("device_traces[{device}][{i}] is not a dict")));
            };
            events.push((int(entry, "time_us").unwrap_or(0), device, i, entry));
        }
    }
    events.sort_by_key(|&(time, device, i, _)| (time, device, i));
    for (_, device, i, entry) in events {
        let at = || format!("device_traces[{device}][{i}]");
        let action = match entry.get(&H::String("action".into())) {
            Some(V::String(s)) => s.as_str(),
            _ => return Err(bad(format!("{}: no action", at()))),
        };
        let addr = int(entry, "addr").ok_or_else(|| bad(format!("{}: no addr", at())))?;
        let size = int(entry, "size").ok_or_else(|| bad(format!("{}: no size", at())))?;
        let stream = int(entry, "stream").unwrap_or(0);
        trace_action(&mut b, device, action, addr, size, stream);
    }
    b.finish(TraceFormat::PytorchSnapshot)
}

/// A Chrome trace, read lazily: only `[memory]` events' fields are decoded.
#[derive(serde::Deserialize)]
struct ChromeTrace<'a> {
    #[serde(rename = "traceEvents", borrow)]
    events: Vec<ChromeEvent<'a>>,
}

#[derive(serde::Deserialize)]
struct ChromeEvent<'a> {
    #[serde(borrow, default)]
    name: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    ts: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    args: Option<&'a serde_json::value::RawValue>,
}

/// The arguments of a `[memory]` event.
#[derive(serde::Deserialize)]
struct MemoryArgs {
    #[serde(rename = "Device Type")]
    device_type: i64,
    /// -1 for CPU memory.
    #[serde(rename = "Device Id", default)]
    device_id: i64,
    #[serde(rename = "Bytes")]
    bytes: i64,
    #[serde(rename = "Addr", default)]
    addr: Option<u64>,
}

fn kineto(text: &str) -> Result<Trace> {
    let trace: ChromeTrace<'_> =
        serde_json::from_str(text).map_err(|e| bad(format!("Chrome trace JSON: {e}")))?;
    let mut memory: Vec<(f64, usize, i64, Option<u64>)> = Vec::new();
    for (n, e) in trace.events.iter().enumerate() {
        if e.name.as_deref() != Some("[memory]") {
            continue;
        }
        let at = |what: &str| bad(format!("traceEvents[{n}] ([memory]): {what}"));
        let args: MemoryArgs = serde_json::from_str(e.args.ok_or_else(|| at("no args"))?.get())
            .map_err(|err| at(&format!("args: {err}")))?;
        if args.device_type != 1 {
            continue; // CPU memory
        }
        let ts: f64 = serde_json::from_str(e.ts.ok_or_else(|| at("no ts"))?.get())
            .map_err(|err| at(&format!("ts: {err}")))?;
        let device = usize::try_from(args.device_id).map_err(|_| at("Device Id"))?;
        memory.push((ts, device, args.bytes, args.addr));
    }
    memory.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut b = Builder::default();
    for (_, device, bytes, addr) in memory {
        let size = bytes.unsigned_abs();
        match (bytes > 0, addr) {
            (true, Some(addr)) => b.alloc_at(device, addr, size, 0),
            (true, None) => b.alloc_sized(device, size, 0),
            (false, Some(addr)) => b.free_or_count(device, addr),
            (false, None) => b.free_sized(device, size),
        }
    }
    b.finish(TraceFormat::KinetoChrome)
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
    for (n, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        let at = |what: &str| bad(format!("line {}: {what}", n + 1));
        let cols: Vec<&str> = line.split(',').collect();
        if cols.len() < 6 {
            return Err(at("expected Thread,Time,Action,Pointer,Size,Stream"));
        }
        let addr = number(cols[3]).ok_or_else(|| at("pointer"))?;
        let size = number(cols[4]).ok_or_else(|| at("size"))?;
        let stream = number(cols[5]).unwrap_or(0);
        match cols[2].trim() {
            "allocate" => b.alloc_at(0, addr, size, stream),
            "free" => b.free_or_count(0, addr),
            "allocate failure" => {}
            other => return Err(at(&format!("unknown action {other:?}"))),
        }
    }
    b.finish(TraceFormat::RmmCsv)
}
