//! Choosing tokens from vocabulary-parallel logits without gathering the vocabulary: greedy,
//! temperature / top-k / top-p sampling and accuracy, each rank holding `[b, V/tp]`.
//!
//! Every rank sends only candidates: its best token (greedy, accuracy), its `k` best (top-k),
//! or its `m` best and the sum of its softmax terms (top-p or plain sampling), `m` doubling
//! until the ranks' candidates decide the draw. The union of every rank's `m` best holds the
//! global `m` best, so the tokens are those [`Sampling`] picks from the gathered row: exactly
//! for greedy and top-k, and for top-p and plain sampling up to the order in which the
//! normaliser is summed (the same distribution; a draw at the border of two tokens, within
//! 1e-15 of it, may land on the other one).
//!
//! Ranks sample in lockstep: they draw from one seed, and [`VocabParallelSampler`] checks that
//! their prompts, batch and step agree, so a rank fed another prompt is an error on every
//! rank, not a silent divergence.

use super::TpError;
use crate::comm::{Comm, CommunicatorExt, ReduceOp};
use burn::config::Config;
use burn::tensor::{Int, Tensor};
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

/// How the next token is chosen.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the first of equals, as `torch.argmax`).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, restricted to the `top_k` most likely
    /// tokens and then to the smallest set whose probability reaches `top_p`.
    Sample {
        /// Above 0; 1 leaves the distribution as it is.
        temperature: f64,
        /// Keep this many tokens (`None`: all).
        top_k: Option<usize>,
        /// Keep the most likely tokens up to this cumulative probability, in `(0, 1]`
        /// (`None`: all).
        top_p: Option<f64>,
    },
}

impl Sampling {
    /// Why these parameters cannot sample, if they cannot.
    pub fn check(&self) -> Result<(), TpError> {
        let bad = |m: String| Err(TpError::Invalid(m));
        if let Sampling::Sample {
            temperature,
            top_k,
            top_p,
        } = *self
        {
            if !(temperature.is_finite() && temperature > 0.0) {
                return bad(format!("temperature must be above 0, got {temperature}"));
            }
            if top_k == Some(0) {
                return bad("top_k must be at least 1".into());
            }
            if let Some(p) = top_p
                && !(p > 0.0 && p <= 1.0)
            {
                return bad(format!("top_p must be in (0, 1], got {p}"));
            }
        }
        Ok(())
    }
}

/// A token and its logit; candidates order by logit, then by id (the first of equals).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Candidate {
    logit: f32,
    id: u32,
}

