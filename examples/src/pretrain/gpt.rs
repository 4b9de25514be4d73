//! `gpt_pretrain`: the GPT family (its flags are in `gpt_args.rs`), data
//! (a byte-level BPE trained on the spot, or a `tokenizer.json`), microbatch step, Hugging
//! Face fine-tuning and export, and a few generated samples at the end.

use super::data::{DataSource, GptData};
use super::gpt_args::GptArgs;
use super::learner::LearnerOptions;
use super::{Family, Split, Summary, corpus, is_leader, layout_line, precision, train_family};
use burn::config::Config;
use burn::module::Module;
use burn::tensor::Device;
use burn::tensor::TensorData;
use burn_megatron::context_parallel::ContextParallel;
use burn_megatron::data::megatron::{MegatronSplit, build_gpt_datasets};
use burn_megatron::data::{
    Document, GptBatch, GptCorpusDataset, GptCorpusDatasetConfig, GptSample, GptTokenizer,
};
use burn_megatron::launch::RankContext;
use burn_megatron::models::{
    GenerateConfig, Gpt, GptConfig, GptStageOutput, HfGptConfig, PositionEmbeddingType,
    generate_stages, load_hf_gpt_weights, read_hf_tensors, save_hf_gpt,
};
use burn_megatron::moe::{MoeConfig, MoeLayerStats};
use burn_megatron::pipeline::{ChunkOutput, ForwardStep, StageError};
use burn_megatron::tensor_parallel::{IdCheck, RngTracker, TpError};
use burn_megatron::topology::PipelinePosition;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// The tokenizer: `--tokenizer-model`; else the one saved with the checkpoint being loaded;
/// else `--load-hf`'s; else a byte-level BPE trained on the corpus (and saved with the
/// checkpoints).
fn tokenizer(args: &GptArgs, docs: &[Document], leader: bool) -> Result<GptTokenizer, String> {
    let a = &args.train;
    let saved = a
        .load
        .as_ref()
        .map(|d| d.join("tokenizer.json"))
        .filter(|p| p.is_file());
    let hf = args.load_hf.as_ref().map(|d| d.join("tokenizer.json"));
    let tokenizer = match a.vocab_file.as_ref().or(saved.as_ref()).or(hf.as_ref()) {
        Some(p) => GptTokenizer::from_file(p),
        None => GptTokenizer::train(docs, a.vocab_size),
    }
    .map_err(|e| e.to_string())?;
    if let Some(dir) = a.save.as_ref().filter(|_| leader) {
        std::fs::create_dir_all(dir).map_err(|e| format!("--save {}: {e}", dir.display()))?;
        tokenizer
            .save(&dir.join("tokenizer.json"))
            .map_err(|e| e.to_string())?;
    }
    Ok(tokenizer)
}

/// GPT for the shared loop.
pub(super) struct GptFamily {
    args: GptArgs,
    config: GptConfig,
    tokenizer: GptTokenizer,
    train: GptData,
    valid: GptData,
    /// The checkpoint of `--load-hf`, read once for every rank.
    hf: Option<(HfGptConfig, HashMap<String, TensorData>)>,
    prompts: Vec<Vec<u32>>,
    header: String,
}

impl Family for GptFamily {
    type Chunk = Gpt;

