//! One pipeline stage's part of a whole model's module paths (what
//! [`PpStage`](crate::dropin::PpStage) hands down to loading and to a plan).

use crate::module_path::{is_under, layer_index};
use crate::tensor_parallel::update_parallel_attrs;
use burn::module::ParamId;
use std::ops::Range;

/// The part of a whole model's record one pipeline stage holds: the stage's `layers.{i}`
/// are the record's `layers.{range.start + i}`, and the record's other layers and the
/// tensors under `elsewhere` belong to other stages.
#[derive(Debug, Clone)]
pub(crate) struct StageKeys {
    /// The module path of the layer stack (`layers`).
    pub(crate) prefix: String,
    /// The stage's layers, by global index.
    pub(crate) layers: Range<usize>,
    /// The whole model's layers.
    pub(crate) total: usize,
    /// Modules other stages hold (glob patterns over module paths).
    pub(crate) elsewhere: Vec<glob::Pattern>,
    /// Modules tied between the first and the last stage, and whether this stage holds the
    /// last stage's copy (none where one stage holds both ends, or neither).
    pub(crate) tied: Option<(Vec<glob::Pattern>, bool)>,
}

/// Where a record key goes when one stage loads.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum StageKey {
    /// This stage's module path for it.
    Here(String),
    /// Another stage holds it.
    Elsewhere,
}

impl StageKeys {
    /// The whole model's path for this stage's `path`: its layer index moved up by the
    /// stage's first layer.
    pub(crate) fn global_name(&self, path: &str) -> String {
        match layer_index(&self.prefix, path) {
            Some((i, tail)) => format!("{}.{}{tail}", self.prefix, self.layers.start + i),
            None => path.to_string(),
        }
    }

    /// Whether a plan's layer pattern that matches nothing here may name a module another
    /// stage holds: one of theirs, a layer outside this stage's, or any of the stack's layers
    /// (`layers.*`) on a stage that holds none (a layout's stage of no layer).
    pub(crate) fn may_name_elsewhere(&self, rule: &glob::Pattern) -> bool {
        let theirs = self
            .elsewhere
            .iter()
            .any(|e| rule.matches(e.as_str()) || e.matches(rule.as_str()));
        let layer = layer_index(&self.prefix, rule.as_str());
        let in_stack = (rule.as_str().strip_prefix(self.prefix.as_str()))
            .is_some_and(|tail| tail.starts_with('.'));
        theirs
            || layer.is_some_and(|(i, _)| i < self.total && !self.layers.contains(&i))
            || (in_stack && self.layers.is_empty())
    }

    /// Where the record's `key` (a module path once renamed) goes; an error for a layer
    /// past the whole model's.
    pub(crate) fn place(&self, key: &str) -> Result<StageKey, String> {
        if let Some((i, tail)) = layer_index(&self.prefix, key) {
            if i >= self.total {
                return Err(format!(
                    "the record holds `{}.{i}`, but the pipeline plan divides {} layers",
                    self.prefix, self.total
                ));
            }
            return Ok(match self.layers.contains(&i) {
                true => StageKey::Here(format!("{}.{}{tail}", self.prefix, i - self.layers.start)),
                false => StageKey::Elsewhere,
            });
        }
        Ok(match self.is_elsewhere(key) {
            true => StageKey::Elsewhere,
            false => StageKey::Here(key.to_string()),
        })
    }

    /// How this stage's paths relate to the whole model's, for an error naming a path.
    pub(crate) fn paths_note(&self) -> String {
        let (start, end) = (self.layers.start, self.layers.end);
        format!(
            "paths of a pipeline stage: its `{p}.0` to `{p}.{}` are the whole model's `{p}.{start}` \
             to `{p}.{}`",
            end - start - 1,
            end - 1,
            p = self.prefix
        )
    }

    /// The parameter at `path` marked as a tied copy when it lies under a tied module
    /// (Megatron's `shared_embedding`; the last stage's copy `shared`, out of the grad norm
    /// and of checkpoints).
    pub(crate) fn tie(&self, path: &str, id: ParamId) {
        if let Some((patterns, second)) = &self.tied
            && patterns.iter().any(|p| is_under(p, path))
        {
            update_parallel_attrs(id, |a| a.tied_embedding(*second));
        }
    }

    /// Whether the record's `key` lies in the layer stack.
    pub(crate) fn in_stack(&self, key: &str) -> bool {
        layer_index(&self.prefix, key).is_some()
    }

    /// What to say after an error about a module that is here or absent, on a stage that
    /// is not the whole model.
    pub(crate) fn hint(&self) -> &'static str {
        "; on a pipeline stage, a module that only the first or the last stage holds belongs \
         in `PpPlan::first` or `PpPlan::last`"
    }

    /// Why the model's parameter at `path` cannot be on this stage, if it cannot.
    pub(crate) fn misplaced(&self, path: &str) -> Option<String> {
        let (start, end) = (self.layers.start, self.layers.end);
        if let Some((i, _)) = layer_index(&self.prefix, path).filter(|(i, _)| *i >= end - start) {
            return Some(format!(
                "the model holds `{}.{i}`, but this pipeline stage holds {} layers of `{}` \
                 ({start}..{end} of the whole model)",
                self.prefix,
                end - start,
                self.prefix
            ));
        }
        self.is_elsewhere(path).then(|| {
            "the plan puts this parameter on another pipeline stage, yet this stage holds it"
                .to_string()
        })
    }

    /// Whether `path` lies under a module another stage holds.
    fn is_elsewhere(&self, path: &str) -> bool {
        self.elsewhere.iter().any(|pattern| is_under(pattern, path))
    }
}
