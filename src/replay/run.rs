//! Replaying a trace through the real allocator on the simulated device.
//!
//! Every operation goes through [`Runtime::allocate_on`](crate::Runtime::allocate_on) / a `DataPtr` drop on a
//! [`SimDriver`] of the given capacity and device count, on the device and stream the trace names
//! (stream 0 is the device's default stream, others are created as they appear). After each
//! operation the device's current allocated and reserved bytes are read, so the peaks are exact
//! whatever the number of streams — per device and summed over the devices. The read costs what
//! changed since the last one, not a pass over every stream (`alloc/engine/peaks.rs`), so a trace of
//! thousands of streams replays as fast as one of a few. An allocation that runs out of memory is
//! counted (the first one is reported with its position) and skipped; its free is skipped too.
//! Time is measured around the allocator's calls only.

use std::collections::HashMap;
use std::time::Instant;

use super::{Trace, TraceOp};
use crate::alloc::{CachingAllocator, CachingAllocatorBuilder, DataPtr};
use crate::config::AllocatorConfig;
use crate::driver::{SimDriver, StreamId};
use crate::error::{Error, Result};
use crate::sync::os::Arc;

/// The most points a report keeps for its plot.
const MAX_SAMPLES: usize = 4000;

/// One configuration to replay under.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// Allocator settings in `PYTORCH_CUDA_ALLOC_CONF`'s grammar ("" for PyTorch's defaults).
    pub conf: String,
    /// Capacity of each simulated device in bytes.
    pub capacity: u64,
}

impl ReplayOptions {
    /// Replays with the allocator settings `conf` on simulated devices of `capacity` bytes.
    pub fn new(conf: impl Into<String>, capacity: u64) -> Self {
        ReplayOptions {
            conf: conf.into(),
            capacity,
        }
    }
}

/// Allocated and reserved bytes after operation `op`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sample {
    /// Index of the operation (0-based) after which this was read.
    pub op: u64,
    /// Bytes in allocated blocks (PyTorch's `allocated_bytes.all.current`), all devices.
    pub allocated: u64,
    /// Bytes reserved from the device (`reserved_bytes.all.current`), all devices.
    pub reserved: u64,
}

/// The first allocation that did not fit.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OomAt {
    /// Index of the operation.
    pub op: u64,
    /// Bytes it asked for.
    pub size: u64,
    /// Allocated bytes at that moment.
    pub allocated: u64,
    /// Reserved bytes at that moment.
    pub reserved: u64,
    /// The out-of-memory error's explanation (its message: why the request did not fit).
    pub explanation: String,
}

/// What one replay measured on one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceReport {
    /// Exact peak of allocated bytes on the device.
    pub peak_allocated: u64,
    /// Exact peak of reserved bytes on the device.
    pub peak_reserved: u64,
    /// Most segments held at once on the device.
    pub peak_segments: u64,
    /// Segments (or pages) obtained from the device.
    pub device_mallocs: u64,
    /// Segments (or pages) given back.
    pub device_frees: u64,
}

/// What one replay measured.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ReplayReport {
    /// The configuration.
    pub conf: String,
    /// Capacity of each simulated device.
    pub capacity: u64,
    /// Exact peak of allocated bytes.
    pub peak_allocated: u64,
    /// Exact peak of reserved bytes.
    pub peak_reserved: u64,
    /// Most segments held at once.
    pub peak_segments: u64,
    /// Segments (or pages) obtained from the device.
    pub device_mallocs: u64,
    /// Segments (or pages) given back.
    pub device_frees: u64,
    /// The first allocation that ran out of memory.
    pub first_oom: Option<OomAt>,
    /// Allocations that ran out of memory.
    pub ooms: u64,
    /// Operations replayed.
    pub ops: u64,
    /// Nanoseconds spent inside the allocator.
    pub allocator_ns: u64,
    /// Allocated and reserved bytes over the replay (at most a few thousand points).
    pub samples: Vec<Sample>,
    /// The same figures per device (index = device ordinal); the totals above are over all
    /// devices at once (the peak of the sum, not the sum of the peaks).
    pub devices: Vec<DeviceReport>,
}

impl ReplayReport {
    /// Peak reserved / peak allocated (1.0 when nothing was allocated).
    pub fn ratio(&self) -> f64 {
        if self.peak_allocated == 0 {
            1.0
        } else {
            self.peak_reserved as f64 / self.peak_allocated as f64
        }
    }

    /// Allocator time per operation in nanoseconds.
    pub fn ns_per_op(&self) -> f64 {
        self.allocator_ns as f64 / self.ops.max(1) as f64
    }
}

