//! How a BERT parameter's HF matrix is cut into this rank's shard.

use super::super::hf_host::Host;
use super::entries::Split;

pub(super) fn shard(full: &Host, split: Split, rank: usize, size: usize) -> Host {
    match split {
        Split::Dup => full.clone(),
        Split::Out | Split::Vocab | Split::Qkv => {
            let n = full.rows / size;
            full.rows(rank * n..(rank + 1) * n)
        }
        Split::In => {
            let n = full.cols / size;
            full.cols(rank * n..(rank + 1) * n)
        }
    }
}