    fn example(&self) -> &'static str {
        "gpt_pretrain"
    }

    fn header(&self) -> String {
        self.header.clone()
    }

    fn has_sop(&self) -> bool {
        false
    }

    fn init_chunk(&self, ctx: &RankContext, position: PipelinePosition) -> Result<Gpt, String> {
        let chunk = self
            .config
            .init_stage_with_experts(
                &ctx.groups.tp,
                Some(&ctx.groups.experts()),
                position,
                &ctx.device,
            )
            .map_err(|e| e.to_string())?
            // `GptData`'s ids come from the tokenizer or are checked against it on the host:
            // no device read per forward.
            .with_id_check(IdCheck::Clamp);
        match &self.hf {
            Some((hf, tensors)) => {
                load_hf_gpt_weights(chunk, hf, tensors).map_err(|e| format!("--load-hf: {e}"))
            }
            None => Ok(chunk),
        }
    }

    fn first_layer(chunk: &Gpt) -> usize {
        chunk.first_layer()
    }

    fn first_expert(chunk: &Gpt) -> usize {
        chunk.first_expert()
    }

    fn moe(&self) -> Option<&MoeConfig> {
        self.config.transformer.moe.as_ref()
    }

    fn take_moe_stats(chunks: &[Gpt]) -> Vec<MoeLayerStats> {
        chunks
            .iter()
            .flat_map(|c| &c.layers)
            .filter_map(|l| l.moe.as_ref().map(|m| m.take_stats()))
            .collect()
    }

    fn global_name(first: &[usize], path: &str) -> String {
        Gpt::global_param_name_at(first, path)
    }

    fn forward_step(
        &self,
        s: ForwardStep<'_, Gpt, 3>,
        split: Split,
        samples: Range<usize>,
        rng: Option<&RngTracker>,
        cp: Option<&ContextParallel>,
        device: &Device,
    ) -> Result<ChunkOutput<3>, StageError> {
        let data = match split {
            Split::Train => &self.train,
            Split::Valid => &self.valid,
        };
        let mut samples = samples
            .map(|i| data.sample(i))
            .collect::<Result<Vec<GptSample>, String>>()
            .map_err(StageError::from)?;
        if let Some(cp) = cp {
            // This rank's tokens of each sample (Megatron's `get_batch_on_this_cp_rank`).
            for sample in &mut samples {
                sample.ids = cp.split(&sample.ids)?;
                sample.labels = cp.split(&sample.labels)?;
            }
        }
        let b = GptBatch::new(&samples, device);
        let ids = s.input.is_none().then_some(b.ids);
        let out = match cp {
            None => s.model.forward_stage(ids, s.input, rng)?,
            Some(cp) => s.model.forward_stage_cp(ids, s.input, rng, cp)?,
        };
        Ok(match out {
            GptStageOutput::Hidden(h) => ChunkOutput::Activation(h),
            GptStageOutput::Logits(logits) => {
                let loss = match cp {
                    None => s.model.loss(logits, b.labels, b.loss_mask)?,
                    // Megatron's scaling: × CP here, averaged over DP × CP with the
                    // gradients, so the CP ranks' shares add up.
                    Some(cp) => {
                        s.model.loss_cp(logits, b.labels, b.loss_mask, cp)? * cp.size() as f32
                    }
                };
                let report = vec![loss.clone()];
                ChunkOutput::Loss { loss, report }
            }
        })
    }

    fn finish(&self, ctx: &RankContext, chunks: &[Gpt]) -> Result<Vec<String>, String> {
        let mut said = Vec::new();
        // Generation runs the sequence whole: chunks trained with sequence parallelism are
        // rebuilt without it, with the same weights.
        let chunks = if self.config.transformer.sequence_parallel {
            let plain = (self.config.clone()).map_transformer(|t| t.with_sequence_parallel(false));
            let g = &ctx.groups;
            (chunks.iter().enumerate())
                .map(|(c, chunk)| {
                    let at = PipelinePosition::of(&ctx.state, c);
                    Ok(plain
                        .init_stage_with_experts(&g.tp, Some(&g.experts()), at, &ctx.device)?
                        .load_record(chunk.clone().into_record()))
                })
                .collect::<Result<Vec<Gpt>, TpError>>()
                .map_err(|e| e.to_string())?
        } else {
            chunks.to_vec()
        };
        if self.args.generate_tokens > 0 && !self.prompts.is_empty() {
            let config = GenerateConfig::new(self.args.generate_tokens)
                .with_eos_token_id(Some(self.tokenizer.eod));
            // Untracked: nothing is trained here (and an MoE layer may then route a decoding
            // step's single token whole on every TP rank).
            let untracked: Vec<Gpt> = chunks.iter().map(|c| c.clone().no_grad()).collect();
            let out = generate_stages(&untracked, &ctx.groups.pp, &self.prompts, &config)
                .map_err(|e| e.to_string())?;
            for (prompt, new) in self.prompts.iter().zip(&out.tokens) {
                let text = |ids: &[u32]| self.tokenizer.decode(ids).map_err(|e| e.to_string());
                said.push(format!("> sample: {} ⟶{}", text(prompt)?, text(new)?));
            }
        }
        if let Some(dir) = &self.args.save_hf
            && ctx.state.data_parallel_rank() == 0
        {
            let mut hf = HfGptConfig::from_gpt_config(&self.config, self.config.vocab_size())
                .map_err(|e| format!("--save-hf: {e}"))?;
            hf.eos_token_id = vec![self.tokenizer.eod];
            hf.bos_token_id = Some(self.tokenizer.eod);
            // --save-hf needs one pipeline stage (checked up front).
            save_hf_gpt(&chunks[0], &hf, dir).map_err(|e| format!("--save-hf: {e}"))?;
            if ctx.state.tensor_model_parallel_rank() == 0 {
                self.tokenizer
                    .save(&dir.join("tokenizer.json"))
                    .map_err(|e| format!("--save-hf: {e}"))?;
            }
            said.push(format!(
                "> Hugging Face directory written to {}",
                dir.display()
            ));
        }
        Ok(said)
    }
}

/// Validates `args`, prepares the data and trains; returns the log of global rank 0.
pub fn run_gpt(args: &GptArgs) -> Result<Summary, String> {
    run_gpt_with(args, None)
}

