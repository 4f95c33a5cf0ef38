//! `cudalloc replay FILE`: replays an allocation trace through the real allocator on the simulated
//! device under one or more configurations, prints a table per configuration (with a row per
//! device under each when the trace uses several) and writes a plot. Reading the file is bounded
//! (`cudalloc::replay::limits`): a hostile file is a one-line error, never a crash or a hang.

// Writing to a `String` cannot fail: the results of `write!` below are ignored.
use std::fmt::Write as _;
use std::path::PathBuf;

use cudalloc::format_size;
use cudalloc::replay::{self, ReplayOptions, ReplayReport, Trace};

/// What the command was asked.
#[derive(Debug)]
pub(crate) struct ReplayArgs {
    /// The trace file.
    pub file: PathBuf,
    /// Configurations (`PYTORCH_CUDA_ALLOC_CONF` grammar); empty: PyTorch's default and
    /// expandable segments.
    pub confs: Vec<String>,
    /// Capacity of the simulated device(s).
    pub capacity: u64,
    /// Where the plot goes (`None`: no plot; nothing is written where the command was not told
    /// to write).
    pub svg: Option<PathBuf>,
}

/// The table of `reports` (one row per configuration).
pub(crate) fn table(trace: &Trace, reports: &[ReplayReport], capacity: u64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} operations ({} allocations, {} unmatched frees skipped), {} device(s) of {}",
        trace.format.name(),
        trace.ops.len(),
        trace.allocations(),
        trace.unmatched_frees,
        trace.devices,
        format_size(capacity)
    );
    let names: Vec<&str> = reports.iter().map(conf_name).collect();
    let w = names.iter().map(|n| n.len()).max().unwrap_or(0).max(13);
    let _ = writeln!(
        out,
        "{:<w$} {:>12} {:>12} {:>7} {:>9} {:>15} {:>10}  first out-of-memory",
        "configuration", "peak alloc", "peak reserv", "ratio", "segments", "mallocs/frees", "ns/op"
    );
    for (r, name) in reports.iter().zip(names) {
        let oom = match &r.first_oom {
            Some(at) => format!(
                "op {} ({} with {} reserved; {} in all)",
                at.op,
                format_size(at.size),
                format_size(at.reserved),
                r.ooms
            ),
            None => "none".into(),
        };
        let _ = writeln!(
            out,
            "{:<w$} {:>12} {:>12} {:>7.3} {:>9} {:>15} {:>10.0}  {oom}",
            name,
            format_size(r.peak_allocated),
            format_size(r.peak_reserved),
            r.ratio(),
            r.peak_segments,
            format!("{}/{}", r.device_mallocs, r.device_frees),
            r.ns_per_op()
        );
        if r.devices.len() > 1 {
            for (device, d) in r.devices.iter().enumerate() {
                let peak_ratio = if d.peak_allocated == 0 {
                    1.0
                } else {
                    d.peak_reserved as f64 / d.peak_allocated as f64
                };
                let _ = writeln!(
                    out,
                    "{:<w$} {:>12} {:>12} {:>7.3} {:>9} {:>15}",
                    format!("  device {device}"),
                    format_size(d.peak_allocated),
                    format_size(d.peak_reserved),
                    peak_ratio,
                    d.peak_segments,
                    format!("{}/{}", d.device_mallocs, d.device_frees),
                );
            }
        }
    }
    for r in reports {
        if let Some(at) = &r.first_oom {
            let _ = writeln!(
                out,
                "\nfirst out-of-memory under {} (op {}): {}",
                conf_name(r),
                at.op,
                at.explanation
            );
        }
    }
    out
}

/// How a report's configuration is named in the table.
fn conf_name(r: &ReplayReport) -> &str {
    if r.conf.is_empty() {
        "default (PyTorch's policy)"
    } else {
        r.conf.as_str()
    }
}

/// Runs the command; returns the text to print.
pub(crate) fn run(args: &ReplayArgs) -> cudalloc::Result<String> {
    let trace = replay::load(&args.file)?;
    let confs = if args.confs.is_empty() {
        vec![String::new(), "expandable_segments:True".to_owned()]
    } else {
        args.confs.clone()
    };
    let mut reports = Vec::new();
    for conf in &confs {
        let bar = super::labelled_progress(trace.ops.len() as u64, "replaying");
        bar.set_message(if conf.is_empty() {
            "default".to_owned()
        } else {
            conf.clone()
        });
        let options = ReplayOptions::new(conf.clone(), args.capacity);
        let report =
            replay::replay(&trace, &options, &mut |done| bar.set_position(done)).map_err(|e| {
                match e {
                    cudalloc::Error::Config(why) => {
                        cudalloc::Error::Config(format!("--conf {conf:?}: {why}"))
                    }
                    other => other,
                }
            })?;
        bar.finish_and_clear();
        reports.push(report);
    }
    let mut out = table(&trace, &reports, args.capacity);
    let Some(svg_path) = &args.svg else {
        let _ = write!(out, "plot: none (--svg PATH writes one)");
        return Ok(out);
    };
    let title = format!(
        "{} — allocated and reserved",
        args.file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    );
    let svg = replay::plot_svg(&reports, &title)?;
    std::fs::write(svg_path, svg).map_err(|e| {
        cudalloc::Error::InvalidArgument(format!("cannot write {}: {e}", svg_path.display()))
    })?;
    let _ = write!(out, "plot: {}", svg_path.display());
    Ok(out)
}
