//! Text generation with a [`Gpt`] at any tensor-parallel size, whole or in pipeline stages:
//! greedy decoding or temperature / top-k / top-p sampling with a seed, a key/value cache,
//! batched prompts of different lengths (left-padded, each at its own positions, as
//! `transformers` does), and a stop at EOS or after `max_new_tokens`.
//!
//! Each step chooses from the last position's vocabulary-parallel logits without gathering
//! the vocabulary ([`VocabParallelSampler`]): every rank draws the same token from the same
//! seed, and ranks fed other prompts fail together. In stages, each step's hidden states go
//! round the pipeline's virtual stages as in training (each chunk keeps its own layers'
//! cache), the last stage draws, and its tokens go back to every stage.

use super::{Gpt, GptStageOutput, KvCache, Positions};
use crate::comm::tensor::{recv_sized, send_sized};
use crate::comm::{Buffer, Comm, CommError, CommunicatorExt, solo_group};
use crate::tensor_parallel::{Sampling, TpError, VocabParallelSampler};
use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use std::hash::{Hash, Hasher};

/// How [`generate`] runs.
#[derive(Config, Debug)]
pub struct GenerateConfig {
    /// Tokens to add to each prompt at most.
    pub max_new_tokens: usize,
    /// Greedy or sampled ([`Sampling`], in `tensor_parallel`).
    #[config(default = "Sampling::Greedy")]
    pub sampling: Sampling,
    /// Seed of the draws.
    #[config(default = 0)]
    pub seed: u64,
    /// A prompt's generation ends after it emits this token.
    #[config(default = "None")]
    pub eos_token_id: Option<u32>,
    /// The id left-padding fills with (never attended to).
    #[config(default = 0)]
    pub pad_token_id: u32,
    /// Keep every layer's keys and values instead of re-running the whole sequence each
    /// step (the same tokens either way).
    #[config(default = true)]
    pub use_cache: bool,
}

/// The new tokens of each prompt, ending with the EOS token if one was emitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generated {
    /// Per prompt, in order.
    pub tokens: Vec<Vec<u32>>,
}

/// Why generation could not run.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The prompts or the configuration cannot be generated from.
    #[error("{0}")]
    Invalid(String),
    /// The model refused its input.
    #[error(transparent)]
    Model(#[from] TpError),
    /// Agreeing on the tokens across the ranks failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Generates from each of `prompts` (token ids) with `model`, a whole model (no pipeline
/// stages, no sequence parallelism). A collective: every tensor-parallel rank calls it with
/// the same prompts and config, and all get the same tokens.
///
/// Errors before any work on an empty prompt, a prompt that with `max_new_tokens` would
/// not fit the model's context (`max_position_embeddings`), an id outside the vocabulary,
/// or bad sampling parameters.
pub fn generate(
    model: &Gpt,
    prompts: &[Vec<u32>],
    config: &GenerateConfig,
) -> Result<Generated, GenerateError> {
    generate_stages(
        std::slice::from_ref(model),
        &solo_group("generate"),
        prompts,
        config,
    )
}

/// [`generate`] with a model in pipeline stages: `chunks` are this rank's model chunks in
/// order (built by `init_stage` at `PipelinePosition::of(&state, chunk)`), `pp` its
/// pipeline group (`ctx.groups.pp`). A collective over the tensor- and pipeline-parallel
/// ranks: all call it with the same prompts and config, and all get the same tokens.
///
/// Besides [`generate`]'s, errors before any work, on every pipeline rank, when a rank's
/// chunks do not hold the embedding exactly at the first virtual stage and the head exactly at
/// the last, when the ranks' chunks do not hold the layers in order (built under another
/// layout), and when their prompts, config or chunk counts differ. A rank that refuses says
/// why; the others name it.
pub fn generate_stages(
    chunks: &[Gpt],
    pp: &Comm,
    prompts: &[Vec<u32>],
    config: &GenerateConfig,
) -> Result<Generated, GenerateError> {
    // Every check first, then one agreement: a rank's refusal is then every rank's error,
    // not a wait for messages that never come.
    let local = Ring::new(chunks, pp).and_then(|ring| {
        check(&chunks[0], prompts, config)?;
        Ok(ring)
    });
    let ring = agree(pp, chunks, prompts, config, local)?;
    let device = chunks
        .iter()
        .flat_map(|c| c.devices())
        .next()
        .ok_or_else(|| GenerateError::Invalid("the model chunks hold no parameters".into()))?;
    let (b, width) = (
        prompts.len(),
        prompts.iter().map(Vec::len).max().unwrap_or(0),
    );
    // Left-padded rows, each token at its own position.
    let mut rows: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| [vec![config.pad_token_id; width - p.len()], p.clone()].concat())
        .collect();
    let mut padded: Vec<Vec<bool>> = prompts
        .iter()
        .map(|p| (0..width).map(|j| j < width - p.len()).collect())
        .collect();
    let pads: Vec<usize> = prompts.iter().map(|p| width - p.len()).collect();
    let mut done = vec![false; b];
    let mut out = vec![Vec::new(); b];
    // Only the ranks of the last virtual stage see logits and draw.
    let mut sampler = match chunks.last().filter(|_| ring.holds_last()) {
        Some(last) => {
            let s = VocabParallelSampler::new(
                config.sampling,
                config.seed,
                last.vocab_size(),
                last.tp(),
            )?;
            s.check_prompts(prompts)?;
            Some(s)
        }
        None => None,
    };
    let mut caches: Vec<Option<KvCache>> = chunks
        .iter()
        .map(|_| config.use_cache.then(KvCache::default))
        .collect();
    for step in 0..config.max_new_tokens {
        // With the cache, only the newest token after the first step.
        let from = if step > 0 && config.use_cache {
            rows[0].len() - 1
        } else {
            0
        };
        let ids: Vec<i64> = rows
            .iter()
            .flat_map(|r| r[from..].iter().map(|&t| i64::from(t)))
            .collect();
        let s = rows[0].len() - from;
        let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, s]), &device);
        // Left padding sits at position 0 (masked anyway); a prompt counts from 0.
        let positions = Positions::PerSample(
            pads.iter()
                .map(|&pad| {
                    (from..rows[0].len())
                        .map(|j| j.saturating_sub(pad))
                        .collect()
                })
                .collect(),
        );
        let mask: Vec<bool> = padded.iter().flatten().copied().collect();
        let sk = padded[0].len();
        let padding = Tensor::<2, Bool>::from_data(TensorData::new(mask, [b, sk]), &device);
        let logits = ring.forward(chunks, ids, &positions, padding, &mut caches, &device)?;
        // Rows still generating, in order: a finished row draws nothing (the seed's draws go
        // to the rows that use them).
        let live: Vec<i64> = (0..b).filter(|&i| !done[i]).map(|i| i as i64).collect();
        let drawn = match (logits, sampler.as_mut()) {
            (Some(logits), Some(sampler)) => {
                let last = logits.narrow(0, s - 1, 1).reshape([b as i32, -1]);
                let live_rows = Tensor::<1, Int>::from_data(
                    TensorData::new(live.clone(), [live.len()]),
                    &device,
                );
                sampler.sample(last.select(0, live_rows))?
            }
            _ => vec![0; live.len()],
        };
        let mut chosen = ring.share(drawn)?.into_iter();
        for i in 0..b {
            let token = if done[i] {
                config.pad_token_id
            } else {
                let t = chosen.next().expect("one token per live row");
                out[i].push(t);
                done[i] = Some(t) == config.eos_token_id;
                t
            };
            rows[i].push(token);
            padded[i].push(false);
        }
        if done.iter().all(|&d| d) {
            break;
        }
    }
    Ok(Generated { tokens: out })
}

