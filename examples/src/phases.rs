//! Time spent in each named `tracing` span, summed over every entry: the per-phase breakdown
//! of a benchmark step. The model's spans (`bert.embeddings`, `layer.attention`,
//! `layer.mlp`, `bert.lm_head`, `bert.loss`) measure compute on eager CPU backends, where an
//! op's work is done when it returns.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::span::{Attributes, Id};
use tracing::{Subscriber, subscriber::Interest};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// One benchmark run's median step (seconds) and its mean time per span.
#[derive(Debug, Clone)]
pub struct Run {
    /// The median step.
    pub step: f64,
    /// Mean time per step in each span.
    pub phases: BTreeMap<&'static str, Duration>,
}

/// Prints the per-phase table of `runs` (columns) over `phases` (`(label, span name)` rows)
/// and `other`, the rest of each median step, `width` characters per column.
pub fn print_breakdown(phases: &[(&str, &str)], runs: &[(String, Run)], width: usize) {
    println!("\nms per step by phase (mean of the timed steps; forward phases, then backward");
    println!("and optimizer as wholes; `other` is the rest of the median step):");
    print!("{:>14}", "phase");
    for (name, _) in runs {
        print!(" {name:>width$}");
    }
    println!();
    for &(label, span) in phases {
        print!("{label:>14}");
        for (_, run) in runs {
            let ms = run.phases.get(span).map_or(0.0, |d| d.as_secs_f64() * 1e3);
            print!(" {ms:>width$.1}");
        }
        println!();
    }
    print!("{:>14}", "other");
    for (_, run) in runs {
        let known: f64 = phases
            .iter()
            .filter_map(|(_, s)| run.phases.get(s))
            .map(Duration::as_secs_f64)
            .sum();
        print!(" {:>width$.1}", (run.step - known) * 1e3);
    }
    println!();
}

/// Summed durations by span name; cloned handles share one table.
#[derive(Debug, Clone, Default)]
pub struct PhaseTimes {
    totals: Arc<Mutex<BTreeMap<&'static str, Duration>>>,
}

struct Entered(Instant);

impl PhaseTimes {
    /// Installs a subscriber feeding a new table as this thread's default; the table fills
    /// while the guard lives.
    pub fn install() -> (Self, tracing::subscriber::DefaultGuard) {
        use tracing_subscriber::layer::SubscriberExt;
        let times = Self::default();
        let subscriber = tracing_subscriber::registry().with(times.clone());
        (times, tracing::subscriber::set_default(subscriber))
    }

    /// The totals so far, and empties the table.
    pub fn take(&self) -> BTreeMap<&'static str, Duration> {
        std::mem::take(&mut *self.totals.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for PhaseTimes {
    fn register_callsite(&self, _: &'static tracing::Metadata<'static>) -> Interest {
        Interest::always()
    }

    fn on_new_span(&self, _: &Attributes<'_>, _: &Id, _: Context<'_, S>) {}

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().replace(Entered(Instant::now()));
        }
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let Some(Entered(start)) = span.extensions_mut().remove::<Entered>() else {
            return;
        };
        let mut totals = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        *totals.entry(span.name()).or_default() += start.elapsed();
    }
}