/// Before: a higher logit, or an equal one with a lower id.
fn before(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// One rank's share of the rows: its logits of the real vocabulary, and the id of its first.
struct Shard {
    rows: Vec<Vec<f32>>,
    start: u32,
}

impl Shard {
    /// This rank's `[b, V/tp]` logits, cut to the ids below `real_vocab` (padding rows of a
    /// padded vocabulary are never chosen).
    fn read(logits: Tensor<2>, real_vocab: usize, tp: &Comm) -> Result<Self, TpError> {
        let [b, local] = logits.dims();
        let (rank, size) = (tp.group().rank(), tp.group().size());
        if real_vocab == 0 || real_vocab > local * size {
            return Err(TpError::Invalid(format!(
                "a real vocabulary of {real_vocab} tokens does not fit {size} ranks × {local} \
                 logits each"
            )));
        }
        let start = rank * local;
        let keep = real_vocab.saturating_sub(start).min(local);
        let values = match keep {
            0 => Ok(Vec::new()),
            _ => logits
                .narrow(1, 0, keep)
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>(),
        };
        let values = values.map_err(|e| TpError::Invalid(format!("logits unreadable: {e:?}")))?;
        let rows = match keep {
            0 => vec![Vec::new(); b],
            _ => values.chunks(keep).map(<[f32]>::to_vec).collect(),
        };
        Ok(Self {
            rows,
            start: start as u32,
        })
    }

    /// Row `i`'s `m` best candidates, best first.
    fn best(&self, i: usize, m: usize) -> Vec<Candidate> {
        let mut all: Vec<Candidate> = (self.rows[i].iter().enumerate())
            .map(|(j, &logit)| Candidate {
                logit,
                id: self.start + j as u32,
            })
            .collect();
        let m = m.min(all.len());
        if m < all.len() {
            all.select_nth_unstable_by(m, before);
            all.truncate(m);
        }
        all.sort_by(before);
        all
    }
}

/// Every rank's best `m` candidates of a row, merged.
struct Merged {
    candidates: Vec<Candidate>,
    /// How many lead in the global order for sure: up to and including the worst one a rank
    /// with more to send sent (the union of each rank's `m` best holds all before it).
    exact: usize,
    /// Whether every rank sent all it has.
    complete: bool,
}

/// Every rank's best `m` candidates of each of `rows`, merged row by row: one pair of
/// all-gathers for all the rows.
fn gather(shard: &Shard, rows: &[usize], m: usize, tp: &Comm) -> Result<Vec<Merged>, TpError> {
    // Per row, `m` logits, and `m` ids (-1: none) then whether the rank had more to send.
    let mut logits = vec![f32::NEG_INFINITY; rows.len() * m];
    let mut ids = vec![-1i64; rows.len() * (m + 1)];
    for (k, &i) in rows.iter().enumerate() {
        let mine = shard.best(i, m);
        for (j, c) in mine.iter().enumerate() {
            (logits[k * m + j], ids[k * (m + 1) + j]) = (c.logit, i64::from(c.id));
        }
        ids[k * (m + 1) + m] = i64::from(mine.len() < shard.rows[i].len());
    }
    let (logits, ids) = (tp.all_gather_vec(logits)?, tp.all_gather_vec(ids)?);
    let per_rank = (rows.len() * m, rows.len() * (m + 1));
    let merge = |k: usize| {
        let mut merged = Vec::new();
        let mut bound: Option<Candidate> = None;
        let mut complete = true;
        for (l, id) in logits.chunks(per_rank.0).zip(ids.chunks(per_rank.1)) {
            let (l, id) = (&l[k * m..(k + 1) * m], &id[k * (m + 1)..(k + 1) * (m + 1)]);
            let sent: Vec<Candidate> = (0..m)
                .filter(|&j| id[j] >= 0)
                .map(|j| Candidate {
                    logit: l[j],
                    id: id[j] as u32,
                })
                .collect();
            complete &= id[m] == 0;
            if id[m] == 1
                && let Some(&last) = sent.last()
                && bound.is_none_or(|b| before(&last, &b).is_lt())
            {
                bound = Some(last);
            }
            merged.extend(sent);
        }
        merged.sort_by(before);
        let exact = match bound {
            Some(b) => merged.iter().take_while(|c| before(c, &b).is_le()).count(),
            None => merged.len(),
        };
        Merged {
            candidates: merged,
            exact,
            complete,
        }
    };
    Ok((0..rows.len()).map(merge).collect())
}

/// Each row's largest logit's id over the ranks (the lowest id among equals).
fn best_ids(shard: &Shard, tp: &Comm) -> Result<Vec<u32>, TpError> {
    let rows: Vec<usize> = (0..shard.rows.len()).collect();
    Ok(gather(shard, &rows, 1, tp)?
        .iter()
        .map(|m| m.candidates[0].id)
        .collect())
}

/// Row by row, the id of the largest of this rank's `[b, V/tp]` logits over the ranks (the
/// lowest id among equals), below `real_vocab`: `[b]` ids on the logits' device, as Burn's
/// `argmax(1)` gives them for the whole row (flattened). A collective over `tp`; every rank
/// gets the same ids, and only one candidate per rank and row is sent.
pub fn vocab_parallel_argmax(
    logits: Tensor<2>,
    real_vocab: usize,
    tp: &Comm,
) -> Result<Tensor<1, Int>, TpError> {
    let device = logits.device();
    let ids = argmax_ids(logits, real_vocab, tp)?;
    let ids: Vec<i64> = ids.into_iter().map(i64::from).collect();
    let n = ids.len();
    Ok(Tensor::from_data(
        burn::tensor::TensorData::new(ids, [n]),
        &device,
    ))
}

fn argmax_ids(logits: Tensor<2>, real_vocab: usize, tp: &Comm) -> Result<Vec<u32>, TpError> {
    best_ids(&Shard::read(logits, real_vocab, tp)?, tp)
}

/// How many of the rows' argmax ids ([`vocab_parallel_argmax`]) equal their targets, and
/// how many rows count (targets equal to `ignore_index` do not): `(correct, counted)`, the
/// same on every rank.
pub fn vocab_parallel_accuracy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    ignore_index: Option<i64>,
    real_vocab: usize,
    tp: &Comm,
) -> Result<(usize, usize), TpError> {
    let [n, _] = logits.dims();
    if targets.dims()[0] != n {
        return Err(TpError::Invalid(format!(
            "{} targets for {n} rows of logits",
            targets.dims()[0]
        )));
    }
    let predicted = argmax_ids(logits, real_vocab, tp)?;
    let targets = targets.into_data().convert::<i64>().try_to_vec::<i64>();
    let targets = targets.map_err(|e| TpError::Invalid(format!("targets unreadable: {e:?}")))?;
    let counted = targets
        .iter()
        .zip(&predicted)
        .filter(|(t, _)| Some(**t) != ignore_index);
    let (mut correct, mut total) = (0, 0);
    for (&t, &p) in counted {
        total += 1;
        correct += usize::from(t == i64::from(p));
    }
    Ok((correct, total))
}

