use super::{KeyValueCache, LlamaConfig, causal_mask, repeat_kv};
use burn::module::Module;
use burn::nn::{RmsNorm, RmsNormConfig, RotaryEncoding};
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Int, Tensor};
use burn_megatron::comm::Comm;
use burn_megatron::dropin::{nn::*, *};
use burn_megatron::pipeline::ChunkOutput;
use burn_megatron::tensor_parallel::*;
type Result<T> = std::result::Result<T, TpError>;

#[derive(Module, Debug)]
pub struct Attention {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

// ANCHOR: attention
impl Attention {
    fn forward(
        &self,
        x: Tensor<3>,
        cache: Option<&mut KeyValueCache>,
        rope: &RotaryEncoding,
    ) -> Tensor<3> {
        let [b, s, _] = x.dims();
        let tp = self.wq.tp_size();
        let (n_heads, n_kv_heads) = (self.n_heads / tp, self.n_kv_heads / tp);
        let hidden_size = n_heads * self.head_dim;
        let start = cache.as_ref().map_or(0, |c| c.len);
        let heads = |t: Tensor<3>, n| t.reshape([b, s, n, self.head_dim]).swap_dims(1, 2);
        let q = rope.apply(heads(self.wq.forward(x.clone()), n_heads), start);
        let k = rope.apply(heads(self.wk.forward(x.clone()), n_kv_heads), start);
        let v = heads(self.wv.forward(x.clone()), n_kv_heads);
        let (k, v) = match cache {
            Some(cache) => cache.forward(k, v),
            None => (k, v),
        };
        let n_rep = self.n_heads / self.n_kv_heads;
        let (k, v) = (repeat_kv(k, n_rep), repeat_kv(v, n_rep));
        let mask = causal_mask(s, k.dims()[2], &x.device());
        let scores = q.matmul(k.swap_dims(2, 3)) / (self.head_dim as f32).sqrt();
        let out = softmax(scores + mask, 3).matmul(v).swap_dims(1, 2);
        self.wo.forward(out.reshape([b, s, hidden_size]))
    }
}
// ANCHOR_END: attention

#[derive(Module, Debug)]
pub struct FeedForward {
    swiglu: SwiGlu,
    w2: Linear,
}

#[derive(Module, Debug)]
pub struct TransformerBlock {
    attention: Attention,
    feed_forward: FeedForward,
    attention_norm: RmsNorm,
    ffn_norm: RmsNorm,
}

impl TransformerBlock {
    fn forward(
        &self,
        x: Tensor<3>,
        cache: Option<&mut KeyValueCache>,
        rope: &RotaryEncoding,
    ) -> Tensor<3> {
        let h = x.clone()
            + self
                .attention
                .forward(self.attention_norm.forward(x), cache, rope);
        let ffn = &self.feed_forward;
        h.clone() + ffn.w2.forward(ffn.swiglu.forward(self.ffn_norm.forward(h)))
    }
}

#[derive(Module, Debug)]
pub struct Llama {
    tok_embeddings: Option<Embedding>,
    layers: Vec<TransformerBlock>,
    norm: Option<RmsNorm>,
    output: Option<Linear>,
    rope: RotaryEncoding,
}

impl Llama {
    // ANCHOR: new
    pub fn new(c: &LlamaConfig, stage: &PpStage, device: &Device) -> Self {
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        let norm = || {
            RmsNormConfig::new(c.d_model)
                .with_epsilon(c.norm_eps)
                .init(device)
        };
        let head_dim = c.d_model / c.n_heads;
        let block = |_| TransformerBlock {
            attention: Attention {
                wq: linear(c.d_model, c.n_heads * head_dim),
                wk: linear(c.d_model, c.n_kv_heads * head_dim),
                wv: linear(c.d_model, c.n_kv_heads * head_dim),
                wo: linear(c.n_heads * head_dim, c.d_model),
                n_heads: c.n_heads,
                n_kv_heads: c.n_kv_heads,
                head_dim,
            },
            feed_forward: FeedForward {
                swiglu: SwiGluConfig::new(c.d_model, c.hidden_size).init(device),
                w2: linear(c.hidden_size, c.d_model),
            },
            attention_norm: norm(),
            ffn_norm: norm(),
        };
        let embedding = || EmbeddingConfig::new(c.vocab_size, c.d_model).init(device);
        Self {
            tok_embeddings: stage.is_first().then(embedding),
            layers: stage.layers().map(block).collect(),
            norm: stage.is_last().then(norm),
            output: stage.is_last().then(|| linear(c.d_model, c.vocab_size)),
            rope: c.rope(device),
        }
    }
    // ANCHOR_END: new

