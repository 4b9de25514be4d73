//! The loss curve as a PNG: training MLM and SOP losses per iteration, validation MLM loss
//! as points.

use super::IterationLog;
use plotters::prelude::*;
use std::path::Path;

fn draw(
    path: &Path,
    log: &[IterationLog],
    evals: &[(usize, f64, f64)],
    text: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let x0 = log.first().map_or(0, |e| e.iteration) as f64;
    let x1 = log.last().map_or(1, |e| e.iteration).max(x0 as usize + 1) as f64;
    let ymax = log
        .iter()
        .flat_map(|e| [e.lm_loss, e.sop_loss])
        .chain(evals.iter().map(|e| e.1))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        * 1.05;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder
            .caption("bert_pretrain loss", ("sans-serif", 28))
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
    let sop = LineSeries::new(log.iter().map(|e| (e.iteration as f64, e.sop_loss)), &RED);
    let valid = evals
        .iter()
        .map(|e| Circle::new((e.0 as f64, e.1), 4, GREEN.filled()));
    if text {
        chart
            .draw_series(lm)?
            .label("lm loss (train)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        chart
            .draw_series(sop)?
            .label("sop loss (train)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
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
    log: &[IterationLog],
    evals: &[(usize, f64, f64)],
) -> Result<(), String> {
    draw(path, log, evals, true)
        .or_else(|_| draw(path, log, evals, false))
        .map_err(|e| format!("{}: {e}", path.display()))
}
