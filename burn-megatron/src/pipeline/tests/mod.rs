//! Unit tests of the pipeline: schedule arithmetic, p2p channels, the executor on a small
//! layer stack against one rank.

mod executor;
mod p2p;
mod schedule;
