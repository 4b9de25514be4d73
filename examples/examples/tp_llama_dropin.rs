//! A Burn user's plain Llama made tensor-parallel by swapping its layers.
//!
//! ```text
//! cargo run -p burn-megatron-examples --example tp_llama_dropin [-- --tp 2 --steps 5]
//! ```
//!
//! `mod plain` is a small Llama in plain Burn; `mod parallel` is the same code with tensor-
//! parallel layers, head counts per rank and a vocabulary-parallel loss (diff the two). Both
//! train from the same weights, at TP 1 and at `--tp`; the losses and the first step's
//! gradients (gathered into the plain layout) must agree within 1e-5, or the example fails.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_megatron::launch::{self, LaunchOptions};
use burn_megatron::tensor_parallel::TpError;
use burn_megatron::topology::ParallelConfig;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Tensor-parallel size to compare with TP = 1 (1 or 2: it splits the 2 key/value heads).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Training steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
}

const VOCAB: usize = 64;
const HIDDEN: usize = 32;
const N_HEADS: usize = 4;
const N_KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / N_HEADS;
const LAYERS: usize = 2;
const FFN: usize = 48;
const SEQ: usize = 16;
const BATCH: usize = 2;
const TOLERANCE: f32 = 1e-5;

/// Llama's `repeat_kv`: `[b, kv_heads, s, d]` → `[b, kv_heads · n_rep, s, d]`, each key/value
/// head repeated for the `n_rep` query heads of its group.
fn repeat_kv(x: Tensor<4>, n_rep: usize) -> Tensor<4> {
    let [b, kv_heads, s, d] = x.dims();
    let x = x.unsqueeze_dim::<5>(2).repeat_dim(2, n_rep);
    x.reshape([b, kv_heads * n_rep, s, d])
}

/// `[1, 1, s, s]`, added to attention scores: a large negative number above the diagonal.
fn causal_mask(s: usize, device: &Device) -> Tensor<4> {
    let above = Tensor::<2, Bool>::tril_mask([s, s], 0, device);
    let zeros = Tensor::<2>::zeros([s, s], device);
    zeros.mask_fill(above, -1e9).unsqueeze()
}

/// The user's Llama, in plain Burn.
mod plain {
    use super::{FFN, HEAD_DIM, HIDDEN, LAYERS, N_HEADS, N_KV_HEADS, SEQ, VOCAB};
    use super::{causal_mask, repeat_kv};
    use burn::module::Module;
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
    use burn::nn::{RmsNorm, RmsNormConfig, RotaryEncoding, RotaryEncodingConfig};
    use burn::tensor::activation::{silu, softmax};
    use burn::tensor::{Device, Int, Tensor};

    #[derive(Module, Debug)]
    pub struct Attention {
        pub q_proj: Linear,
        pub k_proj: Linear,
        pub v_proj: Linear,
        pub o_proj: Linear,
        pub n_heads: usize,
        pub n_kv_heads: usize,
        pub head_dim: usize,
    }