/// Per-device figures read after each operation.
#[derive(Clone, Copy, Default)]
struct Current {
    allocated: u64,
    reserved: u64,
    segments: u64,
}

fn read(alloc: &CachingAllocator, device: usize) -> Result<Current> {
    let [allocated, reserved, segments] = alloc.usage_now(device)?;
    Ok(Current {
        allocated,
        reserved,
        segments,
    })
}

/// Replays `trace` under `options`; `progress` is called with the number of operations done
/// (every few thousand, and at the end).
pub fn replay(
    trace: &Trace,
    options: &ReplayOptions,
    progress: &mut dyn FnMut(u64),
) -> Result<ReplayReport> {
    let config = AllocatorConfig::parse(&options.conf)?;
    let driver = Arc::new(SimDriver::new(trace.devices, options.capacity)?);
    let alloc = CachingAllocatorBuilder::default()
        .config(config)
        .build(driver.clone())?;
    let mut streams: HashMap<(usize, u64), StreamId> = HashMap::new();
    let mut live: HashMap<u64, DataPtr> = HashMap::new();
    let mut per_device = vec![Current::default(); trace.devices];
    let mut total = Current::default();
    let every = (trace.ops.len() / MAX_SAMPLES).max(1);
    let mut report = ReplayReport {
        conf: options.conf.clone(),
        capacity: options.capacity,
        peak_allocated: 0,
        peak_reserved: 0,
        peak_segments: 0,
        device_mallocs: 0,
        device_frees: 0,
        first_oom: None,
        ooms: 0,
        ops: trace.ops.len() as u64,
        allocator_ns: 0,
        samples: Vec::new(),
        devices: vec![DeviceReport::default(); trace.devices],
    };
    for (i, op) in trace.ops.iter().enumerate() {
        let device = match *op {
            TraceOp::Alloc {
                id,
                device,
                size,
                stream,
            } => {
                let on = match streams.get(&(device, stream)) {
                    Some(s) => *s,
                    None => {
                        let s = if stream == 0 {
                            alloc.default_stream(device)?
                        } else {
                            alloc.create_stream(device)?
                        };
                        streams.insert((device, stream), s);
                        s
                    }
                };
                let started = Instant::now();
                let result = alloc.allocate_on(on, size);
                report.allocator_ns += started.elapsed().as_nanos() as u64;
                match result {
                    Ok(data) => {
                        live.insert(id, data);
                    }
                    Err(Error::OutOfMemory { message, .. }) => {
                        report.ooms += 1;
                        report.first_oom.get_or_insert(OomAt {
                            op: i as u64,
                            size,
                            allocated: total.allocated,
                            reserved: total.reserved,
                            explanation: message,
                        });
                    }
                    Err(err) => return Err(err),
                }
                device
            }
            TraceOp::Free { id } => match live.remove(&id) {
                Some(data) => {
                    let device = data.device();
                    let started = Instant::now();
                    drop(data);
                    report.allocator_ns += started.elapsed().as_nanos() as u64;
                    device
                }
                None => continue, // its allocation ran out of memory
            },
        };
        let now = read(&alloc, device)?;
        if let Some(d) = report.devices.get_mut(device) {
            d.peak_allocated = d.peak_allocated.max(now.allocated);
            d.peak_reserved = d.peak_reserved.max(now.reserved);
            d.peak_segments = d.peak_segments.max(now.segments);
        }
        let before = std::mem::replace(&mut per_device[device], now);
        total.allocated = total.allocated - before.allocated + now.allocated;
        total.reserved = total.reserved - before.reserved + now.reserved;
        total.segments = total.segments - before.segments + now.segments;
        report.peak_allocated = report.peak_allocated.max(total.allocated);
        report.peak_reserved = report.peak_reserved.max(total.reserved);
        report.peak_segments = report.peak_segments.max(total.segments);
        if i % every == 0 || i + 1 == trace.ops.len() {
            report.samples.push(Sample {
                op: i as u64,
                allocated: total.allocated,
                reserved: total.reserved,
            });
        }
        if i % 4096 == 0 {
            progress(i as u64);
        }
    }
    drop(live);
    for (device, d) in report.devices.iter_mut().enumerate() {
        let s = alloc.memory_stats(device)?;
        d.device_mallocs = s.num_device_alloc;
        d.device_frees = s.num_device_free;
        report.device_mallocs += s.num_device_alloc;
        report.device_frees += s.num_device_free;
    }
    progress(trace.ops.len() as u64);
    Ok(report)
}
