// Burn's `text-generation` example's model (a `TransformerEncoder` under an autoregressive
// mask, token and position embeddings, a vocabulary-sized output layer, Burn's cross-entropy
// with a padding token), written once and included twice by `text_generation.rs`: under
// `burn::nn`'s imports and under `dropin::nn`'s. Only the imports differ.

#[derive(Config, Debug)]
pub struct TextGenerationModelConfig {
    transformer: TransformerEncoderConfig,
    vocab_size: usize,
    pad_token: usize,
    max_seq_length: usize,
}

#[derive(Module, Debug)]
pub struct TextGenerationModel {
    transformer: TransformerEncoder,
    embedding_token: Embedding,
    embedding_pos: Embedding,
    output: Linear,
    vocab_size: usize,
    pad_token: usize,
    max_seq_length: usize,
}

impl TextGenerationModelConfig {
    pub fn init(&self, device: &Device) -> TextGenerationModel {
        let d_model = self.transformer.d_model;
        TextGenerationModel {
            transformer: self.transformer.init(device),
            embedding_token: EmbeddingConfig::new(self.vocab_size, d_model).init(device),
            embedding_pos: EmbeddingConfig::new(self.max_seq_length, d_model).init(device),
            output: LinearConfig::new(d_model, self.vocab_size).init(device),
            vocab_size: self.vocab_size,
            pad_token: self.pad_token,
            max_seq_length: self.max_seq_length,
        }
    }
}

impl TextGenerationModel {
    /// The mean next-token cross-entropy of `inputs` against `targets` (both `[b, s]`), the
    /// padding token's positions left out.
    pub fn forward_training(
        &self,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        mask_pad: Tensor<2, Bool>,
    ) -> Tensor<1> {
        let [batch_size, seq_length] = inputs.dims();
        let device = inputs.device();
        let positions = Tensor::<1, Int>::arange(0..seq_length as i64, &device)
            .reshape([1, seq_length])
            .repeat_dim(0, batch_size);
        let embedding =
            (self.embedding_pos.forward(positions) + self.embedding_token.forward(inputs)) / 2;
        let mask_attn = generate_autoregressive_mask(batch_size, seq_length, &device);
        let input = TransformerEncoderInput::new(embedding)
            .mask_pad(mask_pad)
            .mask_attn(mask_attn);
        let logits = self.output.forward(self.transformer.forward(input));
        let logits = logits.reshape([batch_size * seq_length, self.vocab_size]);
        CrossEntropyLossConfig::new()
            .with_pad_tokens(Some(vec![self.pad_token]))
            .init(&device)
            .forward(logits, targets.reshape([batch_size * seq_length]))
    }
}