    impl Attention {
        pub fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding) -> Tensor<3> {
            let [b, s, _] = x.dims();
            let mask = causal_mask(s, &x.device());
            let (n_heads, n_kv_heads) = (self.n_heads, self.n_kv_heads);
            // [b, s, heads · head_dim] → [b, heads, s, head_dim]
            let heads = |t: Tensor<3>, n| t.reshape([b, s, n, self.head_dim]).swap_dims(1, 2);
            let q = rope.forward(heads(self.q_proj.forward(x.clone()), n_heads));
            let k = rope.forward(heads(self.k_proj.forward(x.clone()), n_kv_heads));
            let v = heads(self.v_proj.forward(x), n_kv_heads);
            let k = repeat_kv(k, n_heads / n_kv_heads);
            let v = repeat_kv(v, n_heads / n_kv_heads);
            let scores = q.matmul(k.swap_dims(2, 3)) / (self.head_dim as f32).sqrt();
            let out = softmax(scores + mask, 3).matmul(v);
            let out = out.swap_dims(1, 2).reshape([b, s, n_heads * self.head_dim]);
            self.o_proj.forward(out)
        }
    }

    #[derive(Module, Debug)]
    pub struct Mlp {
        pub gate_proj: Linear,
        pub up_proj: Linear,
        pub down_proj: Linear,
    }

    impl Mlp {
        pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
            let gate = silu(self.gate_proj.forward(x.clone()));
            self.down_proj.forward(gate * self.up_proj.forward(x))
        }
    }

    #[derive(Module, Debug)]
    pub struct DecoderLayer {
        pub input_layernorm: RmsNorm,
        pub self_attn: Attention,
        pub post_attention_layernorm: RmsNorm,
        pub mlp: Mlp,
    }

    impl DecoderLayer {
        pub fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding) -> Tensor<3> {
            let h = self.input_layernorm.forward(x.clone());
            let x = x + self.self_attn.forward(h, rope);
            let h = self.post_attention_layernorm.forward(x.clone());
            x + self.mlp.forward(h)
        }
    }

    #[derive(Module, Debug)]
    pub struct Llama {
        pub embed_tokens: Embedding,
        pub layers: Vec<DecoderLayer>,
        pub norm: RmsNorm,
        pub lm_head: Linear,
        pub rope: RotaryEncoding,
    }

    impl Llama {
        pub fn new(device: &Device) -> Self {
            let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
            let rms_norm = || RmsNormConfig::new(HIDDEN).init(device);
            let layer = |_| DecoderLayer {
                input_layernorm: rms_norm(),
                self_attn: Attention {
                    q_proj: linear(HIDDEN, N_HEADS * HEAD_DIM),
                    k_proj: linear(HIDDEN, N_KV_HEADS * HEAD_DIM),
                    v_proj: linear(HIDDEN, N_KV_HEADS * HEAD_DIM),
                    o_proj: linear(N_HEADS * HEAD_DIM, HIDDEN),
                    n_heads: N_HEADS,
                    n_kv_heads: N_KV_HEADS,
                    head_dim: HEAD_DIM,
                },
                post_attention_layernorm: rms_norm(),
                mlp: Mlp {
                    gate_proj: linear(HIDDEN, FFN),
                    up_proj: linear(HIDDEN, FFN),
                    down_proj: linear(FFN, HIDDEN),
                },
            };
            Self {
                embed_tokens: EmbeddingConfig::new(VOCAB, HIDDEN).init(device),
                layers: (0..LAYERS).map(layer).collect(),
                norm: rms_norm(),
                lm_head: linear(HIDDEN, VOCAB),
                rope: RotaryEncodingConfig::new(SEQ, HEAD_DIM).init(device),
            }
        }

        /// `[b, s]` token ids → `[b, s, vocab]` logits.
        pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
            let mut x = self.embed_tokens.forward(tokens);
            for layer in &self.layers {
                x = layer.forward(x, &self.rope);
            }
            self.lm_head.forward(self.norm.forward(x))
        }

        /// Mean next-token cross-entropy; `labels[i, t]` is `tokens[i, t + 1]`.
        pub fn loss(&self, tokens: Tensor<2, Int>, labels: Tensor<2, Int>) -> Tensor<1> {
            let logits = self.forward(tokens);
            let [b, s, v] = logits.dims();
            let (logits, labels) = (logits.reshape([b * s, v]), labels.reshape([b * s]));
            let loss = CrossEntropyLossConfig::new().init(&logits.device());
            loss.forward(logits, labels)
        }
    }
}

/// The same Llama, tensor-parallel: diff this module against `plain`.
mod parallel {
    use super::{causal_mask, plain, repeat_kv};
    use burn::module::Module;
    use burn::nn::{RmsNorm, RotaryEncoding};
    use burn::tensor::activation::{silu, softmax};
    use burn::tensor::{Int, Tensor};
    use burn_megatron::comm::Comm;
    use burn_megatron::tensor_parallel::{ColumnParallelLinear, RowParallelLinear, TpError};
    use burn_megatron::tensor_parallel::{VocabParallelEmbedding, vocab_parallel_cross_entropy};

    // ANCHOR: parallel_attention
    #[derive(Module, Debug)]
    pub struct Attention {
        pub q_proj: ColumnParallelLinear,
        pub k_proj: ColumnParallelLinear,
        pub v_proj: ColumnParallelLinear,
        pub o_proj: RowParallelLinear,
        pub n_heads: usize,
        pub n_kv_heads: usize,
        pub head_dim: usize,
        #[module(skip)]
        pub tp: Comm,
    }

