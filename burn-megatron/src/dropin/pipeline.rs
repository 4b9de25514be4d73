//! A Burn model's layers split into pipeline stages: which modules only the first and the
//! last stage hold, and where the stack of layers is, stated once.
//!
//! Rust field types are static and a `ModuleMapper` cannot shorten a `Vec`, so a stage is
//! built as Megatron builds one: the model's constructor takes the [`PpStage`] and builds
//! its layers ([`PpStage::layers`]), its embedding where [`PpStage::is_first`] (Megatron's
//! `pre_process`) and its head where [`PpStage::is_last`] (`post_process`), as `Option`
//! fields. Its forward takes the previous stage's hidden states where it has no embedding.
//! Everything else here is names: the stage's `layers.{i}` is the whole model's
//! `layers.{start + i}`, in the record it loads from ([`PpStage::load_options`]), in the
//! draws of its split layers ([`PpStage::tp_plan`]) and in checkpoints
//! ([`PpPlan::global_names`]).

use crate::comm::tensor::all_reduce;
use crate::comm::{Comm, CommError, ReduceOp};
use crate::dropin::{LoadOptions, StageKeys, TpPlan};
use crate::module_path::{PathMapper, PathVisitor, is_under, layer_index, map_paths, visit_paths};
use crate::pipeline::PipelineError;
use crate::tensor_parallel::parallel_attrs;
use crate::topology::{ParallelState, PipelinePosition};
use burn::module::{Module, Param, ParamId};
use burn::tensor::Tensor;
use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;

/// How a model's module tree splits into pipeline stages, by module path: the stack of
/// `num_layers` layers (a `Vec` field) that the stages divide, and the modules only the
/// first or the last virtual stage holds (glob patterns, `*` matching any run of
/// characters).
///
/// ```
/// use burn_megatron::dropin::PpPlan;
/// use burn_megatron::topology::PipelinePosition;
/// let plan = PpPlan::new("layers", 8).first(&["tok_embeddings"]).last(&["norm", "output"]);
/// // 2 stages of 2 chunks: chunk 1 of stage 0 is virtual stage 2, layers 4..6.
/// let stage = plan.stage(PipelinePosition::new(2, 0, 2, 1)).unwrap();
/// assert_eq!(stage.layers(), 4..6);
/// assert!(!stage.is_first() && !stage.is_last());
/// assert_eq!(stage.global_name("layers.1.attention.wq.weight"), "layers.5.attention.wq.weight");
/// // 8 layers do not split over 3 stages; a pattern must parse.
/// assert!(plan.stage(PipelinePosition::new(3, 0, 1, 0)).is_err());
/// let bad = PpPlan::new("layers", 8).first(&["[unclosed"]);
/// assert!(bad.stage(PipelinePosition::whole()).is_err());
/// ```
#[derive(Debug, Clone)]
pub struct PpPlan {
    layers: String,
    num_layers: usize,
    first: Vec<String>,
    last: Vec<String>,
    tied: Vec<String>,
}

impl PpPlan {
    /// The stages divide the `num_layers` elements of the `Vec` at module path `layers`
    /// (a path, not a pattern: `layers`, `decoder.layers`) as the position's
    /// [`LayerSplit`](crate::topology::LayerSplit) says: evenly, `num_layers / (P·V)` each,
    /// unless the layout sets Megatron's uneven first and last stages or writes every stage
    /// out ([`PipelineLayout`](crate::topology::PipelineLayout)), through
    /// [`ParallelConfig::with_layer_split`](crate::topology::ParallelConfig::with_layer_split).
    pub fn new(layers: &str, num_layers: usize) -> Self {
        Self {
            layers: layers.to_string(),
            num_layers,
            first: Vec::new(),
            last: Vec::new(),
            tied: Vec::new(),
        }
    }

