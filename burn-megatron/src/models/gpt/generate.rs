//! Text generation with a [`Gpt`] at any tensor-parallel size: greedy decoding or
//! temperature / top-k / top-p sampling with a seed, a key/value cache, batched prompts of
//! different lengths (left-padded, each at its own positions, as `transformers` does), and a
//! stop at EOS or after `max_new_tokens`.
//!
//! Each step chooses from the last position's vocabulary-parallel logits without gathering
//! the vocabulary ([`VocabParallelSampler`]): every rank draws the same token from the same
//! seed, and ranks fed other prompts fail together.

use super::{Gpt, GptStageOutput, KvCache, Positions};
use crate::comm::CommError;
use crate::tensor_parallel::{Sampling, TpError, VocabParallelSampler};
use burn::config::Config;
use burn::tensor::{Bool, Int, Tensor, TensorData};

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
    check(model, prompts, config)?;
    let device = model
        .embedding
        .as_ref()
        .map(|e| e.word_embeddings.weight.device())
        .expect("checked: the model has its embeddings");
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
    let tp = model.tp();
    let mut sampler =
        VocabParallelSampler::new(config.sampling, config.seed, model.vocab_size(), tp)?;
    sampler.check_prompts(prompts)?;
    let mut cache = config.use_cache.then(KvCache::default);
    for step in 0..config.max_new_tokens {
        // With the cache, only the newest token after the first step.
        let from = if step > 0 && cache.is_some() {
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
        let logits = match model.forward_with(
            Some(ids),
            None,
            &positions,
            Some(padding),
            None,
            cache.as_mut(),
        )? {
            GptStageOutput::Logits(l) => l,
            GptStageOutput::Hidden(_) => unreachable!("checked: the model has its head"),
        };
        let last = logits.narrow(0, s - 1, 1).reshape([b as i32, -1]);
        // Rows still generating, in order: a finished row draws nothing (the seed's draws go
        // to the rows that use them).
        let live: Vec<i64> = (0..b).filter(|&i| !done[i]).map(|i| i as i64).collect();
        let live_rows =
            Tensor::<1, Int>::from_data(TensorData::new(live.clone(), [live.len()]), &device);
        let mut chosen = sampler.sample(last.select(0, live_rows))?.into_iter();
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

fn check(model: &Gpt, prompts: &[Vec<u32>], config: &GenerateConfig) -> Result<(), GenerateError> {
    let bad = |m: String| Err(GenerateError::Invalid(m));
    if model.embedding.is_none() || model.head.is_none() {
        return bad("generate needs the whole model on this rank (no pipeline stages)".into());
    }
    if model.sequence_parallel {
        return bad(
            "generate needs a model built without sequence parallelism (it splits the sequence over the tensor-parallel ranks)"
                .into(),
        );
    }
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
