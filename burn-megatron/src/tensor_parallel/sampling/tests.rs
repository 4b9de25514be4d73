use super::*;
use crate::comm::LocalWorld;
use burn::tensor::{Device, TensorData};
use std::sync::Arc;

/// The rule on a whole gathered row, as generation applied it before the vocabulary stayed
/// split: the reference every vocabulary-parallel draw is compared with.
fn choose(logits: &[f32], sampling: &Sampling, rng: &mut ChaCha8Rng) -> u32 {
    let argmax = |xs: &[f32]| {
        let mut best = 0;
        for (i, &x) in xs.iter().enumerate() {
            if x > xs[best] {
                best = i;
            }
        }
        best as u32
    };
    let Sampling::Sample {
        temperature,
        top_k,
        top_p,
    } = *sampling
    else {
        return argmax(logits);
    };
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(top_k.unwrap_or(order.len()).min(order.len()));
    let max = f64::from(logits[order[0]]);
    let mut probs: Vec<f64> = order
        .iter()
        .map(|&i| ((f64::from(logits[i]) - max) / temperature).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(top_p) = top_p {
        let mut mass = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                mass += p;
                mass >= top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        order.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let mut draw = rng.random::<f64>() * total;
    for (p, &i) in probs.iter().zip(&order) {
        draw -= p;
        if draw < 0.0 {
            return i as u32;
        }
    }
    order[order.len() - 1] as u32
}

/// `f(rank, tp)` on `n` ranks as threads, the results in rank order.
fn ranks<T: Send>(n: usize, f: impl Fn(usize, &Comm) -> T + Sync) -> Vec<T> {
    let world = LocalWorld::new(n);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let tp: Comm = Arc::new(world.communicator("tp", (0..n).collect(), r).unwrap());
                let f = &f;
                s.spawn(move || f(r, &tp))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank `r`'s `[b, v/n]` slice of the `[b, v]` rows.
fn slice(rows: &[Vec<f32>], r: usize, n: usize) -> Tensor<2> {
    let per = rows[0].len() / n;
    let v: Vec<f32> = rows
        .iter()
        .flat_map(|row| row[r * per..(r + 1) * per].to_vec())
        .collect();
    Tensor::from_data(TensorData::new(v, [rows.len(), per]), &Device::flex())
}

fn ids(t: Tensor<1, Int>) -> Vec<i64> {
    t.into_data().iter::<i64>().collect()
}

/// `b` rows of `v` logits, peaked enough that top-p needs a few hundred tokens at most.
fn rows(b: usize, v: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..b)
        .map(|_| {
            (0..v)
                .map(|_| (rng.random::<f32>() * 8.0).powi(2) / 8.0)
                .collect()
        })
        .collect()
}

#[test]
fn every_rule_draws_the_tokens_of_the_gathered_row_at_tp_2_and_4() {
    let (b, v, steps) = (3, 512, 40);
    let rules = [
        Sampling::Greedy,
        Sampling::Sample {
            temperature: 0.7,
            top_k: Some(20),
            top_p: None,
        },
        Sampling::Sample {
            temperature: 1.3,
            top_k: Some(50),
            top_p: Some(0.8),
        },
        Sampling::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.9),
        },
        Sampling::Sample {
            temperature: 0.5,
            top_k: None,
            top_p: None,
        },
    ];
    for rule in rules {
        let all: Vec<Vec<Vec<f32>>> = (0..steps).map(|s| rows(b, v, s as u64)).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let want: Vec<Vec<u32>> = (all.iter())
            .map(|step| {
                step.iter()
                    .map(|row| choose(row, &rule, &mut rng))
                    .collect()
            })
            .collect();
        for n in [1, 2, 4] {
            let got = ranks(n, |r, tp| {
                let mut sampler = VocabParallelSampler::new(rule, 11, v, tp).unwrap();
                sampler.check_prompts(&[vec![1, 2, 3]]).unwrap();
                (all.iter())
                    .map(|step| sampler.sample(slice(step, r, n)).unwrap())
                    .collect::<Vec<_>>()
            });
            for (r, g) in got.iter().enumerate() {
                assert_eq!(g, &want, "{rule:?}, TP {n}, rank {r}");
            }
        }
    }
}