/// This rank's place in the pipeline: its chunks are virtual stages `c·P + rank`.
struct Ring<'a> {
    pp: &'a Comm,
    rank: usize,
    size: usize,
}

impl<'a> Ring<'a> {
    /// Checks that each chunk holds the embedding exactly at the first virtual stage and the
    /// head exactly at the last.
    fn new(chunks: &[Gpt], pp: &'a Comm) -> Result<Self, GenerateError> {
        let (rank, size) = (pp.group().rank(), pp.group().size());
        if chunks.is_empty() {
            return Err(GenerateError::Invalid("no model chunks".into()));
        }
        let stages = size * chunks.len();
        for (c, chunk) in chunks.iter().enumerate() {
            let vs = c * size + rank;
            let (first, last) = (vs == 0, vs + 1 == stages);
            let wrong = match (chunk.embedding.is_some(), chunk.head.is_some()) {
                (false, _) if first => Some("has no embedding, which the first stage holds"),
                (true, _) if !first => Some("holds the embedding, which only the first stage does"),
                (_, false) if last => Some("has no head, which the last stage holds"),
                (_, true) if !last => Some("holds the head, which only the last stage does"),
                _ => None,
            };
            if let Some(wrong) = wrong {
                return Err(GenerateError::Invalid(format!(
                    "chunk {c} of pipeline rank {rank}, virtual stage {vs} of {stages}, {wrong} \
                     (build each chunk with init_stage at PipelinePosition::of(&state, chunk), \
                     and pass the pipeline group it was built for)"
                )));
            }
            if chunk.sequence_parallel {
                return Err(GenerateError::Invalid(
                    "generate needs a model built without sequence parallelism (it splits the sequence over the tensor-parallel ranks)"
                        .into(),
                ));
            }
        }
        Ok(Self { pp, rank, size })
    }

    /// Whether this rank holds the last virtual stage.
    fn holds_last(&self) -> bool {
        self.rank + 1 == self.size
    }