    /// Modules only the first virtual stage holds (the embeddings: Megatron's
    /// `pre_process`).
    /// Patterns are checked by [`stage`](Self::stage).
    pub fn first(mut self, patterns: &[&str]) -> Self {
        self.first.extend(patterns.iter().map(|p| p.to_string()));
        self
    }

    /// Modules only the last virtual stage holds (the final norm and the output layer:
    /// Megatron's `post_process`).
    pub fn last(mut self, patterns: &[&str]) -> Self {
        self.last.extend(patterns.iter().map(|p| p.to_string()));
        self
    }

    /// Modules the first virtual stage holds and the last holds a copy of, their weights
    /// tied (an output layer that reads the word embedding: Megatron's default, without
    /// `--untie-embeddings-and-output-weights`). Both copies load the same tensor of the
    /// record, or are drawn alike by [`PpStage::tp_plan`]; the load or the plan marks them
    /// (`ParallelAttrs::shared_embedding`), so `ParallelTraining::finalize` sums their
    /// gradients over the embedding group and the grad norm, checkpoints and
    /// [`save_gathered_stages`](super::save_gathered_stages) count the last stage's copy
    /// out.
    pub fn tied(mut self, patterns: &[&str]) -> Self {
        self.tied.extend(patterns.iter().map(|p| p.to_string()));
        self
    }

    /// The stage at `position`, or an error (before anything is built) when its split
    /// cannot place the layers, the stack's path is a pattern, or a module pattern does not
    /// parse.
    pub fn stage(&self, position: PipelinePosition) -> Result<PpStage, PipelineError> {
        let stack = &self.layers;
        if stack.is_empty() || stack.contains(['*', '?', '[', ']']) {
            return Err(PipelineError::Invalid(format!(
                "the layer stack `{stack}` must be a module path (`layers`, `decoder.layers`), \
                 not a pattern"
            )));
        }
        let (first, last, tied) = (globs(&self.first)?, globs(&self.last)?, globs(&self.tied)?);
        let layers = position
            .layer_range(self.num_layers)
            .map_err(|e| PipelineError::Invalid(format!("`{}`: {e}", self.layers)))?;
        Ok(PpStage {
            stack: stack.clone(),
            num_layers: self.num_layers,
            first,
            last,
            tied,
            position,
            layers,
        })
    }

    /// This rank's stages, one per model chunk (V of them with a virtual pipeline).
    pub fn stages(&self, state: &ParallelState) -> Result<Vec<PpStage>, PipelineError> {
        let v = state.virtual_pipeline_model_parallel_size().unwrap_or(1);
        (0..v)
            .map(|chunk| self.stage(PipelinePosition::of(state, chunk)))
            .collect()
    }

    /// The whole model's name of the parameter at a module path of `stages`' chunks (a
    /// `Vec` of them: `"1.layers.0.…"`, or of one chunk: `"layers.0.…"`), for
    /// [`ParallelTrainingConfig::init`](crate::training::ParallelTrainingConfig::init): a
    /// checkpoint keys tensors by it, and so loads at any pipeline layout.
    pub fn global_names(&self, stages: &[PpStage]) -> Arc<dyn Fn(&str) -> String + Send + Sync> {
        let keys: Vec<StageKeys> = stages.iter().map(PpStage::keys).collect();
        Arc::new(move |path: &str| match path.split_once('.') {
            Some((c, rest)) => match c.parse::<usize>().ok().and_then(|c| keys.get(c)) {
                Some(keys) => keys.global_name(rest),
                None => keys
                    .first()
                    .map_or(path.to_string(), |k| k.global_name(path)),
            },
            None => path.to_string(),
        })
    }
}

fn globs(patterns: &[String]) -> Result<Vec<glob::Pattern>, PipelineError> {
    patterns
        .iter()
        .map(|p| {
            glob::Pattern::new(p)
                .map_err(|e| PipelineError::Invalid(format!("module pattern `{p}`: {e}")))
        })
        .collect()
}

