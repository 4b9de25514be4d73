// A model written against Burn's `nn` as real Burn model repositories write one (ALBERT's one
// encoder layer applied several times, built with `TransformerEncoderLayer::new`; a
// stand-alone `PositionWiseFeedForwardConfig` block; Burn's `LayerNorm`, `Dropout`,
// `Initializer`, activation config and loss), included twice by `whole_nn.rs`: with `nn`
// standing for `burn::nn` and for `dropin::nn`. Nothing else differs.

#[derive(Config, Debug)]
pub struct SharedLayerModelConfig {
    vocab_size: usize,
    d_model: usize,
    n_heads: usize,
    d_ff: usize,
    repeats: usize,
}

#[derive(Module, Debug)]
pub struct SharedLayerModel {
    pub embedding: nn::Embedding,
    pub norm: nn::LayerNorm,
    pub dropout: nn::Dropout,
    pub layer: nn::transformer::TransformerEncoderLayer,
    pub head: nn::transformer::PositionWiseFeedForward,
    pub output: nn::Linear,
    pub repeats: usize,
    pub vocab_size: usize,
}

impl SharedLayerModelConfig {
    pub fn init(&self, device: &Device) -> SharedLayerModel {
        let (d, ff) = (self.d_model, self.d_ff);
        let initializer = nn::Initializer::KaimingUniform {
            gain: 1.0 / 3f64.sqrt(),
            fan_out_only: false,
        };
        let encoder = nn::transformer::TransformerEncoderConfig::new(d, ff, self.n_heads, 1)
            .with_dropout(0.0)
            .with_initializer(initializer)
            .with_activation(nn::activation::ActivationConfig::Relu);
        SharedLayerModel {
            embedding: nn::EmbeddingConfig::new(self.vocab_size, d).init(device),
            norm: nn::LayerNormConfig::new(d).with_epsilon(1e-6).init(device),
            dropout: nn::DropoutConfig::new(0.0).init(),
            layer: nn::transformer::TransformerEncoderLayer::new(&encoder, device),
            head: nn::transformer::PositionWiseFeedForwardConfig::new(d, ff)
                .with_dropout(0.0)
                .init(device),
            output: nn::LinearConfig::new(d, self.vocab_size).init(device),
            repeats: self.repeats,
            vocab_size: self.vocab_size,
        }
    }
}

impl SharedLayerModel {
    /// The logits `[b·s, V]` of `ids` (`[b, s]`), with the padding positions `mask_pad`
    /// masked out of the attention.
    pub fn logits(&self, ids: Tensor<2, Int>, mask_pad: Tensor<2, Bool>) -> Tensor<2> {
        let [b, s] = ids.dims();
        let mut x = self.dropout.forward(self.norm.forward(self.embedding.forward(ids)));
        for _ in 0..self.repeats {
            x = self.layer.forward(x, Some(mask_pad.clone()), None);
        }
        let x = self.head.forward(x.clone()) + x;
        self.output.forward(x).reshape([b * s, self.vocab_size])
    }

    /// The mean cross-entropy of predicting `targets` from `ids` (both `[b, s]`).
    pub fn loss(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        mask_pad: Tensor<2, Bool>,
    ) -> Tensor<1> {
        let [b, s] = ids.dims();
        let logits = self.logits(ids, mask_pad);
        nn::loss::CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, targets.reshape([b * s]))
    }
}