/// Draws tokens from vocabulary-parallel logits, the same on every tensor-parallel rank.
///
/// ```
/// use burn_megatron::comm::LocalWorld;
/// use burn_megatron::tensor_parallel::{Sampling, VocabParallelSampler};
/// use burn::tensor::{Device, Tensor};
/// let tp: burn_megatron::comm::Comm =
///     std::sync::Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
/// let mut sampler = VocabParallelSampler::new(Sampling::Greedy, 0, 4, &tp).unwrap();
/// sampler.check_prompts(&[vec![1, 2]]).unwrap();
/// let logits = Tensor::<2>::from_floats([[0.0, 3.0, 3.0, 1.0]], &Device::flex());
/// assert_eq!(sampler.sample(logits).unwrap(), vec![1]);
/// ```
#[derive(Debug)]
pub struct VocabParallelSampler {
    sampling: Sampling,
    seed: u64,
    rng: ChaCha8Rng,
    real_vocab: usize,
    tp: Comm,
    step: u64,
}

impl VocabParallelSampler {
    /// A sampler drawing with `seed` (every rank passes the same) from the first
    /// `real_vocab` ids, over the ranks of `tp`.
    pub fn new(
        sampling: Sampling,
        seed: u64,
        real_vocab: usize,
        tp: &Comm,
    ) -> Result<Self, TpError> {
        sampling.check()?;
        Ok(Self {
            sampling,
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            real_vocab,
            tp: tp.clone(),
            step: 0,
        })
    }

    /// An error on every rank unless every rank passes the same prompts and built the
    /// sampler alike (sampling, seed, vocabulary).
    pub fn check_prompts(&self, prompts: &[Vec<u32>]) -> Result<(), TpError> {
        let mut h = Fnv::default();
        h.add(&format!(
            "{:?} {} {}",
            self.sampling, self.seed, self.real_vocab
        ));
        for p in prompts {
            h.add(&format!("{p:?};"));
        }
        self.agree(
            h.0 as i64,
            "their prompts, sampling, seed or vocabulary differ",
        )
    }

