//! Megatron-LM-style model parallelism for [Burn](https://burn.dev).
//!
//! A training loop touches one object per concept: a layout ([`topology::ParallelConfig`]),
//! ranks launched with their groups ([`launch::threads`], [`launch::from_env`]), a model
//! built per pipeline stage ([`models::GptConfig`], [`models::BertConfig`], or a Burn
//! model converted by [`dropin`]), and [`training::ParallelTraining`]
//! for everything between backward and the next forward: the gradient reductions
//! (`finalize`), the optimizer (`optimizer`) and checkpoints (`save`, `load`). A step is
//! [`pipeline::forward_backward_func`] → `finalize` → the optimizer's `step`; the
//! `train_minimal` example is that loop in one screen.
//!
//! # Module map
//!
//! The modules, bottom up: no module imports one listed after it (data parallelism, the
//! optimizer and the pipeline do not import the models either); `tests/layering.rs` holds
//! the exact table and checks both.
//!
//! - [`topology`]: how global ranks are laid out into tensor-, pipeline-, data-, context-
//!   and expert-parallel groups (Megatron-Core's exact rank arithmetic), and how the layers
//!   are placed over the pipeline's stages (`LayerSplit`, `PipelineLayout`).
//! - [`aux_loss`]: losses computed inside the model (MoE load balancing) whose gradient
//!   enters backward directly.
//! - [`comm`]: collectives between ranks (NCCL-shaped), every call bounded by a timeout; the
//!   thread, MPI and NCCL backends.
//! - [`tensor_parallel`]: differentiable mappings, parallel layers, vocab-parallel
//!   cross-entropy, initialisation and dropout RNG independent of the TP size.
//! - [`context_parallel`]: one sequence split over the context-parallel group.
//! - [`moe`]: mixture of experts: router, token dispatch over the expert-parallel group,
//!   experts.
//! - [`recompute`]: activation recomputation (Megatron's `--recompute-granularity`).
//! - [`models`]: one transformer core (attention, MLP, layer) and the GPT / Llama family
//!   and BERT over it, with Hugging Face import and export and generation.
//! - [`data_parallel`]: gradient reduction over the data-parallel group in buckets, after
//!   backward or overlapped with it, the distributed optimizer's shard plans (its sharded
//!   step is in [`optimizer`]), the replicas' weights broadcast and compared, and
//!   synchronised `BatchNorm` (`batch_norm/`, public as [`dropin::nn::BatchNorm`]).
//! - [`data`]: pretraining data: corpora, tokenizers, BERT and GPT samples, Megatron's
//!   indexed datasets.
//! - [`optimizer`]: Megatron's LR / WD scheduler, loss scalers, and the optimizer wrapper
//!   (FP32 master weights, overflow skipping, global-norm clipping, ZeRO-1).
//! - [`pipeline`]: schedules (1F1B, interleaved), p2p between stages and
//!   `forward_backward_func` over any model's chunks.
//! - [`launch`]: run one closure per rank (threads of this process, or processes), each
//!   handed its groups, device and pipeline channels.
//! - [`checkpoint`]: training checkpoints (weights, master weights, optimizer state) that
//!   load at any layout.
//! - [`dropin`]: a model written with `burn::nn` made tensor- and pipeline-parallel: Burn's
//!   layers that one plan splits, pipeline stages of the model, and its record loaded as
//!   each rank's shards and saved back whole.
//! - [`training`]: one rank's side of training in one object.
//! - [`device`]: the devices a rank computes on (CUDA, wgpu), in every build: without the
//!   feature a device needs, an error saying so.
//! - `cuda` (feature `cuda`): the CUDA device and its libraries, from
//!   `burn_megatron_kernels`, with their errors as types.
//!
//! Crate-private helpers, at the bottom: `activation` (activation functions by name),
//! `grad_hooks` (where a parameter's gradient is handed to the overlapped reduction),
//! `module_path` (parameters by their path in a module), `param_grads` (gradients by
//! parameter id, any tensor rank), `safetensors_io`, `pytorch_io` (PyTorch checkpoints'
//! dtypes), `legacy_record` (the `.mpk` records of Burn before 0.22), `mapped_file` (files
//! read through a memory map) and `shards` (a box of a tensor cut out of, or put together
//! from, pieces).
//!
//! # Lower-level ways in
//!
//! Where [`training::ParallelTraining`] assembles lower-level pieces, those stay public for a
//! loop that holds them itself: [`optimizer::MegatronOptimizer`], and in an `advanced`
//! module beside their concept, [`data_parallel::advanced`] (the `finalize_model_grads`
//! family, reducers, shard plans) and [`checkpoint::advanced`] (one rank's save and load,
//! and the commit protocol).
//!
//! # Global state
//!
//! Three things are process-wide, because Burn gives a parameter no place to carry them and
//! the code that needs them runs inside Burn's backward, where no argument reaches:
//!
//! - the parameter attributes (tensor-parallel? partition dim? sequence-parallel? shared
//!   embedding? expert?), a registry keyed by `ParamId` ([`tensor_parallel::parallel_attrs`]).
//!   Megatron sets them as attributes of the torch parameter; layers state them here at init
//!   and at every forward, and a [`tensor_parallel::LayoutOwner`] field of the layer removes
//!   them when the layer is dropped.
//! - the gradient-hook claims and the active reducer (`grad_hooks`): which parameters an
//!   overlapped data-parallel reducer waits for, and, per thread, the reducer a backward now
//!   delivers to and the recomputation phase. The pipeline executor activates a chunk's
//!   reducer around its forward and backward.
//! - the auxiliary-loss scale, per thread ([`aux_loss::scale_aux_losses`]): the gradient an
//!   MoE layer's load-balancing loss receives, set by the pipeline executor for its
//!   micro-batches (Megatron's `MoEAuxLossAutoScaler`).
//!
//! Two more live only during a call: while [`dropin::TpPlan::apply`] walks a model, a
//! thread-local hands each layer's slot its split (`dropin/slot.rs`; Burn's traversal gives
//! a mapper parameters, not fields), and while
//! [`training::ParallelTraining::sync_batch_norm`] walks one, another hands each
//! `BatchNorm` its group (`data_parallel/batch_norm/`); both are empty before and after.
//!
//! And one store that only grows: each distinct `--pipeline-model-parallel-layout` parsed
//! ([`topology::PipelineLayout`]) is kept for the life of the process, so that the layer
//! split carrying it stays `Copy`.
//!
//! Beside them, caches that cannot go stale: `param_grads`' accessors per tensor rank, the
//! kernels' wgpu device (opened once per process), a counter for unique temporary names in
//! the dataset index cache. Ranks as threads share all of these; each entry is keyed by
//! parameter id or thread, so ranks do not see each other's.

mod activation;
pub mod aux_loss;
pub mod checkpoint;
pub mod comm;
pub mod context_parallel;
#[cfg(feature = "cuda")]
pub use burn_megatron_kernels::cuda;
pub mod data;
pub mod data_parallel;
pub mod device;
pub mod dropin;
mod grad_hooks;
pub mod launch;
mod legacy_record;
mod mapped_file;
pub mod models;
mod module_path;
pub mod moe;
pub mod optimizer;
mod param_grads;
pub mod pipeline;
mod pytorch_io;
pub mod recompute;
mod safetensors_io;
mod shards;
pub mod tensor_parallel;
pub mod topology;
pub mod training;
