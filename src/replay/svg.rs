//! The plot of a replay: allocated and reserved bytes over the trace's operations, one reserved
//! line per configuration (the allocated line is shared while every configuration allocated the
//! same — it differs only when one ran out of memory). SVG, drawn with `plotters`.

use plotters::prelude::*;

use super::ReplayReport;
use crate::error::{Error, Result};

const COLORS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

fn plot_error(e: impl std::fmt::Display) -> Error {
    Error::invalid(format!("plotting the replay failed: {e}"))
}

/// The SVG document of `reports` (replays of one trace), titled `title`.
pub fn plot_svg(reports: &[ReplayReport], title: &str) -> Result<String> {
    const GIB: f64 = (1u64 << 30) as f64;
    let mut svg = String::new();
    let last_op = reports
        .iter()
        .flat_map(|r| r.samples.last())
        .map(|s| s.op)
        .max()
        .unwrap_or(1)
        .max(1);
    let top = reports
        .iter()
        .map(|r| r.peak_reserved.max(r.peak_allocated))
        .max()
        .unwrap_or(1)
        .max(1) as f64
        / GIB
        * 1.35;
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(14)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..last_op as f64, 0f64..top)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc("operation")
            .y_desc("GiB")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()
            .map_err(plot_error)?;
        // The capacity, when it is in view (a single device: its capacity; several: not drawn).
        if let Some(capacity) = reports.first().map(|r| r.capacity as f64 / GIB) {
            if capacity < top {
                let gray = RGBColor(0x70, 0x70, 0x70);
                chart
                    .draw_series(LineSeries::new(
                        [(0.0, capacity), (last_op as f64, capacity)],
                        gray.stroke_width(1),
                    ))
                    .map_err(plot_error)?
                    .label("device capacity")
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], gray.stroke_width(1))
                    });
            }
        }
        let shared_allocated = reports
            .windows(2)
            .all(|w| w[0].samples == w[1].samples || w[0].ooms == 0 && w[1].ooms == 0);
        for (i, report) in reports.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let name = if report.conf.is_empty() {
                "default".to_owned()
            } else {
                report.conf.clone()
            };
            let reserved = report
                .samples
                .iter()
                .map(|s| (s.op as f64, s.reserved as f64 / GIB));
            chart
                .draw_series(LineSeries::new(reserved, color.stroke_width(2)))
                .map_err(plot_error)?
                .label(format!(
                    "reserved: {name} (peak/allocated {:.2})",
                    report.ratio()
                ))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            if let Some(oom) = &report.first_oom {
                let at = (oom.op as f64, oom.reserved as f64 / GIB);
                chart
                    .draw_series(std::iter::once(Cross::new(at, 6, color.stroke_width(2))))
                    .map_err(plot_error)?
                    .label(format!(
                        "first out-of-memory: {name} ({} in all)",
                        report.ooms
                    ))
                    .legend(move |(x, y)| Cross::new((x + 9, y), 4, color.stroke_width(2)));
            }
            if i == 0 || !shared_allocated {
                let allocated = report
                    .samples
                    .iter()
                    .map(|s| (s.op as f64, s.allocated as f64 / GIB));
                let shade = if shared_allocated { BLACK } else { color };
                let label = if shared_allocated {
                    "allocated".to_owned()
                } else {
                    format!("allocated: {name}")
                };
                chart
                    .draw_series(LineSeries::new(allocated, shade.stroke_width(1)))
                    .map_err(plot_error)?
                    .label(label)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], shade.stroke_width(1))
                    });
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}
