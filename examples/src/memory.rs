//! Bytes held per rank, counted by the examples' allocator (see `alloc.rs`): the CPU's
//! measured memory, which `memory_bench`, `bert_pretrain` and `gpt_pretrain` report and
//! `plan` is checked against.
//!
//! A training thread takes a counter of its own ([`Counter::claim`]); every block it
//! allocates is counted there until it is freed, on whichever thread. Threads that took no
//! counter (Burn's worker pool, the reducers' and communicators' workers) share the
//! untagged one; their blocks are short-lived scratch, except a reducer's buckets. Counters
//! are handed out in turn, so that two runs in one process (tests) count apart.

use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

/// Counters: 0 is the untagged threads', the others are handed out in turn (wrapping).
const TAGS: usize = 1024;

thread_local! {
    /// This thread's counter (0: untagged).
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
    let tag = tag % TAGS;
    let live = LIVE[tag].fetch_add(bytes, Ordering::Relaxed) + bytes;
    if bytes > 0 {
        PEAK[tag].fetch_max(live, Ordering::Relaxed);
    }
}

static NEXT: AtomicUsize = AtomicUsize::new(1);

/// One thread's count of the bytes it holds (with what it allocated and freed elsewhere).
#[derive(Debug, Clone, Copy)]
pub struct Counter(usize);

impl Counter {
    /// A fresh counter, from now on this thread's.
    pub fn claim() -> Self {
        let tag = loop {
            let t = NEXT.fetch_add(1, Ordering::Relaxed) % TAGS;
            if t != 0 {
                break t;
            }
        };
        LIVE[tag].store(0, Ordering::Relaxed);
        PEAK[tag].store(0, Ordering::Relaxed);
        TAG.with(|t| t.set(tag));
        Self(tag)
    }

    /// Bytes held now.
    pub fn live(self) -> i64 {
        LIVE[self.0].load(Ordering::Relaxed)
    }

    /// The most bytes held at once since the last [`reset_peak`](Self::reset_peak).
    pub fn peak(self) -> i64 {
        PEAK[self.0].load(Ordering::Relaxed)
    }

    /// Starts a new peak from what is held now.
    pub fn reset_peak(self) {
        PEAK[self.0].store(self.live(), Ordering::Relaxed);
    }
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
///
/// On a Cube device (CUDA, wgpu) the counts are CubeCL's pools' bytes in use instead (the
/// device's memory, which the host allocator never sees), read at the same points; the step
/// peak is then the largest of those readings (after backward, after the optimizer step), and
/// the report adds what the pools reserved, an upper bound on the true peak.
#[derive(Debug, Clone)]
pub struct RankMemory {
    rank: usize,
    counter: Counter,
    /// The Cube device whose pools are read, if the rank runs on one.
    device: Option<burn::tensor::Device>,
    reserved: u64,
    start: i64,
    weights: i64,
    before_step: i64,
    gradients: i64,
    step_peak: i64,
    peak: i64,
}

impl RankMemory {
    /// Counts what this thread (rank `rank`) allocates from now on.
    pub fn start(rank: usize) -> Self {
        let counter = Counter::claim();
        Self {
            rank,
            counter,
            device: None,
            reserved: 0,
            start: counter.live(),
            weights: 0,
            before_step: 0,
            gradients: 0,
            step_peak: 0,
            peak: 0,
        }
    }

    /// Counts rank `rank`'s memory on `device`: its CubeCL pools' when it is a Cube device,
    /// else what this thread allocates on the host (as [`start`](Self::start)).
    pub fn start_on(rank: usize, device: &burn::tensor::Device) -> Self {
        let mut memory = Self::start(rank);
        if burn_megatron_kernels::device::pool_memory(device).is_some() {
            memory.device = Some(device.clone());
            memory.start = memory.read();
        }
        memory
    }

    /// The bytes held now: the pools' in use on a Cube device, else this thread's count.
    fn read(&mut self) -> i64 {
        let pools = self
            .device
            .as_ref()
            .and_then(burn_megatron_kernels::device::pool_memory);
        match pools {
            Some(p) => {
                self.reserved = self.reserved.max(p.reserved);
                p.in_use as i64
            }
            None => self.counter.live(),
        }
    }

    fn live(&mut self) -> i64 {
        self.read() - self.start
    }

    /// The highest count of the run.
    pub fn peak(&self) -> i64 {
        self.peak
    }

    /// The model is built.
    pub fn weights_built(&mut self) {
        if self.device.is_some() {
            let live = self.live();
            self.weights = live;
            self.peak = self.peak.max(live);
            return;
        }
        self.weights = self.live();
    }

    /// A step starts.
    pub fn step_starts(&mut self) {
        self.counter.reset_peak();
        self.before_step = self.live();
    }

    /// Backward and the gradient reduction are done.
    pub fn gradients_ready(&mut self) {
        let live = self.live();
        self.gradients = self.gradients.max(live - self.before_step);
        if self.device.is_some() {
            self.sampled_peak(live);
        }
    }

    fn sampled_peak(&mut self, live: i64) {
        self.step_peak = self.step_peak.max(live - self.before_step);
        self.peak = self.peak.max(live);
    }

    /// The step is done.
    pub fn step_done(&mut self) {
        if self.device.is_some() {
            let live = self.live();
            self.sampled_peak(live);
            return;
        }
        let peak = self.counter.peak() - self.start;
        self.step_peak = self.step_peak.max(peak - self.before_step);
        self.peak = self.peak.max(peak);
    }

    /// An evaluation is done: what it held counts in the run's peak (a forward-only pass that
    /// kept its graph shows here). A checkpoint's save, after it, does not.
    pub fn evaluated(&mut self) {
        let held = match self.device {
            Some(_) => self.live(),
            None => self.counter.peak() - self.start,
        };
        self.peak = self.peak.max(held);
    }

    /// The report line, after the last step: what is still held counts in the peak too.
    pub fn report(&mut self) -> String {
        let live = self.live();
        self.peak = self.peak.max(live);
        let optimizer = (live - self.weights).max(0);
        let (whose, reserved) = match &self.device {
            Some(device) => (
                format!(" on {device:?} (CubeCL's pools, bytes in use)"),
                format!(" | reserved by the pools {}", mib(self.reserved as i64)),
            ),
            None => (String::new(), String::new()),
        };
        format!(
            " memory of rank {}{whose}: weights {} | optimizer state {} | gradients {} | step peak above them {} (activations and gradients) | peak {}{reserved}",
            self.rank,
            mib(self.weights),
            mib(optimizer),
            mib(self.gradients),
            mib(self.step_peak),
            mib(self.peak)
        )
    }
}