    // ANCHOR: load
    /// Which modules the first and the last stage hold, and the layers the stages divide.
    pub fn pp_plan(c: &LlamaConfig) -> PpPlan {
        let plan = PpPlan::new("layers", c.n_layers).first(&["tok_embeddings"]);
        plan.last(&["norm", "output"])
    }

    /// This stage's part of the model, with the weights `weights` holds, read as `options`
    /// say.
    pub fn load(
        c: &LlamaConfig,
        weights: &RecordSource,
        options: &LoadOptions,
        stage: &PpStage,
        tp: &Comm,
        device: &Device,
    ) -> Result<Self> {
        let plan = TpPlan::new().column(&["*.wq", "*.wk", "*.wv", "*.swiglu"])?;
        let plan = plan.row(&["*.wo", "*.w2"])?;
        let plan = plan.vocab(&["tok_embeddings", "output"])?;
        let plan = plan.make_vocab_size_divisible_by(8)?;
        let model = stage.tp_plan(plan).apply(Self::new(c, stage, device), tp)?;
        let options = stage.load_options(options.clone());
        Ok(load_sharded(model, weights, tp, &options)?.0)
    }
    // ANCHOR_END: load

    // ANCHOR: forward
    /// `[b, s]` token ids (or, after the first stage, the previous stage's `[b, s, d]`
    /// hidden states) → `[b, s, vocab]` logits on the last stage, hidden states before it,
    /// appending to `caches` (one per layer of this stage).
    pub fn forward(
        &self,
        tokens: Tensor<2, Int>,
        hidden: Option<Tensor<3>>,
        mut caches: Option<&mut [KeyValueCache]>,
    ) -> Result<Tensor<3>> {
        let mut x = match (hidden, &self.tok_embeddings) {
            (Some(x), _) => x,
            (None, Some(embeddings)) => embeddings.forward(tokens),
            (None, None) => return Err(TpError::Invalid("this stage takes hidden states".into())),
        };
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x, caches.as_mut().map(|c| &mut c[i]), &self.rope);
        }
        match (&self.norm, &self.output) {
            (Some(norm), Some(output)) => Ok(output.forward(norm.forward(x))),
            _ => Ok(x),
        }
    }

    /// Megatron's forward step: the hidden states for the next stage, or on the last the
    /// mean next-token cross-entropy; `labels[i, t]` is `tokens[i, t + 1]`.
    pub fn forward_step(
        &self,
        tokens: Tensor<2, Int>,
        labels: Tensor<2, Int>,
        hidden: Option<Tensor<3>>,
    ) -> Result<ChunkOutput<3>> {
        let logits = self.forward(tokens, hidden, None)?;
        let Some(output) = &self.output else {
            return Ok(ChunkOutput::Activation(logits));
        };
        let [b, s, v] = logits.dims();
        let (logits, labels) = (logits.reshape([b * s, v]), labels.reshape([b * s]));
        let loss = vocab_parallel_cross_entropy(logits, labels, 0.0, &output.group())?.mean();
        Ok(ChunkOutput::Loss {
            loss,
            report: vec![],
        })
    }
    // ANCHOR_END: forward
}
