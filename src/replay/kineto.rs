//! `torch.profiler` Chrome traces (`profile_memory=True`): the `[memory]` events of CUDA devices.
//!
//! The JSON is read as a stream: the top object's other members are skipped unread, and
//! `traceEvents` is visited one event at a time — an event's `name`, `ts` and `args` are kept as
//! borrowed text, everything else skipped — so only `[memory]` events are kept (at most
//! [`MAX_TRACE_EVENTS`](super::limits::MAX_TRACE_EVENTS)), never a tree of the whole file.
//! Skipped values and raw text are passed over by `serde_json` without recursion; what is parsed
//! into fields is bounded by its recursion limit ([`super::limits::MAX_JSON_DEPTH`]).

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::builder::{Builder, EventCount, TraceFormat};
use super::limits::bad;
use super::Trace;
use crate::error::{Error, Result};

#[derive(serde::Deserialize)]
struct ChromeEvent<'a> {
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    ts: Option<&'a RawValue>,
    #[serde(borrow, default)]
    args: Option<&'a RawValue>,
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

/// A `[memory]` event of a CUDA device: (time, device, bytes, address).
type Memory = (f64, usize, i64, Option<u64>);

/// What reading the events found: the memory events, or the trace's own error (kept apart from
/// `serde_json`'s so that it reaches the caller as it was made).
#[derive(Default)]
struct Found {
    memory: Vec<Memory>,
    events: EventCount,
    error: Option<Error>,
    seen: bool,
}

impl Found {
    fn event(&mut self, n: usize, e: &ChromeEvent<'_>) -> Result<()> {
        if e.name.as_deref() != Some("[memory]") {
            return Ok(());
        }
        let at = |what: &str| bad(format!("traceEvents[{n}] ([memory]): {what}"));
        let args: MemoryArgs = serde_json::from_str(e.args.ok_or_else(|| at("no args"))?.get())
            .map_err(|err| at(&format!("args: {err}")))?;
        if args.device_type != 1 {
            return Ok(()); // CPU memory
        }
        let ts: f64 = serde_json::from_str(e.ts.ok_or_else(|| at("no ts"))?.get())
            .map_err(|err| at(&format!("ts: {err}")))?;
        let device = usize::try_from(args.device_id).map_err(|_| at("Device Id"))?;
        self.events.one()?;
        self.memory
            .try_reserve(1)
            .map_err(|_| bad("cannot allocate memory for the events"))?;
        self.memory.push((ts, device, args.bytes, args.addr));
        Ok(())
    }
}

/// The top object: `traceEvents` read, the rest skipped.
struct Top<'f>(&'f mut Found);

impl<'de> Visitor<'de> for Top<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Chrome trace object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == "traceEvents" && !self.0.seen {
                self.0.seen = true;
                map.next_value_seed(Events(&mut *self.0))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// `traceEvents`, one event at a time.
struct Events<'f>(&'f mut Found);

impl<'de> DeserializeSeed<'de> for Events<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Events<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of trace events")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut n = 0;
        while let Some(e) = seq.next_element::<ChromeEvent<'de>>()? {
            if let Err(err) = self.0.event(n, &e) {
                // Stop reading; the trace's error is the one reported.
                self.0.error = Some(err);
                return Err(serde::de::Error::custom("stopped"));
            }
            n += 1;
        }
        Ok(())
    }
}

pub(super) fn kineto(text: &str) -> Result<Trace> {
    let mut found = Found::default();
    let mut de = serde_json::Deserializer::from_str(text);
    let read =
        serde::Deserializer::deserialize_map(&mut de, Top(&mut found)).and_then(|()| de.end());
    if let Some(err) = found.error.take() {
        return Err(err);
    }
    read.map_err(|e| bad(format!("Chrome trace JSON: {e}")))?;
    if !found.seen {
        return Err(bad("Chrome trace JSON: no traceEvents"));
    }
    let mut memory = found.memory;
    memory.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut b = Builder::default();
    for (_, device, bytes, addr) in memory {
        let size = bytes.unsigned_abs();
        match (bytes > 0, addr) {
            (true, Some(addr)) => b.alloc_at(device, addr, size, 0)?,
            (true, None) => b.alloc_sized(device, size, 0)?,
            (false, Some(addr)) => b.free_or_count(device, addr)?,
            (false, None) => b.free_sized(device, size)?,
        }
    }
    b.finish(TraceFormat::KinetoChrome)
}
