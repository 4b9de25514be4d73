//! The same BERT, tensor-parallel: diff this file against `plain.rs`.

use super::{BertConfig, masked};
use burn::module::Module;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::nn::{Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Bool, Device, Int, Tensor};
use burn_megatron::comm::Comm;
use burn_megatron::tensor_parallel::{dropin::*, *};
use std::path::Path;

#[derive(Module, Debug)]
pub struct BertEmbeddings {
    word_embeddings: VocabParallelEmbedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    layer_norm: LayerNorm,
}

#[derive(Module, Debug)]
pub struct BertLmHead {
    dense: Linear,
    layer_norm: LayerNorm,
    decoder: ColumnParallelLinear,
}

#[derive(Module, Debug)]
pub struct BertMaskedLm {
    embeddings: BertEmbeddings,
    encoder: ParallelTransformerEncoder,
    lm_head: BertLmHead,
    #[module(skip)]
    tp: Comm,
}

impl BertMaskedLm {
    // ANCHOR: new
    pub fn new(c: &BertConfig, tp: &Comm, device: &Device) -> Result<Self, TpError> {
        let embedding = |n| EmbeddingConfig::new(n, c.hidden_size).init(device);
        let norm = || {
            LayerNormConfig::new(c.hidden_size)
                .with_epsilon(1e-12)
                .init(device)
        };
        let encoder = TransformerEncoderConfig {
            n_heads: c.num_attention_heads,
            n_layers: c.num_hidden_layers,
            d_model: c.hidden_size,
            d_ff: c.intermediate_size,
            dropout: 0.0,
            norm_first: false,
            quiet_softmax: false,
            initializer: Initializer::Normal {
                mean: 0.0,
                std: 0.02,
            },
            activation: burn::nn::activation::ActivationConfig::Gelu,
            layer_norm_eps: 1e-12,
        };
        Ok(Self {
            embeddings: BertEmbeddings {
                word_embeddings: VocabParallelEmbeddingConfig::new(c.vocab_size, c.hidden_size)
                    .init(tp, device)?,
                position_embeddings: embedding(c.max_position_embeddings),
                token_type_embeddings: embedding(c.type_vocab_size),
                layer_norm: norm(),
            },
            encoder: ParallelTransformerEncoder::new(
                &encoder,
                tp,
                0,
                &RngTracker::new(0, tp.group().rank()),
                device,
            )?,
            lm_head: BertLmHead {
                dense: LinearConfig::new(c.hidden_size, c.hidden_size).init(device),
                layer_norm: norm(),
                decoder: ColumnParallelLinearConfig::new(c.hidden_size, c.vocab_size)
                    .init(tp, device)?,
            },
            tp: tp.clone(),
        })
    }
    // ANCHOR_END: new

    // ANCHOR: load
    /// The model with the weights of the record at `path`.
    pub fn load(c: &BertConfig, path: &Path, tp: &Comm, device: &Device) -> Result<Self, TpError> {
        let source = RecordSource::from_path(path);
        Ok(load_sharded(
            Self::new(c, tp, device)?,
            &source,
            tp,
            &LoadOptions::default(),
        )?
        .0)
    }
    // ANCHOR_END: load

    /// `[b, s]` tokens (`pad` where `mask_pad`) → `[b, s, vocab]` logits.
    pub fn forward(&self, tokens: Tensor<2, Int>, mask_pad: Tensor<2, Bool>) -> Tensor<3> {
        let [b, s] = tokens.dims();
        let positions = Tensor::arange(0..s as i64, &tokens.device())
            .unsqueeze()
            .repeat_dim(0, b);
        let e = &self.embeddings;
        let x = e.word_embeddings.forward(tokens.clone())
            + e.position_embeddings.forward(positions)
            + e.token_type_embeddings.forward(tokens.zeros_like());
        let input =
            ParallelTransformerEncoderInput::new(e.layer_norm.forward(x)).mask_pad(mask_pad);
        let h = self.encoder.forward(input);
        let head = &self.lm_head;
        head.decoder
            .forward(head.layer_norm.forward(gelu(head.dense.forward(h))))
    }

    /// Mean cross-entropy at the masked positions `at` (flat `b · s` indices), whose original
    /// tokens are `labels`.
    pub fn loss(
        &self,
        tokens: Tensor<2, Int>,
        pad: Tensor<2, Bool>,
        at: Tensor<1, Int>,
        labels: Tensor<1, Int>,
    ) -> Result<Tensor<1>, TpError> {
        let logits = masked(self.forward(tokens, pad), at);
        Ok(vocab_parallel_cross_entropy(logits, labels, 0.0, &self.tp)?.mean())
    }

    /// The most likely token at each masked position, and how many of them are `labels`.
    pub fn fill_mask(
        &self,
        tokens: Tensor<2, Int>,
        pad: Tensor<2, Bool>,
        at: Tensor<1, Int>,
        labels: Tensor<1, Int>,
    ) -> Result<(Vec<i64>, usize), TpError> {
        let logits = masked(self.forward(tokens, pad), at);
        let vocab = self.embeddings.word_embeddings.num_embeddings();
        let best: Vec<i64> = vocab_parallel_argmax(logits, vocab, &self.tp)?
            .into_iter()
            .map(i64::from)
            .collect();
        let labels: Vec<i64> = labels.into_data().iter::<i64>().collect();
        let right = best.iter().zip(&labels).filter(|(b, l)| b == l).count();
        Ok((best, right))
    }
}
