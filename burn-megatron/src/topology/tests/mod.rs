//! Unit tests for the topology module, with exact expected group lists.

mod config;
mod generator;
mod invariants;
mod layout;
mod split;
mod state;

use super::{DEFAULT_ORDER, RankGenerator};

/// A generator with the default order; panics on invalid sizes.
fn generator(tp: usize, ep: usize, dp: usize, pp: usize, cp: usize) -> RankGenerator {
    RankGenerator::new(tp, ep, dp, pp, cp, DEFAULT_ORDER).unwrap()
}

/// `generator.get_ranks(token)`, panicking on error.
fn ranks(generator: &RankGenerator, token: &str) -> Vec<Vec<usize>> {
    generator.get_ranks(token).unwrap()
}