    impl Attention {
        pub fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding) -> Tensor<3> {
            let [b, s, _] = x.dims();
            let mask = causal_mask(s, &x.device());
            let tp = self.tp.group().size();
            let (n_heads, n_kv_heads) = (self.n_heads / tp, self.n_kv_heads / tp);
            // [b, s, heads · head_dim] → [b, heads, s, head_dim]
            let heads = |t: Tensor<3>, n| t.reshape([b, s, n, self.head_dim]).swap_dims(1, 2);
            let q = rope.forward(heads(self.q_proj.forward(x.clone()), n_heads));
            let k = rope.forward(heads(self.k_proj.forward(x.clone()), n_kv_heads));
            let v = heads(self.v_proj.forward(x), n_kv_heads);
            let k = repeat_kv(k, n_heads / n_kv_heads);
            let v = repeat_kv(v, n_heads / n_kv_heads);
            let scores = q.matmul(k.swap_dims(2, 3)) / (self.head_dim as f32).sqrt();
            let out = softmax(scores + mask, 3).matmul(v);
            let out = out.swap_dims(1, 2).reshape([b, s, n_heads * self.head_dim]);
            self.o_proj.forward(out)
        }
    }
    // ANCHOR_END: parallel_attention

    #[derive(Module, Debug)]
    pub struct Mlp {
        pub gate_proj: ColumnParallelLinear,
        pub up_proj: ColumnParallelLinear,
        pub down_proj: RowParallelLinear,
    }

    impl Mlp {
        pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
            let gate = silu(self.gate_proj.forward(x.clone()));
            self.down_proj.forward(gate * self.up_proj.forward(x))
        }
    }

    #[derive(Module, Debug)]
    pub struct DecoderLayer {
        pub input_layernorm: RmsNorm,
        pub self_attn: Attention,
        pub post_attention_layernorm: RmsNorm,
        pub mlp: Mlp,
    }

    impl DecoderLayer {
        pub fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding) -> Tensor<3> {
            let h = self.input_layernorm.forward(x.clone());
            let x = x + self.self_attn.forward(h, rope);
            let h = self.post_attention_layernorm.forward(x.clone());
            x + self.mlp.forward(h)
        }
    }

    #[derive(Module, Debug)]
    pub struct Llama {
        pub embed_tokens: VocabParallelEmbedding,
        pub layers: Vec<DecoderLayer>,
        pub norm: RmsNorm,
        pub lm_head: ColumnParallelLinear,
        pub rope: RotaryEncoding,
        #[module(skip)]
        pub tp: Comm,
    }

    impl Llama {
        // ANCHOR: parallel_split
        /// This rank's shard of `p` (the same plain model on every rank of `tp`).
        pub fn split(p: &plain::Llama, tp: &Comm) -> Result<Self, TpError> {
            let (column, row) = (ColumnParallelLinear::split, RowParallelLinear::split);
            let layer = |l: &plain::DecoderLayer| -> Result<_, TpError> {
                let (a, f) = (&l.self_attn, &l.mlp);
                Ok(DecoderLayer {
                    input_layernorm: l.input_layernorm.clone(),
                    self_attn: Attention {
                        q_proj: column(&a.q_proj, tp)?,
                        k_proj: column(&a.k_proj, tp)?,
                        v_proj: column(&a.v_proj, tp)?,
                        o_proj: row(&a.o_proj, tp)?,
                        n_heads: a.n_heads,
                        n_kv_heads: a.n_kv_heads,
                        head_dim: a.head_dim,
                        tp: tp.clone(),
                    },
                    post_attention_layernorm: l.post_attention_layernorm.clone(),
                    mlp: Mlp {
                        gate_proj: column(&f.gate_proj, tp)?,
                        up_proj: column(&f.up_proj, tp)?,
                        down_proj: row(&f.down_proj, tp)?,
                    },
                })
            };
            Ok(Self {
                embed_tokens: VocabParallelEmbedding::split(&p.embed_tokens, tp)?,
                layers: p.layers.iter().map(layer).collect::<Result<_, _>>()?,
                norm: p.norm.clone(),
                lm_head: column(&p.lm_head, tp)?,
                rope: p.rope.clone(),
                tp: tp.clone(),
            })
        }
        // ANCHOR_END: parallel_split

        /// `[b, s]` token ids → `[b, s, vocab / tp]` logits (this rank's vocabulary slice).
        pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
            let mut x = self.embed_tokens.forward(tokens);
            for layer in &self.layers {
                x = layer.forward(x, &self.rope);
            }
            self.lm_head.forward(self.norm.forward(x))
        }

        // ANCHOR: parallel_loss
        /// Mean next-token cross-entropy; `labels[i, t]` is `tokens[i, t + 1]`.
        pub fn loss(
            &self,
            tokens: Tensor<2, Int>,
            labels: Tensor<2, Int>,
        ) -> Result<Tensor<1>, TpError> {
            let logits = self.forward(tokens);
            let [b, s, v] = logits.dims();
            let (logits, labels) = (logits.reshape([b * s, v]), labels.reshape([b * s]));
            let loss = vocab_parallel_cross_entropy(logits, labels, 0.0, &self.tp)?;
            Ok(loss.mean())
        }
        // ANCHOR_END: parallel_loss
    }
}

