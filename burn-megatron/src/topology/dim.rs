//! Parallel dimensions, their tokens, and per-rank coordinates.

use std::fmt;

use super::TopologyError;

/// One axis of the rank grid.
///
/// Each dimension has a short token (`"tp"`, `"cp"`, `"ep"`, `"dp"`, `"pp"`) used in
/// order strings such as `"tp-cp-ep-dp-pp"` and in group requests such as `"tp-dp"`.
///
/// ```
/// use burn_megatron::topology::ParallelDim;
///
/// assert_eq!(ParallelDim::from_token("dp"), Some(ParallelDim::Data));
/// assert_eq!(ParallelDim::Pipeline.token(), "pp");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ParallelDim {
    /// Tensor model parallelism (`tp`).
    Tensor,
    /// Context parallelism (`cp`).
    Context,
    /// Expert model parallelism (`ep`).
    Expert,
    /// Data parallelism (`dp`).
    Data,
    /// Pipeline model parallelism (`pp`).
    Pipeline,
}

impl ParallelDim {
    /// All dimensions, in the default order `tp-cp-ep-dp-pp`.
    pub const ALL: [ParallelDim; 5] = [
        ParallelDim::Tensor,
        ParallelDim::Context,
        ParallelDim::Expert,
        ParallelDim::Data,
        ParallelDim::Pipeline,
    ];

    /// The short token of this dimension, e.g. `"tp"`.
    pub fn token(self) -> &'static str {
        match self {
            ParallelDim::Tensor => "tp",
            ParallelDim::Context => "cp",
            ParallelDim::Expert => "ep",
            ParallelDim::Data => "dp",
            ParallelDim::Pipeline => "pp",
        }
    }

    /// Parses a short token (case-insensitive); `None` if it is not one of the five.
    pub fn from_token(token: &str) -> Option<ParallelDim> {
        ParallelDim::ALL
            .into_iter()
            .find(|dim| dim.token().eq_ignore_ascii_case(token))
    }

    /// Position of this dimension in [`ParallelDim::ALL`], used to index arrays.
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for ParallelDim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.token())
    }
}

/// Parses a `-`-joined token string such as `"tp-dp"` into dimensions, in the order written.
///
/// Unknown (including empty) tokens and repeated tokens are errors.
pub(crate) fn parse_tokens(input: &str) -> Result<Vec<ParallelDim>, TopologyError> {
    let mut dims = Vec::new();
    for token in input.split('-') {
        let dim = ParallelDim::from_token(token).ok_or_else(|| TopologyError::UnknownToken {
            token: token.to_string(),
            input: input.to_string(),
        })?;
        if dims.contains(&dim) {
            return Err(TopologyError::DuplicateToken {
                token: dim.token().to_string(),
                input: input.to_string(),
            });
        }
        dims.push(dim);
    }
    Ok(dims)
}

/// Where one global rank sits on each axis of the rank grid.
///
/// ```
/// use burn_megatron::topology::{ParallelDim, RankCoords};
///
/// let coords = RankCoords { tp: 1, pp: 1, ..RankCoords::default() };
/// assert_eq!(coords.get(ParallelDim::Pipeline), 1);
/// assert_eq!(coords.get(ParallelDim::Data), 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RankCoords {
    /// Index along the tensor model parallel axis.
    pub tp: usize,
    /// Index along the context parallel axis.
    pub cp: usize,
    /// Index along the expert model parallel axis.
    pub ep: usize,
    /// Index along the data parallel axis.
    pub dp: usize,
    /// Index along the pipeline model parallel axis.
    pub pp: usize,
}

impl RankCoords {
    /// The index along `dim`.
    pub fn get(&self, dim: ParallelDim) -> usize {
        match dim {
            ParallelDim::Tensor => self.tp,
            ParallelDim::Context => self.cp,
            ParallelDim::Expert => self.ep,
            ParallelDim::Data => self.dp,
            ParallelDim::Pipeline => self.pp,
        }
    }

    /// Sets the index along `dim`.
    pub fn set(&mut self, dim: ParallelDim, index: usize) {
        match dim {
            ParallelDim::Tensor => self.tp = index,
            ParallelDim::Context => self.cp = index,
            ParallelDim::Expert => self.ep = index,
            ParallelDim::Data => self.dp = index,
            ParallelDim::Pipeline => self.pp = index,
        }
    }
}
