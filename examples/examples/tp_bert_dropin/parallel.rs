use super::{BertConfig, masked};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Initializer, LayerNorm, LayerNormConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Bool, Device, Int, Tensor};
use burn_megatron::dropin::{nn::transformer::*, nn::*, *};
use burn_megatron::{comm::Comm, tensor_parallel::TpError};
use std::path::Path;

#[derive(Module, Debug)]
pub struct BertEmbeddings {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    layer_norm: LayerNorm,
}

#[derive(Module, Debug)]
pub struct BertLmHead {
    dense: Linear,
    layer_norm: LayerNorm,
    decoder: Linear,
}

#[derive(Module, Debug)]
pub struct BertMaskedLm {
    embeddings: BertEmbeddings,
    encoder: TransformerEncoder,
    lm_head: BertLmHead,
}

impl BertMaskedLm {
    // ANCHOR: new
    pub fn new(c: &BertConfig, device: &Device) -> Self {
        let embedding = |n| EmbeddingConfig::new(n, c.hidden_size).init(device);
        let norm = || {
            LayerNormConfig::new(c.hidden_size)
                .with_epsilon(c.layer_norm_eps)
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
            layer_norm_eps: c.layer_norm_eps,
        };
        Self {
            embeddings: BertEmbeddings {
                word_embeddings: embedding(c.vocab_size),
                position_embeddings: embedding(c.max_position_embeddings),
                token_type_embeddings: embedding(c.type_vocab_size),
                layer_norm: norm(),
            },
            encoder: encoder.init(device),
            lm_head: BertLmHead {
                dense: LinearConfig::new(c.hidden_size, c.hidden_size).init(device),
                layer_norm: norm(),
                decoder: LinearConfig::new(c.hidden_size, c.vocab_size).init(device),
            },
        }
    }
    // ANCHOR_END: new

    // ANCHOR: load
    /// The model with the weights of the record at `path`, read as `options` say.
    pub fn load(
        c: &BertConfig,
        path: &Path,
        options: &LoadOptions,
        tp: &Comm,
        device: &Device,
    ) -> Result<Self, TpError> {
        let plan = TpPlan::new().encoder(&["encoder"])?.sequence_parallel();
        let plan = plan.vocab(&["*.word_embeddings"])?;
        let plan = plan.gathered_vocab(&["*.decoder"])?;
        let plan = plan.make_vocab_size_divisible_by(8)?;
        let model = plan.apply(Self::new(c, device), tp)?;
        Ok(load_sharded(model, &RecordSource::from_path(path), tp, options)?.0)
    }
    // ANCHOR_END: load

    /// `[b, s]` tokens of the segments `types` (`pad` where `mask_pad`) → `[b, s, vocab]`
    /// logits.
    pub fn forward(
        &self,
        tokens: Tensor<2, Int>,
        types: Tensor<2, Int>,
        mask_pad: Tensor<2, Bool>,
    ) -> Tensor<3> {
        let [b, s] = tokens.dims();
        let positions = Tensor::arange(0..s as i64, &tokens.device())
            .unsqueeze()
            .repeat_dim(0, b);
        let e = &self.embeddings;
        let x = e.word_embeddings.forward(tokens.clone())
            + e.position_embeddings.forward(positions)
            + e.token_type_embeddings.forward(types);
        let input = TransformerEncoderInput::new(e.layer_norm.forward(x)).mask_pad(mask_pad);
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
    ) -> Tensor<1> {
        let logits = masked(self.forward(tokens.clone(), tokens.zeros_like(), pad), at);
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, labels)
    }

    /// The most likely token at each masked position, and how many of them are `labels`.
    pub fn fill_mask(
        &self,
        tokens: Tensor<2, Int>,
        pad: Tensor<2, Bool>,
        at: Tensor<1, Int>,
        labels: Tensor<1, Int>,
    ) -> (Vec<i64>, usize) {
        let logits = masked(self.forward(tokens.clone(), tokens.zeros_like(), pad), at);
        let best: Vec<i64> = logits.argmax(1).into_data().iter::<i64>().collect();
        let labels: Vec<i64> = labels.into_data().iter::<i64>().collect();
        let right = best.iter().zip(&labels).filter(|(b, l)| b == l).count();
        (best, right)
    }
}