    /// One step through this rank's chunks: the first virtual stage embeds `ids`, the others
    /// take the previous stage's hidden states; the last stage's logits come back.
    fn forward(
        &self,
        chunks: &[Gpt],
        ids: Tensor<2, Int>,
        positions: &Positions,
        padding: Tensor<2, Bool>,
        caches: &mut [Option<KvCache>],
        device: &Device,
    ) -> Result<Option<Tensor<3>>, GenerateError> {
        let (prev, next) = (
            (self.rank + self.size - 1) % self.size,
            (self.rank + 1) % self.size,
        );
        let mut logits = None;
        for (c, (chunk, cache)) in chunks.iter().zip(caches).enumerate() {
            let first = c * self.size + self.rank == 0;
            let hidden = match first {
                true => None,
                // With its dims: the number of new tokens changes between steps.
                false => Some(recv_sized(self.pp.as_ref(), "generate", device, prev)?),
            };
            let ids = first.then(|| ids.clone());
            let padding = Some(padding.clone());
            match chunk.forward_with(ids, hidden, positions, padding, None, cache.as_mut())? {
                GptStageOutput::Hidden(h) => send_sized(self.pp.as_ref(), "generate", h, next)?,
                GptStageOutput::Logits(l) => logits = Some(l),
            }
        }
        Ok(logits)
    }

    /// The last pipeline rank's tokens, on every pipeline rank.
    fn share(&self, drawn: Vec<u32>) -> Result<Vec<u32>, GenerateError> {
        if self.size == 1 {
            return Ok(drawn);
        }
        let mut buf = Buffer::I64(drawn.into_iter().map(i64::from).collect());
        self.pp.broadcast(&mut buf, self.size - 1)?;
        let Buffer::I64(tokens) = buf else {
            unreachable!("broadcast keeps the buffer's dtype")
        };
        Ok(tokens.into_iter().map(|t| t as u32).collect())
    }
}

/// `local` (this rank's checks) where every pipeline rank passed its own, was given the same
/// prompts, config and number of chunks, and the chunks hold the layers in virtual-stage
/// order; else an error on every rank (a refusing rank's own).
fn agree<'a>(
    pp: &'a Comm,
    chunks: &[Gpt],
    prompts: &[Vec<u32>],
    config: &GenerateConfig,
    local: Result<Ring<'a>, GenerateError>,
) -> Result<Ring<'a>, GenerateError> {
    let size = pp.group().size();
    if size == 1 {
        return local;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let vocab = chunks.first().map(Gpt::vocab_size);
    (prompts, format!("{config:?}"), vocab, chunks.len()).hash(&mut h);
    // [refused, hash, (first layer, layers) per chunk]: ranks with other chunk counts send
    // other lengths, which the gather refuses on every rank.
    let mut mine = vec![i64::from(local.is_err()), h.finish() as i64];
    for chunk in chunks {
        mine.extend([chunk.first_layer() as i64, chunk.layers.len() as i64]);
    }
    let all = pp.all_gather_vec(mine)?;
    let rows: Vec<&[i64]> = all.chunks(all.len() / size).collect();
    let refused: Vec<usize> = (0..size).filter(|&r| rows[r][0] != 0).collect();
    let ring = local?;
    let invalid = |m: String| Err(GenerateError::Invalid(m));
    if !refused.is_empty() {
        return invalid(format!(
            "pipeline ranks {refused:?} refused to generate (their errors say why)"
        ));
    }
    if rows.iter().any(|r| r[1] != rows[0][1]) {
        return invalid(
            "the pipeline ranks' prompts, config, vocabulary or chunk counts differ".into(),
        );
    }
    let mut next = 0;
    for stage in 0..size * chunks.len() {
        let (c, r) = (stage / size, stage % size);
        let (first, layers) = (rows[r][2 + 2 * c], rows[r][3 + 2 * c]);
        if first != next {
            return invalid(format!(
                "virtual stage {stage} (chunk {c} of pipeline rank {r}) starts at layer \
                 {first}, not {next}: the ranks' chunks were built under other layouts"
            ));
        }
        next = first + layers;
    }
    Ok(ring)
}

fn check(model: &Gpt, prompts: &[Vec<u32>], config: &GenerateConfig) -> Result<(), GenerateError> {
    let bad = |m: String| Err(GenerateError::Invalid(m));
    if prompts.is_empty() {
        return bad("no prompts".into());
    }
    let context = model.max_position_embeddings();
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return bad(format!("prompt {i} is empty"));
        }
        if p.len() > context {
            return bad(format!(
                "prompt {i} has {} tokens, longer than the model's context (max_position_embeddings {context})",
                p.len()
            ));
        }
        if p.len() + config.max_new_tokens > context {
            return bad(format!(
                "prompt {i} has {} tokens: with max_new_tokens {} it would pass the model's context (max_position_embeddings {context})",
                p.len(),
                config.max_new_tokens
            ));
        }
        if let Some(&t) = p.iter().find(|&&t| t as usize >= model.vocab_size()) {
            return bad(format!(
                "prompt {i} has token id {t}, outside the vocabulary (size {})",
                model.vocab_size()
            ));
        }
    }
    (config.sampling.check()).map_err(|e| GenerateError::Invalid(e.to_string()))?;
    Ok(())
}
