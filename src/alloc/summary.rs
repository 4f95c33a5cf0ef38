//! `memory_summary`: the familiar table of PyTorch's `torch.cuda.memory_summary()`, rendered from
//! [`DeviceStats`].

// Writing to a `String` cannot fail: the results of `writeln!` below are ignored.
use std::fmt::Write;

use super::stats::{DeviceStats, PoolStats, Stat};

const WIDTH: usize = 75;

fn bytes(n: i64) -> String {
    const UNITS: [&str; 5] = ["B  ", "KiB", "MiB", "GiB", "TiB"];
    let sign = if n < 0 { "-" } else { "" };
    let mut value = n.unsigned_abs() as f64;
    let mut unit = 0;
    while value >= 8192.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{sign}{value:.0} {}", UNITS[unit])
}

fn row(out: &mut String, label: &str, stat: &Stat, fmt: &dyn Fn(i64) -> String) {
    let _ = writeln!(
        out,
        "| {label:<21} | {:>10} | {:>10} | {:>10} | {:>10} |",
        fmt(stat.current),
        fmt(stat.peak),
        fmt(stat.allocated),
        fmt(stat.freed)
    );
}

fn section(out: &mut String, label: &str, array: &PoolStats, fmt: &dyn Fn(i64) -> String) {
    row(out, label, &array.all, fmt);
    row(out, "      from large pool", &array.large, fmt);
    row(out, "      from small pool", &array.small, fmt);
    let _ = writeln!(out, "|{}|", "-".repeat(WIDTH));
}

/// Renders the summary of one device.
pub(super) fn render(device: usize, backend: &str, s: &DeviceStats) -> String {
    let mut out = String::new();
    let line = "=".repeat(WIDTH);
    let count = |n: i64| n.to_string();
    let _ = writeln!(out, "|{line}|");
    let _ = writeln!(
        out,
        "|{:^WIDTH$}|",
        format!("cudalloc memory summary, device {device} ({backend})")
    );
    let _ = writeln!(out, "|{}|", "-".repeat(WIDTH));
    let _ = writeln!(
        out,
        "|{:^37}|{:^37}|",
        format!("OOMs: {}", s.num_ooms),
        format!("driver malloc retries: {}", s.num_alloc_retries)
    );
    let _ = writeln!(out, "|{line}|");
    let _ = writeln!(
        out,
        "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |"
    );
    let _ = writeln!(out, "|{}|", "-".repeat(WIDTH));
    section(&mut out, "Allocated memory", &s.allocated_bytes, &bytes);
    section(&mut out, "Active memory", &s.active_bytes, &bytes);
    section(&mut out, "Requested memory", &s.requested_bytes, &bytes);
    section(&mut out, "Reserved memory", &s.reserved_bytes, &bytes);
    section(
        &mut out,
        "Non-releasable memory",
        &s.inactive_split_bytes,
        &bytes,
    );
    section(&mut out, "Allocations", &s.allocation, &count);
    section(&mut out, "Active allocs", &s.active, &count);
    section(&mut out, "Reserved segments", &s.segment, &count);
    section(&mut out, "Non-releasable allocs", &s.inactive_split, &count);
    row(
        &mut out,
        "Oversize allocations",
        &s.oversize_allocations,
        &count,
    );
    row(&mut out, "Oversize segments", &s.oversize_segments, &count);
    let _ = writeln!(out, "|{line}|");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::size::PoolKind;
    use crate::alloc::stats;

    #[test]
    fn table_has_every_section_and_fixed_width() {
        let mut s = DeviceStats::default();
        stats::increase(&mut s.allocated_bytes, PoolKind::Small, 1 << 20);
        let text = render(0, "host", &s);
        for label in [
            "Allocated memory",
            "Active memory",
            "Requested memory",
            "Reserved memory",
            "Non-releasable memory",
            "Allocations",
            "Active allocs",
            "Oversize allocations",
        ] {
            assert!(text.contains(label), "{label}");
        }
        assert!(text.contains("1024 KiB"), "{text}");
        assert!(
            text.lines().all(|l| l.chars().count() == WIDTH + 2),
            "{text}"
        );
    }
}