    /// One token per row of this rank's `[b, V/tp]` logits (the last position's), the same
    /// on every rank. Errors on every rank when ranks call it with other batch sizes or at
    /// other steps.
    pub fn sample(&mut self, logits: Tensor<2>) -> Result<Vec<u32>, TpError> {
        let [b, _] = logits.dims();
        self.agree(
            ((self.step as i64) << 20) ^ b as i64,
            "they sample other batches or steps",
        )?;
        self.step += 1;
        let shard = Shard::read(logits, self.real_vocab, &self.tp)?;
        let Sampling::Sample {
            temperature,
            top_k,
            top_p,
        } = self.sampling
        else {
            return best_ids(&shard, &self.tp);
        };
        (0..b)
            .map(|i| {
                let u = self.rng.random::<f64>();
                let rule = (temperature, top_k, top_p);
                draw(&shard, i, rule, u, self.real_vocab, &self.tp)
            })
            .collect()
    }

    fn agree(&self, value: i64, why: &str) -> Result<(), TpError> {
        let (mut hi, mut lo) = (vec![value], vec![value]);
        self.tp.all_reduce_vec(&mut hi, ReduceOp::Max)?;
        self.tp.all_reduce_vec(&mut lo, ReduceOp::Min)?;
        match hi == lo {
            true => Ok(()),
            false => Err(TpError::Invalid(format!(
                "the tensor-parallel ranks diverged at step {}: {why}",
                self.step
            ))),
        }
    }
}

/// FNV-1a, 64 bits: a fingerprint of what each rank generates from.
#[derive(Default)]
struct Fnv(u64);

impl Fnv {
    fn add(&mut self, s: &str) {
        if self.0 == 0 {
            self.0 = 0xcbf2_9ce4_8422_2325;
        }
        for b in s.bytes() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// Row `i`'s token for the uniform draw `u`: [`Sampling::Sample`]'s rule on the gathered
/// candidates, gathering twice as many while they do not decide it.
fn draw(
    shard: &Shard,
    i: usize,
    (temperature, top_k, top_p): (f64, Option<usize>, Option<f64>),
    u: f64,
    real_vocab: usize,
    tp: &Comm,
) -> Result<u32, TpError> {
    let mut m = top_k.unwrap_or(64).clamp(1, real_vocab);
    let mut normaliser: Option<f64> = None;
    loop {
        let Merged {
            candidates: merged,
            exact,
            complete,
        } = gather(shard, &[i], m, tp)?.remove(0);
        let max = f64::from(merged[0].logit);
        let term = |c: &Candidate| ((f64::from(c.logit) - max) / temperature).exp();
        let (mut order, total) = match top_k {
            // Every rank sent its k best: the global k best are exact.
            Some(k) => {
                let order: Vec<Candidate> = merged.into_iter().take(k).collect();
                let total = order.iter().map(term).sum::<f64>();
                (order, total)
            }
            None => {
                let z = match normaliser {
                    Some(z) => z,
                    None => {
                        let local: f64 = (shard.rows[i].iter())
                            .map(|&l| ((f64::from(l) - max) / temperature).exp())
                            .sum();
                        let bits = tp.all_gather_vec(vec![local.to_bits() as i64])?;
                        *normaliser.insert(bits.iter().map(|&b| f64::from_bits(b as u64)).sum())
                    }
                };
                (merged.into_iter().take(exact).collect(), z)
            }
        };
        let mut probs: Vec<f64> = order.iter().map(|c| term(c) / total).collect();
        let mut decided = top_k.is_some() || complete;
        if let Some(top_p) = top_p {
            let mut mass = 0.0;
            match probs.iter().position(|p| {
                mass += p;
                mass >= top_p
            }) {
                Some(at) => {
                    probs.truncate(at + 1);
                    order.truncate(at + 1);
                    decided = true;
                }
                None if !decided => {
                    m = (2 * m).min(real_vocab);
                    continue;
                }
                None => {}
            }
        }
        let kept: f64 = match decided {
            true => probs.iter().sum(),
            // Not cut: the draw walks the whole distribution, whose mass is 1.
            false => 1.0,
        };
        let mut left = u * kept;
        for (p, c) in probs.iter().zip(&order) {
            left -= p;
            if left < 0.0 {
                return Ok(c.id);
            }
        }
        if decided {
            return Ok(order[order.len() - 1].id);
        }
        m = (2 * m).min(real_vocab);
    }
}

#[cfg(test)]
mod tests;