/// [`run_gpt`], each rank driven by burn-train's `Learner` with `learner`'s options.
pub fn run_gpt_learner(args: &GptArgs, learner: &LearnerOptions) -> Result<Summary, String> {
    run_gpt_with(args, Some(learner))
}

fn run_gpt_with(args: &GptArgs, learner: Option<&LearnerOptions>) -> Result<Summary, String> {
    let start = Instant::now();
    let layout = args.validate()?;
    let a = &args.train;
    let leader = is_leader(a)?;
    let (docs, valid_docs) = corpus(a)?;
    let tokenizer = tokenizer(args, &docs, leader)?;
    let hf = match &args.load_hf {
        Some(dir) => {
            let hf = HfGptConfig::from_file(&dir.join("config.json"))
                .map_err(|e| format!("--load-hf: {e}"))?;
            let tensors = read_hf_tensors(dir).map_err(|e| format!("--load-hf: {e}"))?;
            if tokenizer.vocab_size() > hf.vocab_size {
                return Err(format!(
                    "--load-hf: the tokenizer has {} tokens, the model {}",
                    tokenizer.vocab_size(),
                    hf.vocab_size
                ));
            }
            Some((hf, tensors))
        }
        None => None,
    };
    let config = args.model_config(tokenizer.vocab_size())?;
    let data = |docs: &[Document], seed: u64| {
        GptCorpusDataset::new(
            docs,
            &tokenizer,
            GptCorpusDatasetConfig::new(a.seq_length).with_seed(seed),
        )
        .map_err(|e| e.to_string())
    };
    let (train, valid, valid_prompts) = match a.data_source()? {
        DataSource::Megatron(blend) => {
            let [train, valid, _] =
                build_gpt_datasets(&blend, &a.megatron_config(), a.megatron_sizes())
                    .map_err(|e| format!("--data-path: {e}"))?;
            let vocab_size = tokenizer.vocab_size();
            let split = |s: Option<MegatronSplit>, name: &str| {
                s.map(|data| GptData::Megatron { data, vocab_size })
                    .ok_or_else(|| format!("--split {}: the {name} split is empty", a.split))
            };
            let valid = split(valid, "validation")?;
            // Prompts: the first tokens of three validation samples.
            let prompts = (0..3.min(valid.len()))
                .map(|i| {
                    let ids = valid.sample(i)?.ids.into_iter().take(6);
                    Ok(ids.map(|t| t as u32).collect())
                })
                .collect::<Result<Vec<Vec<u32>>, String>>()?;
            (split(train, "training")?, valid, Some(prompts))
        }
        _ => (
            GptData::Stream(data(&docs, a.seed)?),
            GptData::Stream(data(&valid_docs, a.seed.wrapping_add(1))?),
            None,
        ),
    };
    if let Some(dir) = a.save.as_ref().filter(|_| leader) {
        let path = dir.join("gpt_config.json");
        config
            .save(&path)
            .map_err(|e| format!("--save {}: {e}", path.display()))?;
    }
    // The first words of three validation documents.
    let prompts = match valid_prompts {
        Some(p) => p,
        None => valid_docs
            .iter()
            .take(3)
            .map(|d| {
                tokenizer
                    .encode(&d.join(" "))
                    .map(|ids| ids.into_iter().take(6).collect())
            })
            .collect::<Result<Vec<Vec<u32>>, _>>()
            .map_err(|e| e.to_string())?,
    };
    let t = &config.transformer;
    let kind = match (config.position_embedding_type, t.mlp.gated_linear_unit) {
        (PositionEmbeddingType::Rope, true) => "Llama-style",
        _ => "GPT-2-style",
    };
    let header = format!(
        "> GPT ({kind}) {} layers, hidden {}, {} heads / {} query groups, seq {} | {} | vocab {} (padded {}) | \
         {} train / {} validation samples of {} tokens | {}",
        config.num_layers,
        t.hidden_size,
        t.attention.num_attention_heads,
        config.query_groups(),
        a.seq_length,
        layout_line(a),
        tokenizer.vocab_size(),
        config.padded_vocab_size,
        train.len(),
        valid.len(),
        a.seq_length,
        precision(a),
    );
    let family = GptFamily {
        args: args.clone(),
        config,
        tokenizer,
        train,
        valid,
        hf,
        prompts,
        header,
    };
    match learner {
        None => {
            let rank = |ctx, shared: &Arc<_>| super::train::train_rank(ctx, shared);
            train_family(a, layout, family, leader, start, &rank)
        }
        Some(options) => {
            let rank = |ctx, shared: &Arc<_>| super::learner::learner_rank(ctx, shared, options);
            train_family(a, layout, family, leader, start, &rank)
        }
    }
}
