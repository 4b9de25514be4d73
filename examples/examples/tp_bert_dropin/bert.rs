//! What the BERT's two forms share, untouched by the conversion: its config and the logits at
//! the masked positions.

use burn::config::Config;
use burn::tensor::{Int, Tensor};

/// The model's sizes, named as Hugging Face's `BertConfig` names them.
#[derive(Config, Debug)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    #[config(default = 1e-12)]
    pub layer_norm_eps: f64,
}

/// `[b, s, v]` logits at the flat positions `at`: `[n, v]`.
pub fn masked(logits: Tensor<3>, at: Tensor<1, Int>) -> Tensor<2> {
    let [b, s, v] = logits.dims();
    logits.reshape([b * s, v]).select(0, at)
}
