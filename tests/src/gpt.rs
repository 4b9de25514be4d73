//! GPT test helpers: tiny Llama-style and GPT-2-style configs, a fixed causal-LM batch, and
//! a model's (or its gradients') global tensors gathered over the tensor-parallel group.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::Comm;
use burn_megatron::comm::tensor::all_gather;
use burn_megatron::models::{
    ActivationFunc, AttnMaskType, Gpt, GptConfig, GptStageOutput, LayerNormPosition, NormKind,
    ParallelAttentionConfig, ParallelMlpConfig, PositionEmbeddingType, TransformerLayerConfig,
};
use burn_megatron::pipeline::{ChunkOutput, ForwardStep, MicrobatchLoss, read_losses};
use burn_megatron::tensor_parallel::parallel_attrs;
use std::collections::BTreeMap;

/// Vocabulary of the tiny models (padded: 64, a multiple of every TP size used).
pub const VOCAB: usize = 60;

/// A tiny Llama-style model: RoPE, RMSNorm, SwiGLU, 4 heads in 2 query groups, no biases,
/// untied output layer, dropout off.
pub fn llama(layers: usize, seq: usize) -> GptConfig {
    let attention = ParallelAttentionConfig::new(4)
        .with_attn_mask_type(AttnMaskType::Causal)
        .with_num_query_groups(Some(2))
        .with_attention_dropout(0.0);
    let mlp = ParallelMlpConfig::new(48)
        .with_gated_linear_unit(true)
        .with_activation_func(ActivationFunc::Silu);
    let layer = TransformerLayerConfig::new(32, attention, mlp)
        .with_layernorm_position(LayerNormPosition::Pre)
        .with_normalization(NormKind::RmsNorm)
        .with_layernorm_epsilon(1e-5)
        .with_add_bias_linear(false)
        .with_hidden_dropout(0.0)
        .with_seed(1234);
    GptConfig::new(layers, seq, 64, layer)
        .with_vocab_size(Some(VOCAB))
        .with_position_embedding_type(PositionEmbeddingType::Rope)
        .with_untie_embeddings_and_output_weights(true)
}

/// A tiny GPT-2-style model: learned positions, LayerNorm, GeLU (tanh), biases, tied
/// embeddings, 4 heads, dropout off.
pub fn gpt2(layers: usize, seq: usize) -> GptConfig {
    let attention = ParallelAttentionConfig::new(4)
        .with_attn_mask_type(AttnMaskType::Causal)
        .with_attention_dropout(0.0);
    let mlp = ParallelMlpConfig::new(64).with_activation_func(ActivationFunc::GeluTanh);
    let layer = TransformerLayerConfig::new(32, attention, mlp)
        .with_layernorm_position(LayerNormPosition::Pre)
        .with_layernorm_epsilon(1e-5)
        .with_hidden_dropout(0.0)
        .with_seed(1234);
    GptConfig::new(layers, seq, 64, layer).with_vocab_size(Some(VOCAB))
}

/// Token ids, next-token labels and the loss mask of a causal-LM batch, `[b, s]`.
pub struct GptRows {
    /// Inputs.
    pub ids: Tensor<2, Int>,
    /// The next token of each position.
    pub labels: Tensor<2, Int>,
    /// 1 where the loss counts (0 at the last position of odd samples).
    pub mask: Tensor<2>,
}

/// Samples `start..start + n` of `s` tokens: sample `g` is a pure function of `g`, so every
/// layout and rank builds the same rows.
pub fn gpt_rows(start: usize, n: usize, s: usize, device: &Device) -> GptRows {
    let token = |g: usize, j: usize| ((g * 17 + j * j * 5 + j * 3 + 1) % VOCAB) as i64;
    let (mut ids, mut labels, mut mask) = (Vec::new(), Vec::new(), Vec::new());
    for g in start..start + n {
        for j in 0..s {
            ids.push(token(g, j));
            labels.push(token(g, j + 1));
            mask.push(if g % 2 == 1 && j == s - 1 {
                0.0f32
            } else {
                1.0
            });
        }
    }
    GptRows {
        ids: Tensor::from_data(TensorData::new(ids, [n, s]), device),
        labels: Tensor::from_data(TensorData::new(labels, [n, s]), device),
        mask: Tensor::from_data(TensorData::new(mask, [n, s]), device),
    }
}