/// One model chunk's place in the pipeline and what it holds: its layers of the stack, and
/// the first or last stage's modules where it is that stage. Made by [`PpPlan::stage`].
#[derive(Debug, Clone)]
pub struct PpStage {
    /// The layer stack's module path.
    stack: String,
    num_layers: usize,
    first: Vec<glob::Pattern>,
    last: Vec<glob::Pattern>,
    tied: Vec<glob::Pattern>,
    position: PipelinePosition,
    layers: Range<usize>,
}

impl PpStage {
    /// Where the chunk sits.
    pub fn position(&self) -> PipelinePosition {
        self.position
    }

    /// Its layers, by index in the whole model (build `layers.len()` of them).
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// The first virtual stage: it embeds.
    pub fn is_first(&self) -> bool {
        self.position.is_first_stage()
    }

    /// The last virtual stage: it computes the logits and the loss.
    pub fn is_last(&self) -> bool {
        self.position.is_last_stage()
    }

    /// The whole model's module path for this chunk's `path`.
    pub fn global_name(&self, path: &str) -> String {
        self.keys().global_name(path)
    }

    /// `options` for reading this chunk from the whole model's record with
    /// [`load_sharded`](crate::dropin::load_sharded): its `layers.{i}` from
    /// the record's `layers.{start + i}`, the other stages' tensors skipped (listed in
    /// [`LoadReport::elsewhere`](crate::dropin::LoadReport)), and a
    /// parameter the stage must not hold an error naming it, as [`check`](Self::check).
    pub fn load_options(&self, options: LoadOptions) -> LoadOptions {
        options.with_stage(self.keys())
    }

    /// `plan` for this chunk: a split layer's draw is seeded by its whole-model path, not
    /// its path in the chunk (so stage 1's `layers.0` draws the whole model's layer it is),
    /// and its dropout by the virtual stage too.
    pub fn tp_plan(&self, plan: TpPlan) -> TpPlan {
        plan.at_stage(self.keys(), self.position.virtual_stage())
    }

