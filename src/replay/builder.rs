//! What every trace reader builds with: [`Builder`] turns allocations and frees as a format
//! names them (by address, or by size where a format has no address) into the list of
//! [`TraceOp`]s a replay runs, within the limits of [`super::limits`]; [`EventCount`] bounds the
//! events a reader looks at; [`TraceFormat`] names where a trace came from. The readers
//! (`formats.rs`, `kineto.rs`, `snapshot.rs`) sit above this file and never name each other's
//! parts.

use std::collections::{HashMap, HashSet};

use super::limits::{bad, exceeded, MAX_SIM_DEVICES, MAX_TRACE_EVENTS, MAX_TRACE_STREAMS};
use super::{Trace, TraceOp};
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

/// Counts events read from a trace against [`MAX_TRACE_EVENTS`].
#[derive(Default)]
pub(super) struct EventCount(usize);

impl EventCount {
    /// One more event.
    pub(super) fn one(&mut self) -> Result<()> {
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

    pub(super) fn alloc_at(
        &mut self,
        device: usize,
        addr: u64,
        size: u64,
        stream: u64,
    ) -> Result<()> {
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
    pub(super) fn free_or_count(&mut self, device: usize, addr: u64) -> Result<()> {
        if !self.free_at(device, addr)? {
            self.unmatched_frees += 1;
        }
        Ok(())
    }

    pub(super) fn alloc_sized(&mut self, device: usize, size: u64, stream: u64) -> Result<()> {
        if let Some(id) = self.alloc(device, size, stream)? {
            self.by_size.entry((device, size)).or_default().push(id);
        }
        Ok(())
    }

    pub(super) fn free_sized(&mut self, device: usize, size: u64) -> Result<()> {
        match self.by_size.get_mut(&(device, size)).and_then(Vec::pop) {
            Some(id) => self.push(TraceOp::Free { id }),
            None => {
                self.unmatched_frees += 1;
                Ok(())
            }
        }
    }

    pub(super) fn finish(self, format: TraceFormat) -> Result<Trace> {
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
