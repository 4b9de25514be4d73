// A small model written against Burn's `nn` (a table, self-attention, cross-attention with
// grouped key/value heads, a linear no plan splits, a feed-forward block, an output layer), included twice by `lora.rs`: with `nn` standing for `burn::nn` and for
// `dropin::nn`. Nothing else differs.

#[derive(Module, Debug)]
pub struct Net {
    pub embed: nn::Embedding,
    pub attn: nn::attention::MultiHeadAttention,
    pub cross: nn::attention::CrossAttention,
    pub mix: nn::Linear,
    pub up: nn::Linear,
    pub down: nn::Linear,
    pub out: nn::Linear,
}

impl Net {
    pub fn new(vocab: usize, d: usize, heads: usize, ff: usize, device: &Device) -> Self {
        Self {
            embed: nn::EmbeddingConfig::new(vocab, d).init(device),
            attn: nn::attention::MultiHeadAttentionConfig::new(d, heads)
                .with_dropout(0.0)
                .init(device),
            // 8 query heads of 1 feature sharing 4 key/value heads.
            cross: nn::attention::CrossAttentionConfig::new(d, d, 8, 4, 1)
                .with_dropout(0.0)
                .init(device),
            mix: nn::LinearConfig::new(d, d).init(device),
            up: nn::LinearConfig::new(d, ff).init(device),
            down: nn::LinearConfig::new(ff, d).init(device),
            out: nn::LinearConfig::new(d, vocab).init(device),
        }
    }

    /// The logits `[b, s, vocab]` of `ids`.
    pub fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let x = self.embed.forward(ids);
        let attended = self.attn.forward(nn::attention::MhaInput::self_attn(x.clone()));
        let x = x + attended.context;
        let x = x.clone() + self.cross.forward(x.clone(), x.clone().flip([1]), None);
        let x = x.clone() + self.mix.forward(x);
        let hidden = burn::tensor::activation::relu(self.up.forward(x.clone()));
        self.out.forward(x + self.down.forward(hidden))
    }
}

/// A table, a two-layer encoder and an output layer: what sequence parallelism splits.
#[derive(Module, Debug)]
pub struct EncoderNet {
    pub embed: nn::Embedding,
    pub encoder: nn::transformer::TransformerEncoder,
    pub out: nn::Linear,
}

impl EncoderNet {
    pub fn new(vocab: usize, d: usize, heads: usize, ff: usize, device: &Device) -> Self {
        Self {
            embed: nn::EmbeddingConfig::new(vocab, d).init(device),
            encoder: nn::transformer::TransformerEncoderConfig::new(d, ff, heads, 2)
                .with_dropout(0.0)
                .init(device),
            out: nn::LinearConfig::new(d, vocab).init(device),
        }
    }

    /// The logits `[b, s, vocab]` of `ids`.
    pub fn logits(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let x = self.embed.forward(ids);
        let x = self
            .encoder
            .forward(nn::transformer::TransformerEncoderInput::new(x));
        self.out.forward(x)
    }
}
