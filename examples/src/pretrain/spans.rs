//! Every rank's pipeline spans, brought to rank 0 when the ranks are processes (each with its
//! own clock start): what `--timeline` draws under `--distributed-backend mpi`.

use burn_megatron::comm::{Comm, CommunicatorExt};
use burn_megatron::pipeline::{Pass, PipelineOp, Span, SpanKind};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const KINDS: [SpanKind; 4] = [
    SpanKind::Forward,
    SpanKind::Backward,
    SpanKind::Send,
    SpanKind::Recv,
];

fn encode(s: &Span) -> [i64; 6] {
    let kind = KINDS.iter().position(|k| *k == s.kind).expect("every kind") as i64;
    let pass = i64::from(s.op.pass == Pass::Backward);
    let ns = |d: Duration| d.as_nanos() as i64;
    [
        kind,
        pass,
        s.op.microbatch as i64,
        s.op.chunk as i64,
        ns(s.start),
        ns(s.end),
    ]
}

fn decode(v: &[i64], shift: Duration) -> Span {
    let at = |ns: i64| Duration::from_nanos(ns.max(0) as u64) + shift;
    Span {
        kind: KINDS[v[0] as usize],
        op: PipelineOp {
            pass: if v[1] == 1 {
                Pass::Backward
            } else {
                Pass::Forward
            },
            microbatch: v[2] as usize,
            chunk: v[3] as usize,
        },
        start: at(v[4]),
        end: at(v[5]),
    }
}

/// Gathers every rank's `spans` (measured from this process's `epoch`) over `world`, in
/// global rank order, on a common time axis: each process's epoch is placed by the wall
/// clock (the same clock on one node; NTP-close across nodes).
pub fn gather(world: &Comm, spans: &[Span], epoch: Instant) -> Result<Vec<Vec<Span>>, String> {
    let err = |e: burn_megatron::comm::CommError| e.to_string();
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .saturating_sub(epoch.elapsed());
    let walls = world
        .all_gather_vec(vec![wall.as_nanos() as i64])
        .map_err(err)?;
    let counts = world
        .all_gather_vec(vec![spans.len() as i64])
        .map_err(err)?;
    let most = counts.iter().copied().max().unwrap_or(0) as usize;
    let mut mine: Vec<i64> = spans.iter().flat_map(encode).collect();
    mine.resize(most * 6, -1);
    let all = world.all_gather_vec(mine).map_err(err)?;
    let first = walls.iter().copied().min().unwrap_or(0);
    Ok((0..walls.len())
        .map(|r| {
            let shift = Duration::from_nanos((walls[r] - first).max(0) as u64);
            let rows = &all[r * most * 6..(r + 1) * most * 6];
            rows.chunks(6)
                .take(counts[r] as usize)
                .map(|v| decode(v, shift))
                .collect()
        })
        .collect())
}
