//! numpy's legacy `RandomState`, as far as Megatron's dataset indices use it: seeding with
//! an integer and `shuffle` of a 1-D array. Megatron's sample order is whatever this
//! generator draws, so it has to be reproduced bit for bit:
//!
//! - `RandomState(seed)` seeds MT19937 with `init_genrand(seed)` (numpy's `mt19937_seed`),
//!   which is what [`rand_mt::Mt::new`] does;
//! - `shuffle(x)` on a 1-D array is Fisher–Yates from the back: for `i` in `n-1, …, 1`,
//!   `j = random_interval(i)`, swap `x[i]` and `x[j]` (numpy's `_shuffle_raw`);
//! - `random_interval(max)` draws from the smallest all-ones mask covering `max` and
//!   rejects values above it: 32-bit draws while `max` fits in 32 bits, else 64-bit draws
//!   made of two 32-bit outputs, the first one high (numpy's `mt19937_next64`).

use rand_mt::Mt;

/// numpy's `numpy.random.RandomState`, seeded with an integer.
#[derive(Clone)]
pub struct NumpyRandomState {
    mt: Mt,
}

impl std::fmt::Debug for NumpyRandomState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NumpyRandomState")
    }
}

impl NumpyRandomState {
    /// `numpy.random.RandomState(seed)`.
    pub fn new(seed: u32) -> Self {
        Self { mt: Mt::new(seed) }
    }

    /// A uniform integer in `[0, max]` (numpy's `random_interval`).
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mask = u64::MAX >> max.leading_zeros();
        loop {
            let value = if max <= u64::from(u32::MAX) {
                u64::from(self.mt.next_u32()) & mask
            } else {
                self.mt.next_u64() & mask
            };
            if value <= max {
                return value;
            }
        }
    }

    /// `RandomState.shuffle` of a 1-D array, in place.
    pub fn shuffle<T>(&mut self, values: &mut [T]) {
        for i in (1..values.len()).rev() {
            let j = self.random_interval(i as u64) as usize;
            values.swap(i, j);
        }
    }
}
