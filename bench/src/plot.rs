//! The latency-over-time plot: one panel per (kind, path), each request a
//! dot at its start time and latency (log scale), failures as red crosses
//! along the top, each swap's window shaded and its switch instant marked.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::BenchError;
use crate::loadgen::{Group, Sample};
use crate::zero::{Kind, Panel, SwapRecord, Via};

/// The span of time shown per panel, from one second before the first swap.
const WINDOW_S: f64 = 8.0;
/// Where the text font is read from (Debian's fonts-dejavu-core).
const FONT_PATHS: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Writes the PNG at `path`.
pub fn render(path: &Path, panels: &[Panel]) -> Result<(), BenchError> {
    load_font()?;
    let plot_error = |e: String| BenchError::Plot(format!("{}: {e}", path.display()));
    let columns = 2usize;
    let rows = panels.len().div_ceil(columns).max(1);
    let root = BitMapBackend::new(path, (1600, 380 * rows as u32 + 60)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(e.to_string()))?;
    let (title, body) = root.split_vertically(60);
    title
        .titled(
            "Request latency across back-to-back swaps (fixed rate; blue: keep-alive, green: new connection per request; red x: failed request; grey: swap in progress; orange: current.sock switched)",
            ("sans-serif", 17),
        )
        .map_err(|e| plot_error(e.to_string()))?;
    let areas = body.split_evenly((rows, columns));
    for (area, (kind, via, samples, records)) in areas.iter().zip(panels) {
        panel(area, *kind, *via, samples, records).map_err(plot_error)?;
    }
    root.present().map_err(|e| plot_error(e.to_string()))?;
    Ok(())
}

fn load_font() -> Result<(), BenchError> {
    let bytes = FONT_PATHS
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .ok_or_else(|| {
            BenchError::Missing(format!(
                "a font for the plot ({}; apt-get install -y fonts-dejavu-core)",
                FONT_PATHS[0]
            ))
        })?;
    // plotters keeps registered fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| BenchError::Plot("the DejaVu font does not parse".into()))
}

fn panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    kind: Kind,
    via: Via,
    samples: &[Sample],
    records: &[SwapRecord],
) -> Result<(), String> {
    let Some(first) = records.first() else {
        return Ok(());
    };
    let origin = first.begin_ns.saturating_sub(1_000_000_000);
    let end = origin + (WINDOW_S * 1e9) as u64;
    let seconds = |t: u64| (t.saturating_sub(origin)) as f64 / 1e9;
    let shown: Vec<&Sample> = samples
        .iter()
        .filter(|s| (origin..end).contains(&s.start_ns))
        .collect();
    let ceiling = shown
        .iter()
        .map(|s| s.latency_ns as f64 / 1e6)
        .fold(10.0f64, f64::max)
        * 2.0;
    let swaps_shown = records.iter().filter(|r| r.begin_ns < end).count();
    let failed = shown.iter().filter(|s| !s.ok()).count();
    let caption = format!(
        "{} via {}: {} requests, {} failed, {} swaps shown",
        kind.name(),
        via.name(),
        shown.len(),
        failed,
        swaps_shown
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(8)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..WINDOW_S, (0.02f64..ceiling).log_scale())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("latency (ms, log)")
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .light_line_style(WHITE)
        .draw()
        .map_err(|e| e.to_string())?;
    let shade = RGBColor(215, 215, 215).filled();
    chart
        .draw_series(records.iter().filter(|r| r.begin_ns < end).map(|r| {
            Rectangle::new(
                [
                    (seconds(r.begin_ns), 0.02),
                    (seconds(r.end_ns).min(WINDOW_S), ceiling),
                ],
                shade,
            )
        }))
        .map_err(|e| e.to_string())?;
    let switch_color = RGBColor(255, 140, 0);
    chart
        .draw_series(
            records
                .iter()
                .filter_map(|r| r.switch_ns)
                .filter(|t| *t < end)
                .map(|t| {
                    PathElement::new(
                        vec![(seconds(t), 0.02), (seconds(t), ceiling)],
                        switch_color.stroke_width(1),
                    )
                }),
        )
        .map_err(|e| e.to_string())?;
    for (group, color) in [
        (Group::PerRequest, RGBColor(30, 150, 60)),
        (Group::KeepAlive, RGBColor(30, 80, 200)),
    ] {
        chart
            .draw_series(
                shown
                    .iter()
                    .filter(|s| s.ok() && s.group == group)
                    .map(|s| {
                        Circle::new(
                            (seconds(s.start_ns), (s.latency_ns as f64 / 1e6).max(0.021)),
                            1,
                            color.filled(),
                        )
                    }),
            )
            .map_err(|e| e.to_string())?;
    }
    chart
        .draw_series(
            shown
                .iter()
                .filter(|s| !s.ok())
                .map(|s| Cross::new((seconds(s.start_ns), ceiling / 1.5), 4, RED.stroke_width(2))),
        )
        .map_err(|e| e.to_string())?;
    Ok(())
}
