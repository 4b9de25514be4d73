//! A checkpoint's global tensors read whole, whatever layout saved them: what tools and
//! tests compare two checkpoints by.

use super::CheckpointError;
use super::find::stored_key;
use super::index::CheckpointIndex;
use super::tensors::{Files, Placement};
use burn::tensor::TensorData;

impl CheckpointIndex {
    /// The state sets this checkpoint holds (`model`, `master`, the fused Adam's `exp_avg`
    /// and `exp_avg_sq`, a burn-optim optimizer's `optim.{field}`), sorted.
    pub fn sets(&self) -> Vec<String> {
        let mut sets: Vec<String> = self
            .ranks
            .iter()
            .flat_map(|(_, r)| r.tensors.iter().map(|t| t.set.clone()))
            .collect();
        sets.sort();
        sets.dedup();
        sets
    }

    /// The global names of `set`'s tensors, sorted.
    pub fn tensor_names(&self, set: &str) -> Vec<String> {
        self.shards(set).keys().map(|n| n.to_string()).collect()
    }

    /// The whole global tensor `name` of `set`, assembled from every shard that holds a
    /// part of it (each file checked against its index).
    ///
    /// ```no_run
    /// use burn_megatron::checkpoint::{CheckpointIndex, iteration_dir};
    /// use std::path::Path;
    /// let index = CheckpointIndex::read(&iteration_dir(Path::new("ckpt"), 10)).unwrap();
    /// for name in index.tensor_names("model") {
    ///     let whole = index.read_tensor("model", &name).unwrap();
    ///     println!("{name}: {:?}", whole.shape());
    /// }
    /// ```
    pub fn read_tensor(&self, set: &str, name: &str) -> Result<TensorData, CheckpointError> {
        let global_shape = self
            .shards(set)
            .get(name)
            .and_then(|found| found.first())
            .map(|(_, entry)| entry.global_shape.clone())
            .ok_or_else(|| {
                CheckpointError::Mismatch(format!(
                    "{set} tensor {name}: not in the checkpoint at {}",
                    self.dir.display()
                ))
            })?;
        let key = stored_key(set, name);
        let whole = Placement {
            offset: vec![0; global_shape.len()],
            global_shape: global_shape.clone(),
            stored: global_shape.clone(),
            padded_dim: None,
        };
        Files::new(self).slice_in(set, &key, name, &whole, &global_shape)
    }
}
