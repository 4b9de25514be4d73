//! What each rank did when: forward, backward, send and receive spans, written as a Chrome
//! trace (Perfetto and `chrome://tracing` open it). Gaps between spans are idle time.

use super::PipelineOp;
use std::time::{Duration, Instant};

/// What a span of a rank's time was spent on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// A model chunk's forward.
    Forward,
    /// A model chunk's backward.
    Backward,
    /// Sending an activation or a gradient.
    Send,
    /// Waiting for and receiving an activation or a gradient.
    Recv,
}

impl SpanKind {
    fn name(self) -> &'static str {
        match self {
            SpanKind::Forward => "forward",
            SpanKind::Backward => "backward",
            SpanKind::Send => "send",
            SpanKind::Recv => "recv",
        }
    }
}

/// One span of one rank's time, relative to the run's common start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// What it was.
    pub kind: SpanKind,
    /// The op it belongs to (its microbatch and chunk).
    pub op: PipelineOp,
    /// Start, from the common epoch.
    pub start: Duration,
    /// End, from the common epoch.
    pub end: Duration,
}

/// Records spans against an epoch shared by every rank of a run.
#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    epoch: Option<Instant>,
    pub(crate) spans: Vec<Span>,
}

impl Recorder {
    pub(crate) fn new(epoch: Option<Instant>) -> Self {
        Self {
            epoch,
            spans: Vec::new(),
        }
    }

    /// Runs `f`, recording it as a span of `kind` when recording.
    pub(crate) fn time<R>(&mut self, kind: SpanKind, op: PipelineOp, f: impl FnOnce() -> R) -> R {
        let Some(epoch) = self.epoch else {
            return f();
        };
        let start = epoch.elapsed();
        let out = f();
        self.spans.push(Span {
            kind,
            op,
            start,
            end: epoch.elapsed(),
        });
        out
    }
}

/// The first start and the last end of any span of any rank (zero when there is none).
pub fn time_bounds(ranks: &[Vec<Span>]) -> (Duration, Duration) {
    let spans = || ranks.iter().flatten();
    let start = spans().map(|s| s.start).min().unwrap_or_default();
    let end = spans().map(|s| s.end).max().unwrap_or_default();
    (start, end)
}

/// Each rank's idle (bubble) fraction: `1 − busy / window`, the window running from the
/// first span of any rank to the last. Send and receive spans do not count as busy.
pub fn idle_fractions(ranks: &[Vec<Span>]) -> Vec<f64> {
    let (start, end) = time_bounds(ranks);
    let window = end.saturating_sub(start).as_secs_f64();
    ranks
        .iter()
        .map(|spans| {
            let busy: Duration = spans
                .iter()
                .filter(|s| matches!(s.kind, SpanKind::Forward | SpanKind::Backward))
                .map(|s| s.end.saturating_sub(s.start))
                .sum();
            if window == 0.0 {
                0.0
            } else {
                (1.0 - busy.as_secs_f64() / window).max(0.0)
            }
        })
        .collect()
}

/// A Chrome trace (JSON array format) of every rank's spans: one row (`tid`) per rank,
/// named `F<microbatch>.<chunk>` / `B…`, with the kind, microbatch and chunk as arguments;
/// idle gaps get spans of their own so the bubble shows up as a named block.
///
/// ```
/// use burn_megatron::pipeline::{PipelineOp, Span, SpanKind, chrome_trace};
/// use std::time::Duration;
/// let op = PipelineOp::forward(0, 0);
/// let span = Span { kind: SpanKind::Forward, op, start: Duration::ZERO, end: Duration::from_millis(2) };
/// let json = chrome_trace(&[vec![span]]);
/// assert!(json.contains("\"name\":\"F0.0\""));
/// ```
pub fn chrome_trace(ranks: &[Vec<Span>]) -> String {
    // Times from the first span of any rank.
    let (t0, _) = time_bounds(ranks);
    let mut events = Vec::new();
    for (rank, spans) in ranks.iter().enumerate() {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
            "args": { "name": format!("rank {rank}") }
        }));
        let mut sorted: Vec<Span> = spans
            .iter()
            .map(|s| Span {
                start: s.start.saturating_sub(t0),
                end: s.end.saturating_sub(t0),
                ..*s
            })
            .collect();
        sorted.sort_by_key(|s| s.start);
        let mut last_end: Option<Duration> = None;
        for s in &sorted {
            if let Some(end) = last_end.filter(|&e| s.start > e) {
                events.push(event("idle", "idle", rank, end, s.start, s.op));
            }
            let name = match s.kind {
                SpanKind::Forward | SpanKind::Backward => s.op.to_string(),
                k => format!("{} {}", k.name(), s.op),
            };
            events.push(event(&name, s.kind.name(), rank, s.start, s.end, s.op));
            last_end = Some(last_end.map_or(s.end, |e| e.max(s.end)));
        }
    }
    serde_json::Value::Array(events).to_string()
}

fn event(
    name: &str,
    cat: &str,
    rank: usize,
    start: Duration,
    end: Duration,
    op: PipelineOp,
) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": 0,
        "tid": rank,
        "ts": start.as_secs_f64() * 1e6,
        "dur": end.saturating_sub(start).as_secs_f64() * 1e6,
        "args": { "microbatch": op.microbatch, "chunk": op.chunk, "kind": cat },
    })
}