#[test]
fn ties_go_to_the_lowest_id_across_ranks_and_padding_is_never_chosen() {
    // A tie between rank 0's last id (3) and rank 1's first (4); ids 6 and 7 pad the
    // vocabulary (real size 6) and hold the largest logits.
    let row = vec![vec![0.0, 1.0, 0.5, 2.0, 2.0, 1.0, 9.0, 9.0]];
    let got = ranks(2, |r, tp| {
        ids(vocab_parallel_argmax(slice(&row, r, 2), 6, tp).unwrap())
    });
    assert_eq!(got, vec![vec![3], vec![3]]);
    let got = ranks(4, |r, tp| {
        ids(vocab_parallel_argmax(slice(&row, r, 4), 8, tp).unwrap())
    });
    assert_eq!(got, vec![vec![6]; 4]);
    let e = ranks(2, |r, tp| {
        vocab_parallel_argmax(slice(&row, r, 2), 9, tp).unwrap_err()
    });
    assert!(e[0].to_string().contains("9 tokens"), "{}", e[0]);
}

#[test]
fn accuracy_is_the_gathered_rows_and_skips_ignored_targets() {
    let all = rows(6, 64, 3);
    let best: Vec<i64> = (all.iter())
        .map(|row| {
            i64::from(choose(
                row,
                &Sampling::Greedy,
                &mut ChaCha8Rng::seed_from_u64(0),
            ))
        })
        .collect();
    // Rows 0-2 right, row 3 wrong, rows 4-5 ignored.
    let targets: Vec<i64> = vec![best[0], best[1], best[2], (best[3] + 1) % 64, -100, -100];
    let got = ranks(4, |r, tp| {
        let t = Tensor::<1, Int>::from_data(TensorData::new(targets.clone(), [6]), &Device::flex());
        vocab_parallel_accuracy(slice(&all, r, 4), t, Some(-100), 64, tp).unwrap()
    });
    assert_eq!(got, vec![(3, 4); 4]);
}

#[test]
fn ranks_that_diverge_fail_together() {
    let errs = ranks(2, |r, tp| {
        let sampler = VocabParallelSampler::new(Sampling::Greedy, 0, 8, tp).unwrap();
        sampler
            .check_prompts(&[vec![1, 2 + r as u32]])
            .unwrap_err()
            .to_string()
    });
    assert!(errs.iter().all(|e| e.contains("diverged")), "{errs:?}");
    // One rank a step ahead of the other.
    let row = vec![vec![0.0; 8]];
    let errs = ranks(2, |r, tp| {
        let mut sampler = VocabParallelSampler::new(Sampling::Greedy, 0, 8, tp).unwrap();
        if r == 0 {
            sampler.step = 1;
        }
        sampler.sample(slice(&row, r, 2)).unwrap_err().to_string()
    });
    assert!(
        errs.iter().all(|e| e.contains("other batches or steps")),
        "{errs:?}"
    );
    let bad = Sampling::Sample {
        temperature: 0.0,
        top_k: None,
        top_p: None,
    };
    let solo: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
    assert!(VocabParallelSampler::new(bad, 0, 8, &solo).is_err());
}

#[test]
fn sampling_follows_the_softmax_and_respects_top_k() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let logits = [0.0f32, (2.0f32).ln(), -30.0];
    let all = Sampling::Sample {
        temperature: 1.0,
        top_k: None,
        top_p: None,
    };
    let n = 20_000;
    let ones = (0..n)
        .filter(|_| choose(&logits, &all, &mut rng) == 1)
        .count();
    // P(1) = 2/3: the reference itself is right.
    let p = ones as f64 / n as f64;
    assert!((p - 2.0 / 3.0).abs() < 0.02, "{p}");
    let k2 = Sampling::Sample {
        temperature: 5.0,
        top_k: Some(2),
        top_p: None,
    };
    assert!((0..2000).all(|_| choose(&logits, &k2, &mut rng) != 2));
}
