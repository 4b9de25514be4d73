//! The loss curve as a PNG: training lm (and BERT's SOP) losses per iteration, validation
//! lm loss as points.

use super::{Eval, IterationLog};
use burn_megatron::pipeline::{Span, SpanKind, time_bounds};
use plotters::prelude::*;
use std::path::Path;

fn draw(
    path: &Path,
    title: &str,
    log: &[IterationLog],
    evals: &[Eval],
    text: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let x0 = log.first().map_or(0, |e| e.iteration) as f64;
    let x1 = log.last().map_or(1, |e| e.iteration).max(x0 as usize + 1) as f64;
    let ymax = log
        .iter()
        .flat_map(|e| [Some(e.lm_loss), e.sop_loss].into_iter().flatten())
        .chain(evals.iter().map(|e| e.1))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        * 1.05;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder
            .caption(format!("{title} loss"), ("sans-serif", 28))
            .x_label_area_size(40)
            .y_label_area_size(60);
    }
    let mut chart = builder.build_cartesian_2d(x0..x1, 0.0..ymax.max(1e-3))?;
    if text {
        chart
            .configure_mesh()
            .x_desc("iteration")
            .y_desc("loss")
            .draw()?;
    }
    let lm = LineSeries::new(log.iter().map(|e| (e.iteration as f64, e.lm_loss)), &BLUE);
    let sop_points: Vec<(f64, f64)> = log
        .iter()
        .filter_map(|e| e.sop_loss.map(|s| (e.iteration as f64, s)))
        .collect();
    let has_sop = !sop_points.is_empty();
    let sop = LineSeries::new(sop_points, &RED);
    let valid = evals
        .iter()
        .map(|e| Circle::new((e.0 as f64, e.1), 4, GREEN.filled()));
    if text {
        chart
            .draw_series(lm)?
            .label("lm loss (train)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        if has_sop {
            chart
                .draw_series(sop)?
                .label("sop loss (train)")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        }
        chart
            .draw_series(valid)?
            .label("lm loss (validation)")
            .legend(|(x, y)| Circle::new((x + 10, y), 4, GREEN.filled()));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    } else {
        chart.draw_series(lm)?;
        chart.draw_series(sop)?;
        chart.draw_series(valid)?;
    }
    root.present()?;
    Ok(())
}

/// Writes the curve to `path`; without a usable system font the axes go unlabelled.
pub fn loss_curve(
    path: &Path,
    title: &str,
    log: &[IterationLog],
    evals: &[Eval],
) -> Result<(), String> {
    draw(path, title, log, evals, true)
        .or_else(|_| draw(path, title, log, evals, false))
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn draw_timeline(
    path: &Path,
    ranks: &[Vec<Span>],
    text: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (1200, 80 + 60 * ranks.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let (t0, t1) = time_bounds(ranks);
    let ms = |d: std::time::Duration| d.saturating_sub(t0).as_secs_f64() * 1e3;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder
            .caption(
                "pipeline schedule (forward blue, backward green, send/recv grey)",
                ("sans-serif", 20),
            )
            .x_label_area_size(30)
            .y_label_area_size(60);
    }
    let n = ranks.len() as f64;
    let mut chart = builder.build_cartesian_2d(0.0..ms(t1).max(1e-3), 0.0..n)?;
    if text {
        chart
            .configure_mesh()
            .x_desc("ms")
            .y_desc("rank")
            .y_labels(2 * ranks.len() + 1)
            .y_label_formatter(&|y| {
                // Row k is drawn between n − k − 1 and n − k: label its middle with the rank.
                let k = n - y - 0.5;
                if k >= 0.0 && (k - k.round()).abs() < 0.01 {
                    format!("{}", k.round())
                } else {
                    String::new()
                }
            })
            .disable_y_mesh()
            .draw()?;
    }
    for (rank, spans) in ranks.iter().enumerate() {
        // Rank 0 at the top, as Perfetto shows it.
        let y = n - rank as f64;
        chart.draw_series(spans.iter().map(|s| {
            let color = match s.kind {
                SpanKind::Forward => BLUE.mix(0.35 + 0.5 / (1.0 + s.op.chunk as f64)),
                SpanKind::Backward => GREEN.mix(0.35 + 0.5 / (1.0 + s.op.chunk as f64)),
                SpanKind::Send | SpanKind::Recv => BLACK.mix(0.25),
            };
            // A hair's gap between neighbouring spans keeps microbatches apart.
            let end = (ms(s.end) - ms(t1) * 1e-3).max(ms(s.start));
            Rectangle::new([(ms(s.start), y - 0.9), (end, y - 0.1)], color.filled())
        }))?;
    }
    root.present()?;
    Ok(())
}

/// Draws every rank's spans as a row of boxes; without a usable system font the axes go
/// unlabelled.
pub fn timeline(path: &Path, ranks: &[Vec<Span>]) -> Result<(), String> {
    draw_timeline(path, ranks, true)
        .or_else(|_| draw_timeline(path, ranks, false))
        .map_err(|e| format!("{}: {e}", path.display()))
}