/// The module paths and values of `model`'s parameters (or of their `grads`), gathered over
/// `tp` along each one's partition dim: the global tensors (a padded vocabulary's cut to
/// the real one), comparable across TP sizes.
/// Collective: every rank of `tp` calls it.
pub fn gathered<M: Module>(
    model: &M,
    grads: Option<&GradientsParams>,
    tp: &Comm,
) -> BTreeMap<String, Vec<f32>> {
    struct Gather<'a> {
        path: Vec<String>,
        grads: Option<&'a GradientsParams>,
        tp: &'a Comm,
        out: BTreeMap<String, Vec<f32>>,
    }
    impl ModuleVisitor for Gather<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let value = match self.grads {
                Some(g) => match g.get::<D>(p.id) {
                    Some(g) => g,
                    None => return,
                },
                None => p.val().detach(),
            };
            let attrs = parallel_attrs(p.id);
            let full = match attrs.split_dim() {
                Some(d) => all_gather(&**self.tp, value, d).expect("gather"),
                None => value,
            };
            // A padded vocabulary's tensor, cut to the real one (the padding is checked
            // where it matters).
            let full = match attrs.padding() {
                Some((d, n)) => full.narrow(d, 0, n),
                None => full,
            };
            self.out.insert(self.path.join("."), crate::values(full));
        }
    }
    let mut g = Gather {
        path: Vec::new(),
        grads,
        tp,
        out: BTreeMap::new(),
    };
    model.visit(&mut g);
    g.out
}

/// The largest `|a − b| / max(|b|∞, floor)` over tensors of the same name, naming the worst.
pub fn max_rel_diff(
    a: &BTreeMap<String, Vec<f32>>,
    b: &BTreeMap<String, Vec<f32>>,
    floor: f32,
) -> (f32, String) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same tensors"
    );
    let mut worst = (0.0f32, String::new());
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.len(), y.len(), "{name}: lengths");
        let scale = y.iter().fold(floor, |m, v| m.max(v.abs()));
        let d = x
            .iter()
            .zip(y)
            .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()))
            / scale;
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    worst
}

/// One micro-batch through a pipeline chunk: [`gpt_rows`] row `first + s.microbatch` of
/// `seq` tokens, its activation, or on the last stage its loss (reported too).
pub fn causal_lm_step(
    s: ForwardStep<'_, Gpt, 3>,
    first: usize,
    seq: usize,
    device: &Device,
) -> Result<ChunkOutput<3>, Box<dyn std::error::Error + Send + Sync>> {
    let b = gpt_rows(first + s.microbatch, 1, seq, device);
    let ids = s.input.is_none().then_some(b.ids);
    Ok(match s.model.forward_stage(ids, s.input, None)? {
        GptStageOutput::Hidden(h) => ChunkOutput::Activation(h),
        GptStageOutput::Logits(logits) => {
            let loss = s.model.loss(logits, b.labels, b.mask)?;
            let report = vec![loss.clone()];
            ChunkOutput::Loss { loss, report }
        }
    })
}

/// The sum of each micro-batch's first reported value (the loss [`causal_lm_step`] reports)
/// over `local`, the rank's micro-batch count: its mean loss, in one host read.
pub fn mean_reported_loss(losses: &[MicrobatchLoss], local: usize) -> f32 {
    let read = read_losses(losses);
    read.iter().map(|m| m.report[0] as f32).sum::<f32>() / local as f32
}
