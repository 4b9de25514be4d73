//! How a global batch splits into data-parallel ranks' micro-batches: the batch arithmetic
//! every model's loop shares (BERT's, GPT's, `train_minimal`'s).

use super::DataError;

/// Which samples each rank reads: global batch `iteration` is samples
/// `[iteration · global, (iteration + 1) · global)`; data-parallel rank `r` reads its
/// contiguous `global / dp` share, in micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLayout {
    /// Samples per optimizer step over all data-parallel ranks.
    pub global_batch_size: usize,
    /// Samples per forward/backward.
    pub micro_batch_size: usize,
    /// Data-parallel ranks.
    pub data_parallel_size: usize,
}

impl BatchLayout {
    /// Checks that the global batch splits into micro-batches on every data-parallel rank.
    pub fn new(global: usize, micro: usize, dp: usize) -> Result<Self, DataError> {
        if micro == 0 || dp == 0 || global == 0 || !global.is_multiple_of(micro * dp) {
            return Err(DataError::Config(format!(
                "global batch size ({global}) is not divisible by micro batch size ({micro}) \
                 times data-parallel size ({dp})"
            )));
        }
        Ok(Self {
            global_batch_size: global,
            micro_batch_size: micro,
            data_parallel_size: dp,
        })
    }

    /// Micro-batches per data-parallel rank per step (gradient accumulation steps).
    pub fn num_micro_batches(&self) -> usize {
        self.global_batch_size / (self.micro_batch_size * self.data_parallel_size)
    }

    /// The sample indices of micro-batch `micro` of `dp_rank` in step `iteration`.
    pub fn micro_batch(
        &self,
        iteration: usize,
        dp_rank: usize,
        micro: usize,
    ) -> std::ops::Range<usize> {
        let start = iteration * self.global_batch_size
            + dp_rank * (self.global_batch_size / self.data_parallel_size)
            + micro * self.micro_batch_size;
        start..start + self.micro_batch_size
    }
}