    /// Checks that `chunk` holds what this stage holds: layers `0..layers().len()` of the
    /// stack and no more, the first stage's modules only on the first, the last's only on
    /// the last, the tied ones on both and marked tied. An error names what is missing or misplaced. `load_sharded` with
    /// [`load_options`](Self::load_options) makes the same checks.
    pub fn check<M: Module>(&self, chunk: &M) -> Result<(), PipelineError> {
        struct Paths(Vec<String>, Vec<ParamId>);
        impl PathVisitor for Paths {
            fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
                self.0.push(path.to_string());
                self.1.push(p.id);
            }
        }
        let mut paths = Paths(Vec::new(), Vec::new());
        visit_paths(chunk, &mut paths);
        let keys = self.keys();
        if let Some((path, why)) = paths
            .0
            .iter()
            .find_map(|p| keys.misplaced(p).map(|why| (p, why)))
        {
            return Err(self.invalid(format!("{path}: {why}")));
        }
        let prefix = &self.stack;
        let held: BTreeSet<usize> = paths
            .0
            .iter()
            .filter_map(|p| layer_index(prefix, p).map(|(i, _)| i))
            .collect();
        if let Some(i) = (0..self.layers.len()).find(|i| !held.contains(i)) {
            return Err(self.invalid(format!(
                "the chunk has no parameters under `{prefix}.{i}` (the whole model's layer {})",
                self.layers.start + i
            )));
        }
        let mine = |on: bool, patterns: &[glob::Pattern]| match on {
            true => patterns.to_vec(),
            false => Vec::new(),
        };
        let ends = self.is_first() || self.is_last();
        let expected = mine(self.is_first(), &self.first);
        let expected = (expected.into_iter())
            .chain(mine(self.is_last(), &self.last))
            .chain(mine(ends, &self.tied));
        for pattern in expected {
            if !paths.0.iter().any(|p| is_under(&pattern, p)) {
                return Err(self.invalid(format!(
                    "the chunk has no parameters under `{}`, which this stage holds",
                    pattern.as_str()
                )));
            }
        }
        // A tied copy not marked would train apart from the other end's.
        let tied_here = self.is_first() != self.is_last();
        let under_tied = |p: &str| self.tied.iter().any(|t| is_under(t, p));
        let unmarked = (paths.0.iter().zip(&paths.1))
            .find(|(p, id)| tied_here && under_tied(p) && !parallel_attrs(**id).shared_embedding);
        if let Some((path, _)) = unmarked {
            return Err(self.invalid(format!(
                "{path} is tied between the first and the last stage but not marked so: load \
                 the chunk with `load_options`, split it with `tp_plan`, or draw it and \
                 `sync_tied` it"
            )));
        }
        Ok(())
    }

    /// Megatron's first sync of tied weights, for a chunk drawn rather than loaded: the last
    /// stage's copy takes the first stage's values (zeros there, summed over `embedding`,
    /// the group of the first and the last stage: `ctx.groups.embedding`), and both are
    /// marked tied as a load marks them. A chunk that holds no copy (a middle stage, or one
    /// stage holding both ends) is returned as it is; the others are collective over
    /// `embedding`.
    pub fn sync_tied<M: Module>(
        &self,
        chunk: M,
        embedding: Option<&Comm>,
    ) -> Result<M, PipelineError> {
        let keys = self.keys();
        let Some((patterns, second)) = keys.tied.clone() else {
            return Ok(chunk);
        };
        let Some(group) = embedding else {
            return Err(self.invalid(
                "syncing tied weights needs the embedding group (`ctx.groups.embedding`)".into(),
            ));
        };
        struct Sync<'a> {
            patterns: Vec<glob::Pattern>,
            second: bool,
            group: &'a Comm,
            keys: StageKeys,
            error: Option<CommError>,
        }
        impl PathMapper for Sync<'_> {
            fn map<const D: usize>(&mut self, path: &str, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
                if self.error.is_some() || !self.patterns.iter().any(|t| is_under(t, path)) {
                    return p;
                }
                let value = match self.second {
                    true => p.val().zeros_like(),
                    false => p.val(),
                };
                match all_reduce(&**self.group, value.detach(), ReduceOp::Sum) {
                    Ok(synced) => {
                        let id = p.id;
                        self.keys.tie(path, id);
                        p.transform_for_load(synced, id)
                    }
                    Err(e) => {
                        self.error = Some(e);
                        p
                    }
                }
            }
        }
        let mut sync = Sync {
            patterns,
            second,
            group,
            keys,
            error: None,
        };
        let chunk = map_paths(chunk, &mut sync);
        match sync.error {
            Some(e) => Err(PipelineError::Comm(e)),
            None => Ok(chunk),
        }
    }

    fn invalid(&self, why: String) -> PipelineError {
        let p = self.position;
        PipelineError::Invalid(format!(
            "pipeline stage {} of {} (virtual stage {} of {}): {why}",
            p.pipeline_rank,
            p.pipeline_size,
            p.virtual_stage(),
            p.pipeline_size * p.num_model_chunks
        ))
    }

    fn keys(&self) -> StageKeys {
        let elsewhere = |on: bool, patterns: &[glob::Pattern]| match on {
            true => Vec::new(),
            false => patterns.to_vec(),
        };
        let (first, last) = (self.is_first(), self.is_last());
        let mut others = elsewhere(first, &self.first);
        others.extend(elsewhere(last, &self.last));
        others.extend(elsewhere(first || last, &self.tied));
        // One stage holding both ends holds one copy: nothing to tie.
        let tied = (first != last).then(|| (self.tied.clone(), !first));
        StageKeys {
            prefix: self.stack.clone(),
            layers: self.layers.clone(),
            total: self.num_layers,
            elsewhere: others,
            tied,
        }
    }
}
