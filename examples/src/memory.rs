//! Bytes held per rank, counted by the examples' allocator (see `alloc.rs`): the CPU's
//! measured memory, which `memory_bench`, `bert_pretrain` and `gpt_pretrain` report and
//! `plan` is checked against.
//!
//! A training thread tags itself with its rank ([`set_rank`]); every block it allocates is
//! counted against that rank until it is freed, on whichever thread. Threads nobody tagged
//! (Burn's worker pool, the reducers' and communicators' workers) count as untagged
//! ([`UNTAGGED`]); their blocks are short-lived scratch, except a reducer's buckets.

use std::cell::Cell;
use std::sync::atomic::{AtomicI64, Ordering};

/// Ranks that get a count of their own; higher ranks share the last one.
const TAGS: usize = 257;

/// The pseudo-rank of untagged threads.
pub const UNTAGGED: Option<usize> = None;

thread_local! {
    /// This thread's tag: 0 untagged, else rank + 1.
    pub(crate) static TAG: Cell<usize> = const { Cell::new(0) };
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicI64 = AtomicI64::new(0);
static LIVE: [AtomicI64; TAGS] = [ZERO; TAGS];
static PEAK: [AtomicI64; TAGS] = [ZERO; TAGS];

/// Counts `bytes` (negative: freed) against `tag`. Called by the allocator: allocates
/// nothing.
#[inline]
pub(crate) fn account(tag: usize, bytes: i64) {
    let tag = tag.min(TAGS - 1);
    let live = LIVE[tag].fetch_add(bytes, Ordering::Relaxed) + bytes;
    if bytes > 0 {
        PEAK[tag].fetch_max(live, Ordering::Relaxed);
    }
}

fn tag(rank: Option<usize>) -> usize {
    rank.map_or(0, |r| (r + 1).min(TAGS - 1))
}

/// Counts what this thread allocates from now on against `rank`.
pub fn set_rank(rank: usize) {
    TAG.with(|t| t.set(tag(Some(rank))));
}

/// Bytes `rank` holds now (`None`: untagged threads).
pub fn live_bytes(rank: Option<usize>) -> i64 {
    LIVE[tag(rank)].load(Ordering::Relaxed)
}

/// The most bytes `rank` held at once since the last [`reset_peak`].
pub fn peak_bytes(rank: Option<usize>) -> i64 {
    PEAK[tag(rank)].load(Ordering::Relaxed)
}

/// Starts a new peak from what `rank` holds now.
pub fn reset_peak(rank: Option<usize>) {
    let t = tag(rank);
    PEAK[t].store(LIVE[t].load(Ordering::Relaxed), Ordering::Relaxed);
}

/// `bytes` as MiB with two decimals.
pub fn mib(bytes: i64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// One rank's memory over a training run, told apart by when it was counted: the weights
/// (held after the model is built), the optimizer's state (what stays after the steps,
/// master weights included), the gradients (held when backward and the reduction are done),
/// and the step's peak above what the rank held before it (activations and the gradients
/// as they accumulate).
#[derive(Debug, Clone, Default)]
pub struct RankMemory {
    rank: usize,
    start: i64,
    weights: i64,
    before_step: i64,
    gradients: i64,
    step_peak: i64,
    peak: i64,
}

impl RankMemory {
    /// Tags this thread with `rank` and starts counting.
    pub fn start(rank: usize) -> Self {
        set_rank(rank);
        Self {
            rank,
            start: live_bytes(Some(rank)),
            ..Self::default()
        }
    }

    fn live(&self) -> i64 {
        live_bytes(Some(self.rank)) - self.start
    }

    /// The model is built.
    pub fn weights_built(&mut self) {
        self.weights = self.live();
    }

    /// A step starts.
    pub fn step_starts(&mut self) {
        reset_peak(Some(self.rank));
        self.before_step = self.live();
    }

    /// Backward and the gradient reduction are done.
    pub fn gradients_ready(&mut self) {
        self.gradients = self.gradients.max(self.live() - self.before_step);
    }

    /// The step is done.
    pub fn step_done(&mut self) {
        self.step_peak = self
            .step_peak
            .max(peak_bytes(Some(self.rank)) - self.start - self.before_step);
        self.peak = self.peak.max(peak_bytes(Some(self.rank)) - self.start);
    }

    /// The report line, after the last step.
    pub fn report(&self) -> String {
        let optimizer = (self.live() - self.weights).max(0);
        format!(
            " memory of rank {}: weights {} | optimizer state {} | gradients {} | step peak above them {} (activations and gradients) | peak {}",
            self.rank,
            mib(self.weights),
            mib(optimizer),
            mib(self.gradients),
            mib(self.step_peak),
            mib(self.peak)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_counts_against_its_owner_wherever_it_is_freed() {
        let rank = Some(200);
        std::thread::scope(|s| {
            let block = s
                .spawn(|| {
                    set_rank(200);
                    reset_peak(rank);
                    let before = live_bytes(rank);
                    let block = vec![7u8; 1 << 20];
                    assert_eq!(live_bytes(rank) - before, 1 << 20);
                    (block, before)
                })
                .join()
                .unwrap();
            let (block, before) = block;
            // Grown on another (untagged) thread: the header moves with it.
            let mut block = block;
            block.reserve_exact(1 << 20);
            let grown = live_bytes(rank) + live_bytes(UNTAGGED);
            drop(block);
            assert!(peak_bytes(rank) - before >= 1 << 20);
            assert_eq!(live_bytes(rank), before);
            assert!(grown > 0);
        });
    }
}