/// Gathers a parallel model (of weights or of gradients) back into the plain layout: a
/// collective, every rank of the group calls it.
fn gather(m: &parallel::Llama) -> Result<plain::Llama, TpError> {
    let mut layers = Vec::new();
    for l in &m.layers {
        let (a, f) = (&l.self_attn, &l.mlp);
        layers.push(plain::DecoderLayer {
            input_layernorm: l.input_layernorm.clone(),
            self_attn: plain::Attention {
                q_proj: a.q_proj.to_linear()?,
                k_proj: a.k_proj.to_linear()?,
                v_proj: a.v_proj.to_linear()?,
                o_proj: a.o_proj.to_linear()?,
                n_heads: a.n_heads,
                n_kv_heads: a.n_kv_heads,
                head_dim: a.head_dim,
            },
            post_attention_layernorm: l.post_attention_layernorm.clone(),
            mlp: plain::Mlp {
                gate_proj: f.gate_proj.to_linear()?,
                up_proj: f.up_proj.to_linear()?,
                down_proj: f.down_proj.to_linear()?,
            },
        });
    }
    Ok(plain::Llama {
        embed_tokens: m.embed_tokens.to_embedding()?,
        layers,
        norm: m.norm.clone(),
        lm_head: m.lm_head.to_linear()?,
        rope: m.rope.clone(),
    })
}

/// Every float parameter's path and values, in module order: plain data that rank threads
/// may share (autodiff-tracked tensors they must not).
type Weights = Vec<(String, TensorData)>;

fn weights<M: Module>(model: &M) -> Weights {
    struct Collect(Vec<String>, Weights);
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.1.push((self.0.join("."), p.val().into_data()));
        }
    }
    let mut c = Collect(Vec::new(), Vec::new());
    model.visit(&mut c);
    c.1
}

/// `model` with its parameters replaced, in module order, by `weights` on `device`.
fn load<M: Module>(model: M, weights: &Weights, device: &Device) -> M {
    struct Load<'a>(std::slice::Iter<'a, (String, TensorData)>, &'a Device);
    impl ModuleMapper for Load<'_> {
        fn map_float<const D: usize>(&mut self, _: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (_, data) = self.0.next().expect("as many weights as parameters");
            Param::from_tensor(Tensor::from_data(data.clone(), self.1))
        }
    }
    model.map(&mut Load(weights.iter(), device))
}

/// `model` with every parameter replaced by its gradient (as `tests/src/lib.rs`).
fn as_gradients<M: Module>(model: &M, grads: &GradientsParams) -> M {
    struct ToGrad<'a>(&'a GradientsParams);
    impl ModuleMapper for ToGrad<'_> {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let g = self.0.get::<D>(p.id).expect("a gradient");
            p.map(|_| g)
        }
    }
    model.clone().map(&mut ToGrad(grads))
}

