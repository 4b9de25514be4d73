//! Schedule arithmetic: exact tables, Megatron's closed forms, and a simulation of every
//! rank's ops over FIFO channels that must run to the end without a deadlock.

use crate::pipeline::schedule::{
    Pass, PipelineOp, PipelineSchedule, ScheduleError, num_warmup_microbatches, schedule_table,
    virtual_stage,
};
use crate::topology::{TopologyError, layer_offset};
use std::collections::{HashMap, HashSet, VecDeque};

fn ops_str(ops: &[PipelineOp]) -> String {
    ops.iter()
        .map(|o| o.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn one_f_one_b_exact_orders() {
    let s = PipelineSchedule::new(2, 4);
    assert_eq!(
        ops_str(&s.ops(0).unwrap()),
        "F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 B3.0"
    );
    assert_eq!(
        ops_str(&s.ops(1).unwrap()),
        "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0"
    );
    let s = PipelineSchedule::new(4, 2);
    // Fewer microbatches than stages: rank 0's warmup is all of them.
    assert_eq!(ops_str(&s.ops(0).unwrap()), "F0.0 F1.0 B0.0 B1.0");
    assert_eq!(ops_str(&s.ops(2).unwrap()), "F0.0 F1.0 B0.0 B1.0");
    assert_eq!(ops_str(&s.ops(3).unwrap()), "F0.0 B0.0 F1.0 B1.0");
}

#[test]
fn no_pipelining_alternates() {
    let s = PipelineSchedule::new(1, 3);
    assert_eq!(ops_str(&s.ops(0).unwrap()), "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0");
    let fwd = s.with_forward_only(true);
    assert_eq!(ops_str(&fwd.ops(0).unwrap()), "F0.0 F1.0 F2.0");
}

#[test]
fn interleaved_exact_order() {
    // P 2, M 4, V 2, G 2: rank 0 warms up with (2 − 0 − 1)·2 + 1·2 = 4 forwards, rank 1 with 2.
    let s = PipelineSchedule::new(2, 4).with_model_chunks(2);
    assert_eq!(
        ops_str(&s.ops(0).unwrap()),
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
    );
    assert_eq!(
        ops_str(&s.ops(1).unwrap()),
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
    );
    // G 4 = M: all of chunk 0, then all of chunk 1.
    assert_eq!(
        schedule_table(4, 2, 4),
        vec![
            (0, 0),
            (1, 0),
            (2, 0),
            (3, 0),
            (0, 1),
            (1, 1),
            (2, 1),
            (3, 1)
        ]
    );
    // A short last group (M 5, G 3): groups {0, 1, 2} and {3, 4}.
    assert_eq!(
        schedule_table(5, 2, 3),
        vec![
            (0, 0),
            (1, 0),
            (2, 0),
            (0, 1),
            (1, 1),
            (2, 1),
            (3, 0),
            (4, 0),
            (3, 1),
            (4, 1)
        ]
    );
}

/// Megatron's older closed forms of the interleaved table (G = P, M divisible by P), and the
/// obvious one for G = M: an independent derivation of `schedule_table`.
fn closed_form(k: usize, p: usize, m: usize, v: usize, g: usize) -> (usize, usize) {
    if g == m {
        (k % m, k / m)
    } else {
        assert_eq!(g, p);
        let chunk = (k % (p * v)) / p;
        let microbatch = (k / (p * v)) * p + k % p;
        (microbatch, chunk)
    }
}

/// Each message: (microbatch, sending virtual stage).
type Msg = (usize, usize);

/// Runs every rank's ops with unit forward cost `f` and backward cost `b` over FIFO channels
/// (one per direction and neighbour pair, as the executor's two communicators have), an op
/// starting once its rank is free and its input message is at the head of its channel.
/// Returns each rank's (start time, op) list and the makespan; panics on a deadlock or a
/// message taken out of order.
fn simulate(s: &PipelineSchedule, f: u64, b: u64) -> (Vec<Vec<(u64, PipelineOp)>>, u64) {
    let p = s.pipeline_size;
    let stages = p * s.num_model_chunks;
    let ops: Vec<Vec<PipelineOp>> = (0..p).map(|r| s.ops(r).unwrap()).collect();
    // channel (pass, receiving rank) -> queue of (arrival time, message)
    let mut chans: HashMap<(Pass, usize), VecDeque<(u64, Msg)>> = HashMap::new();
    let mut next = vec![0usize; p];
    let mut free = vec![0u64; p];
    let mut started: Vec<Vec<(u64, PipelineOp)>> = vec![Vec::new(); p];
    loop {
        let mut progressed = false;
        for r in 0..p {
            let Some(&op) = ops[r].get(next[r]) else {
                continue;
            };
            let vs = virtual_stage(p, r, op.chunk);
            let needs = match op.pass {
                Pass::Forward => vs.checked_sub(1),
                Pass::Backward => (vs + 1 < stages).then_some(vs + 1),
            };
            let mut start = free[r];
            if let Some(from) = needs {
                let q = chans.entry((op.pass, r)).or_default();
                let Some(&(at, msg)) = q.front() else {
                    continue;
                };
                assert_eq!(
                    msg,
                    (op.microbatch, from),
                    "rank {r} {op}: out-of-order message"
                );
                q.pop_front();
                start = start.max(at);
            }
            let cost = if op.pass == Pass::Forward { f } else { b };
            let end = start + cost;
            let to = match op.pass {
                Pass::Forward => (vs + 1 < stages).then_some((r + 1) % p),
                Pass::Backward => (vs > 0).then_some((r + p - 1) % p),
            };
            if let Some(to) = to {
                chans
                    .entry((op.pass, to))
                    .or_default()
                    .push_back((end, (op.microbatch, vs)));
            }
            free[r] = end;
            started[r].push((start, op));
            next[r] += 1;
            progressed = true;
        }
        if (0..p).all(|r| next[r] == ops[r].len()) {
            break;
        }
        assert!(progressed, "deadlock in {s:?} at {next:?}");
    }
    let makespan = *free.iter().max().unwrap();
    (started, makespan)
}

fn matrix() -> Vec<PipelineSchedule> {
    let mut out = Vec::new();
    for p in [2, 4, 8] {
        for m in [p, 2 * p, 4 * p] {
            for v in [1, 2, 4] {
                for g in [p, m] {
                    out.push(
                        PipelineSchedule::new(p, m)
                            .with_model_chunks(v)
                            .with_microbatch_group_size(Some(g)),
                    );
                }
            }
        }
    }
    out
}

#[test]
fn every_layout_of_the_matrix() {
    for s in matrix() {
        let (p, m, v, g) = (
            s.pipeline_size,
            s.num_microbatches,
            s.num_model_chunks,
            s.microbatch_group_size_per_vp_stage,
        );
        let table = schedule_table(m, v, g);
        let expected: Vec<_> = (0..m * v).map(|k| closed_form(k, p, m, v, g)).collect();
        assert_eq!(table, expected, "{s:?}");
        for r in 0..p {
            let warmup = if v == 1 {
                (p - r - 1).min(m)
            } else {
                ((p - r - 1) * 2 + (v - 1) * g).min(m * v)
            };
            assert_eq!(s.num_warmup(r), warmup, "{s:?} rank {r}");
            assert_eq!(num_warmup_microbatches(p, r, m, v, g), warmup);
            let ops = s.ops(r).unwrap();
            // Forwards in table order, backwards in table order with chunks reversed.
            let fwd: Vec<_> = ops
                .iter()
                .filter(|o| o.pass == Pass::Forward)
                .map(|o| (o.microbatch, o.chunk))
                .collect();
            let bwd: Vec<_> = ops
                .iter()
                .filter(|o| o.pass == Pass::Backward)
                .map(|o| (o.microbatch, v - 1 - o.chunk))
                .collect();
            assert_eq!(fwd, table, "{s:?} rank {r} forwards");
            assert_eq!(bwd, table, "{s:?} rank {r} backwards");
            // Each forward once, each backward once and after its forward; at most
            // warmup + 1 microbatches hold activations.
            let (mut live, mut peak, mut seen) = (HashSet::new(), 0, HashSet::new());
            for o in &ops {
                assert!(seen.insert(*o), "{s:?} rank {r}: {o} twice");
                match o.pass {
                    Pass::Forward => {
                        live.insert((o.microbatch, o.chunk));
                    }
                    Pass::Backward => assert!(
                        live.remove(&(o.microbatch, o.chunk)),
                        "{s:?} rank {r}: {o} before its forward"
                    ),
                }
                peak = peak.max(live.len());
            }
            assert_eq!(ops.len(), 2 * m * v);
            assert_eq!(peak, (warmup + 1).min(m * v), "{s:?} rank {r} peak");
            if v == 1 {
                assert!(peak <= p, "1F1B holds at most P microbatches");
            }
        }
        simulate(&s, 1, 2);
    }
}

#[test]
fn one_f_one_b_bubble_is_megatrons_formula() {
    // Uniform stages, forward 1 and backward 2: the makespan is (M + P − 1)·(f + b), so the
    // idle fraction is (P − 1)/(M + P − 1).
    for p in [2, 4, 8] {
        for m in [p, 2 * p, 4 * p] {
            let (_, makespan) = simulate(&PipelineSchedule::new(p, m), 1, 2);
            assert_eq!(makespan, (m + p - 1) as u64 * 3, "P {p} M {m}");
        }
    }
    // Interleaving with V chunks of 1/V the work: the bubble shrinks to (P − 1)/(V·M + P − 1)
    // of an ideal step's work when G = P.
    for (p, m, v) in [(2, 4, 2), (4, 8, 2), (4, 8, 4)] {
        let s = PipelineSchedule::new(p, m).with_model_chunks(v);
        let (_, makespan) = simulate(&s, 1, 2);
        let ideal = (m * v * 3) as u64;
        assert_eq!(makespan - ideal, (p - 1) as u64 * 3, "P {p} M {m} V {v}");
    }
}

#[test]
fn all_forward_first_holds_every_microbatch() {
    let s = PipelineSchedule::new(2, 3).with_all_forward_first(true);
    assert_eq!(ops_str(&s.ops(1).unwrap()), "F0.0 F1.0 F2.0 B0.0 B1.0 B2.0");
    for s in matrix() {
        let s = s.with_all_forward_first(true);
        let total = s.num_microbatches * s.num_model_chunks;
        for r in 0..s.pipeline_size {
            assert_eq!(s.num_warmup(r), total);
        }
        simulate(&s, 1, 2);
    }
}

#[test]
fn forward_only_runs_every_forward_in_table_order() {
    for s in matrix() {
        let s = s.with_forward_only(true);
        for r in 0..s.pipeline_size {
            let ops = s.ops(r).unwrap();
            assert!(ops.iter().all(|o| o.pass == Pass::Forward));
            let table = schedule_table(
                s.num_microbatches,
                s.num_model_chunks,
                s.microbatch_group_size_per_vp_stage,
            );
            let got: Vec<_> = ops.iter().map(|o| (o.microbatch, o.chunk)).collect();
            assert_eq!(got, table);
        }
        simulate(&s, 1, 0);
    }
}

#[test]
fn bad_combinations_are_refused_with_their_numbers() {
    let err = |s: PipelineSchedule| s.ops(0).unwrap_err();
    assert_eq!(
        err(PipelineSchedule::new(2, 0)),
        ScheduleError::Zero {
            what: "the number of microbatches M"
        }
    );
    assert!(matches!(
        err(PipelineSchedule::new(0, 4)),
        ScheduleError::Zero { .. }
    ));
    assert!(matches!(
        err(PipelineSchedule::new(2, 4).with_model_chunks(0)),
        ScheduleError::Zero { .. }
    ));
    let e = err(PipelineSchedule::new(1, 4).with_model_chunks(2));
    assert_eq!(
        e,
        ScheduleError::VirtualWithoutPipeline {
            num_model_chunks: 2,
            pipeline_size: 1
        }
    );
    assert!(e.to_string().contains("P = 1"), "{e}");
    // G below P, G above M, M below P.
    for (p, m, g) in [(4, 8, 2), (2, 4, 6), (4, 2, 4)] {
        let e = err(PipelineSchedule::new(p, m)
            .with_model_chunks(2)
            .with_microbatch_group_size(Some(g)));
        assert_eq!(
            e,
            ScheduleError::GroupSizeOutOfRange {
                group_size: g,
                pipeline_size: p,
                num_microbatches: m
            }
        );
        assert!(e.to_string().contains(&format!("[{p}, {m}]")), "{e}");
    }
    // M not divisible by G = P: remainder 1 < P.
    let e = err(PipelineSchedule::new(2, 5).with_model_chunks(2));
    assert_eq!(
        e,
        ScheduleError::FinalGroupTooSmall {
            num_microbatches: 5,
            group_size: 2,
            remainder: 1,
            pipeline_size: 2
        }
    );
    assert!(e.to_string().contains("M = 5"), "{e}");
    // A remainder in [P, G) is fine: M 7, G 4, P 2.
    let ok = PipelineSchedule::new(2, 7)
        .with_model_chunks(2)
        .with_microbatch_group_size(Some(4));
    ok.validate().unwrap();
    simulate(&ok, 1, 2);
    // Without interleaving, any M ≥ 1 works, also below P.
    PipelineSchedule::new(4, 3).validate().unwrap();
    assert_eq!(
        PipelineSchedule::new(2, 4).ops(2).unwrap_err(),
        ScheduleError::RankOutOfRange {
            rank: 2,
            pipeline_size: 2
        }
    );
    let e = layer_offset(6, 2, 2, 0, 0).unwrap_err();
    assert_eq!(
        e,
        TopologyError::LayersNotDivisible {
            num_layers: 6,
            pipeline_size: 2,
            num_model_chunks: 2
        }
    );
    assert!(e.to_string().contains("4 virtual stages"), "{e}");
}

#[test]
fn layer_offsets_cover_the_model_once() {
    for (l, p, v) in [(8, 2, 2), (8, 4, 1), (12, 2, 3), (16, 4, 4)] {
        let per = l / (p * v);
        let mut layers: Vec<usize> = Vec::new();
        for r in 0..p {
            for c in 0..v {
                let off = layer_offset(l, p, v, r, c).unwrap();
                // Virtual stage order is layer order.
                assert_eq!(off, virtual_stage(p, r, c) * per);
                layers.extend(off..off + per);
            }
        }
        layers.sort_unstable();
        assert_eq!(layers, (0..l).collect::<Vec<_>>());
    }
}
