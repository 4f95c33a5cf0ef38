//! Snapshots in PyTorch's layout (feature `pickle`): what `torch.cuda.memory._snapshot()` returns,
//! pickled, so `python -m torch.cuda._memory_viz stats|trace|segments FILE` and the memory_viz web
//! page open it.
//!
//! ```text
//! {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
//!                "requested_size", "stream", "segment_type": "small"|"large",
//!                "segment_pool_id": (0, 0), "is_expandable", "frames": [],
//!                "blocks": [{"address", "size", "requested_size", "state", "frames"}]}],
//!  "device_traces": [[{"action", "addr", "size", "stream", "time_us", "frames",
//!                      "device_free" (oom only)}], … one list per device],
//!  "allocator_settings": {…}}
//! ```
//! Frames are `{"filename", "line", "name"}`. Block sizes add up to their segment's `total_size`
//! (what `_memory_viz.segsum` asserts); states and actions are PyTorch's strings.

use std::collections::BTreeMap;

use serde_pickle::{HashableValue as H, Value as V};

use super::engine::snapshot::{Snapshot, SnapshotBlockState};
use super::history::{TraceAction, TraceEntry};
use super::stacks::Frame;
use crate::config::AllocatorConfig;
use crate::error::{Error, Result};

fn int(v: u64) -> V {
    match i64::try_from(v) {
        Ok(i) => V::I64(i),
        Err(_) => V::Int(v.into()),
    }
}

fn string(s: &str) -> V {
    V::String(s.to_owned())
}

fn dict(items: Vec<(&str, V)>) -> V {
    V::Dict(
        items
            .into_iter()
            .map(|(k, v)| (H::String(k.to_owned()), v))
            .collect::<BTreeMap<_, _>>(),
    )
}

fn frames(frames: &[Frame]) -> V {
    V::List(
        frames
            .iter()
            .map(|f| {
                dict(vec![
                    ("filename", string(&f.filename)),
                    ("line", int(u64::from(f.line))),
                    ("name", string(&f.name)),
                ])
            })
            .collect(),
    )
}

fn trace_entry(e: &TraceEntry) -> V {
    let mut items = vec![
        ("action", string(e.action.name())),
        ("addr", int(e.addr)),
        ("size", int(e.size)),
        ("stream", int(e.stream)),
        ("time_us", int(e.time_us)),
        ("frames", frames(&e.frames)),
    ];
    if e.action == TraceAction::Oom {
        items.push(("device_free", int(e.device_free)));
    }
    dict(items)
}

impl Snapshot {
    #[cfg_attr(docsrs, doc(cfg(feature = "pickle")))]
    /// The snapshot in PyTorch's layout, pickled (protocol 3); `config` fills
    /// `allocator_settings`.
    pub fn to_pytorch_pickle(&self, config: &AllocatorConfig) -> Result<Vec<u8>> {
        let segments = self
            .segments
            .iter()
            .map(|s| {
                let blocks = s
                    .blocks
                    .iter()
                    .map(|b| {
                        dict(vec![
                            ("address", int(b.addr)),
                            ("size", int(b.size)),
                            ("requested_size", int(b.requested_size)),
                            ("state", string(b.state.name())),
                            ("frames", frames(&b.frames)),
                        ])
                    })
                    .collect();
                let requested: u64 = s
                    .blocks
                    .iter()
                    .filter(|b| b.state != SnapshotBlockState::Inactive)
                    .map(|b| b.requested_size)
                    .sum();
                dict(vec![
                    ("device", int(s.device as u64)),
                    ("address", int(s.address)),
                    ("total_size", int(s.total_size)),
                    ("allocated_size", int(s.allocated_size)),
                    ("active_size", int(s.active_size)),
                    ("requested_size", int(requested)),
                    ("stream", int(s.stream)),
                    ("segment_type", string(s.segment_type)),
                    ("segment_pool_id", {
                        let (first, second) = s.segment_pool_id.as_pair();
                        V::Tuple(vec![int(first), int(second)])
                    }),
                    ("is_expandable", V::Bool(s.is_expandable)),
                    ("frames", V::List(Vec::new())),
                    ("blocks", V::List(blocks)),
                ])
            })
            .collect();
        let devices = self
            .device_count
            .max(self.trace.iter().map(|e| e.device + 1).max().unwrap_or(0))
            .max(
                self.segments
                    .iter()
                    .map(|s| s.device + 1)
                    .max()
                    .unwrap_or(0),
            );
        let mut traces = vec![Vec::new(); devices];
        for e in &self.trace {
            traces[e.device].push(trace_entry(e));
        }
        let settings = dict(vec![
            (
                "max_split_size",
                int(if config.max_split_size == u64::MAX {
                    0
                } else {
                    config.max_split_size
                }),
            ),
            (
                "garbage_collection_threshold",
                V::F64(config.garbage_collection_threshold),
            ),
            ("expandable_segments", V::Bool(config.expandable_segments)),
            (
                "release_lock_on_malloc",
                V::Bool(config.release_lock_on_cudamalloc),
            ),
        ]);
        let top = dict(vec![
            ("segments", V::List(segments)),
            (
                "device_traces",
                V::List(traces.into_iter().map(V::List).collect()),
            ),
            ("allocator_settings", settings),
        ]);
        serde_pickle::value_to_vec(&top, serde_pickle::SerOptions::new())
            .map_err(|e| Error::invalid(format!("pickling the snapshot failed: {e}")))
    }
}

/// How many fresh temporary names [`write_snapshot_file`] tries before giving up.
const TEMPORARY_NAMES: u32 = 8;

/// Writes `bytes` to the file `path` (the `oom_snapshot_path` dump) without following or opening
/// whatever is there: into a fresh temporary file beside it, created exclusively
/// (`O_CREAT | O_EXCL`, mode `0600`: snapshots hold addresses and stacks; another unique name
/// when one exists), then renamed over `path`. `O_EXCL` already refuses a planted symlink or FIFO
/// at the temporary name (`O_NOFOLLOW | O_NONBLOCK` only say so twice); the rename replaces a link
/// at `path` itself, not its target; a reader of `path` sees the previous snapshot or this one,
/// never part of one.
pub(crate) fn write_snapshot_file(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;

    use crate::sync::os::atomic::{AtomicU64, Ordering};

    static NEXT: AtomicU64 = AtomicU64::new(0);
    let failed =
        |what: &str, e: std::io::Error| Error::invalid(format!("{what} {}: {e}", path.display()));
    let mut last = None;
    for _ in 0..TEMPORARY_NAMES {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(
            ".tmp{}.{}.{stamp:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&tmp);
        let mut file = match opened {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                last = Some(e);
                continue;
            }
            Err(e) => return Err(failed("creating a temporary file beside", e)),
        };
        // No fsync: the failing allocation waits for this write (under `oom_dump`); a dump is a
        // diagnosis, not data to survive a power cut.
        let written = file
            .write_all(bytes)
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            // Best effort: the write's error is the one reported.
            let _ = std::fs::remove_file(&tmp);
            return Err(failed("writing", e));
        }
        return Ok(());
    }
    Err(failed(
        &format!("{TEMPORARY_NAMES} temporary names were taken beside"),
        last.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::AlreadyExists)),
    ))
}