/// `steps` AdamW steps on a fixed batch; the losses, and the first step's gradients as
/// `grads_of` lays them out.
fn train<M: Module>(
    mut model: M,
    steps: usize,
    device: &Device,
    loss: impl Fn(&M, Tensor<2, Int>, Tensor<2, Int>) -> Result<Tensor<1>, TpError>,
    grads_of: impl Fn(&M, &GradientsParams) -> Result<Weights, TpError>,
) -> Result<(Vec<f32>, Weights), TpError> {
    // A fixed token stream: inputs, and labels one token ahead.
    let v: Vec<i64> = (0..BATCH * (SEQ + 1))
        .map(|i| ((i * 5 + i / 3) % VOCAB) as i64)
        .collect();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(v, [BATCH, SEQ + 1]), device);
    let mut optim = AdamWConfig::new().with_weight_decay(0.01).init();
    let (mut losses, mut grads0) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let (x, y) = (ids.clone().narrow(1, 0, SEQ), ids.clone().narrow(1, 1, SEQ));
        let l = loss(&model, x, y)?;
        losses.push(l.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(l.backward(), &model);
        if step == 0 {
            grads0 = grads_of(&model, &grads)?;
        }
        model = optim.step(3e-3, model, grads);
    }
    Ok((losses, grads0))
}

/// The largest of `values` (NaN if any is NaN).
fn max(values: impl Iterator<Item = f32>) -> f32 {
    values.max_by(f32::total_cmp).unwrap_or(0.0)
}

/// The largest difference between `a` and `b` relative to `a`'s largest magnitude.
fn relative_difference(a: &TensorData, b: &TensorData) -> f32 {
    if a.shape() != b.shape() {
        return f32::INFINITY;
    }
    let scale = max(a.iter::<f32>().map(f32::abs)).max(f32::MIN_POSITIVE);
    max(a
        .iter::<f32>()
        .zip(b.iter())
        .map(|(x, y): (f32, f32)| (x - y).abs()))
        / scale
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if !N_KV_HEADS.is_multiple_of(args.tp) {
        return Err("--tp must divide the 2 key/value heads".into());
    }
    // The plain model, built once off the autodiff device; only its data is kept.
    let device = Device::flex();
    device.seed(42);
    let init = weights(&plain::Llama::new(&device));

    // TP 1: the plain model.
    let ad = Device::flex().autodiff();
    let (single, plain_grads) = train(
        load(plain::Llama::new(&ad), &init, &ad),
        args.steps,
        &ad,
        |m, x, y| Ok(m.loss(x, y)),
        |m, g| Ok(weights(&as_gradients(m, g))),
    )?;

    // TP = --tp: each rank rebuilds the plain model from the data, then swaps its layers.
    let ranks = launch::threads(
        &ParallelConfig::new(args.tp, args.tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let plain = load(plain::Llama::new(&ctx.device), &init, &ctx.device);
            train(
                parallel::Llama::split(&plain, &ctx.groups.tp)?,
                args.steps,
                &ctx.device,
                |m, x, y| m.loss(x, y),
                |m, g| Ok(weights(&gather(&as_gradients(m, g))?)),
            )
        },
    )?;
    let (parallel, parallel_grads) = ranks.into_iter().next().expect("at least one rank");

    let tp_loss = format!("TP={} loss", args.tp);
    println!(" step    TP=1 loss {tp_loss:>12}     |diff|");
    for (step, (a, b)) in single.iter().zip(&parallel).enumerate() {
        println!("{step:>5} {a:>12.6} {b:>12.6} {:>10.2e}", (a - b).abs());
    }
    let worst_loss = max(single.iter().zip(&parallel).map(|(a, b)| (a - b).abs()));
    println!("largest loss difference: {worst_loss:.2e}");
    let (worst_grad, name) = plain_grads
        .iter()
        .zip(&parallel_grads)
        .map(|((name, a), (_, b))| (relative_difference(a, b), name.as_str()))
        .max_by(|x, y| x.0.total_cmp(&y.0))
        .expect("parameters");
    println!("largest relative gradient difference (step 0): {worst_grad:.2e} ({name})");
    // Written so that a NaN fails too.
    if !(worst_loss <= TOLERANCE && worst_grad <= TOLERANCE) {
        let tp = args.tp;
        return Err(format!("TP={tp} differs from TP=1 by more than {TOLERANCE:e}").into());
    }
    Ok(())
}
