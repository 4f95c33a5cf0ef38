//! PyTorch memory snapshots (`torch.cuda.memory._snapshot()`, pickled): their `device_traces`.
//!
//! The pickle is read by the bounded reader (`pickle.rs`); the snapshot is then read at fixed
//! depths — the top dict, `device_traces`, one list per device, one dict per entry — with no
//! recursion, at most [`MAX_TRACE_EVENTS`](super::limits::MAX_TRACE_EVENTS) entries in all, and
//! no dict of more than a few dozen keys read twice (so an entry the pickle refers to again and
//! again costs its size once).

use std::collections::HashMap;

use super::builder::{trace_action, Builder, EventCount, TraceFormat};
use super::limits::{bad, exceeded, MAX_PICKLE_MEMORY, PICKLE_MEMORY_FLOOR, PICKLE_MEMORY_RATIO};
use super::pickle::{self, Id, Pickle};
use super::Trace;
use crate::error::Result;

/// Entry dicts of at most this many keys and values are read again where they repeat (a
/// snapshot's have about 16); bigger ones are read once.
const REREAD_ITEMS: usize = 64;

/// The fields of a trace entry that a replay reads.
#[derive(Clone, Copy)]
struct Entry<'a> {
    action: &'a [u8],
    addr: u64,
    size: u64,
    stream: u64,
    time_us: u64,
}

fn entry<'p>(p: &'p Pickle<'_>, e: Id, device: usize, i: usize) -> Result<Entry<'p>> {
    let at = |what: &str| bad(format!("device_traces[{device}][{i}]{what}"));
    let items = p.dict(e).ok_or_else(|| at(" is not a dict"))?;
    let int = |key: &str| p.get(items, key).and_then(|v| p.uint(v));
    Ok(Entry {
        action: p
            .get(items, "action")
            .and_then(|v| p.text(v))
            .ok_or_else(|| at(": no action"))?,
        addr: int("addr").ok_or_else(|| at(": no addr"))?,
        size: int("size").ok_or_else(|| at(": no size"))?,
        stream: int("stream").unwrap_or(0),
        time_us: int("time_us").unwrap_or(0),
    })
}

pub(super) fn pytorch_snapshot(bytes: &[u8]) -> Result<Trace> {
    let p = pickle::read(bytes)?;
    let top = p
        .dict(p.root)
        .ok_or_else(|| bad("a PyTorch snapshot is a dict"))?;
    let traces = p
        .get(top, "device_traces")
        .and_then(|v| p.list(v))
        .ok_or_else(|| {
            bad("this snapshot has no device_traces (record it with \
                 torch.cuda.memory._record_memory_history())")
        })?;
    // Entries of all devices in time order (each device's list is in order already).
    let mut read: HashMap<Id, Entry<'_>> = HashMap::new();
    let mut events: Vec<(u64, usize, usize, Entry<'_>)> = Vec::new();
    // The entries count against the pickle's memory budget too: memo references make an entry
    // cost two input bytes, and each takes tens of bytes here.
    let budget = (bytes.len() as u64)
        .saturating_mul(PICKLE_MEMORY_RATIO)
        .clamp(PICKLE_MEMORY_FLOOR, MAX_PICKLE_MEMORY);
    let most_entries = budget / std::mem::size_of::<(u64, usize, usize, Entry<'_>)>() as u64;
    let mut count = EventCount::default();
    for (device, &list) in traces.iter().enumerate() {
        let entries = p
            .list(list)
            .ok_or_else(|| bad(format!("device_traces[{device}] is not a list")))?;
        for (i, &e) in entries.iter().enumerate() {
            count.one()?;
            // An entry is a small dict, read again wherever it repeats; a big one (which no
            // snapshot writes, but a pickle may refer to again and again) is read once.
            let fields = match read.get(&e) {
                Some(fields) => *fields,
                None => {
                    let fields = entry(&p, e, device, i)?;
                    if p.dict(e).is_some_and(|items| items.len() > REREAD_ITEMS) {
                        read.insert(e, fields);
                    }
                    fields
                }
            };
            if events.len() as u64 >= most_entries {
                return Err(exceeded(
                    format!("the snapshot's entries take more than {budget} bytes"),
                    "PICKLE_MEMORY_RATIO",
                    PICKLE_MEMORY_RATIO,
                ));
            }
            events
                .try_reserve(1)
                .map_err(|_| bad("cannot allocate memory for the snapshot's entries"))?;
            events.push((fields.time_us, device, i, fields));
        }
    }
    events.sort_by_key(|&(time, device, i, _)| (time, device, i));
    let mut b = Builder::default();
    for (_, device, _, e) in events {
        trace_action(&mut b, device, e.action, e.addr, e.size, e.stream)?;
    }
    b.finish(TraceFormat::PytorchSnapshot)
}
