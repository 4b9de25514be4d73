//! The examples crate's own pieces, tested here rather than in a unit-test binary of their
//! own (each test binary links Burn): the allocator's settings, memory accounting, the
//! pretraining flags and device selection.

use burn_megatron_examples::memory::Counter;
use burn_megatron_examples::pretrain::TrainDevice;
use clap::Parser;

/// The option changed is the purge delay: mimalloc reports it off after the first
/// allocation (which any test has made by now).
#[test]
fn purging_is_off() {
    drop(vec![0u8; 1 << 20]);
    assert_eq!(burn_megatron_examples::alloc::purge_delay(), -1);
}

#[test]
fn a_block_counts_against_its_owner_wherever_it_is_freed() {
    let (counter, block) = std::thread::spawn(|| {
        let counter = Counter::claim();
        let block = vec![7u8; 1 << 20];
        assert_eq!(counter.live(), 1 << 20);
        (counter, block)
    })
    .join()
    .unwrap();
    // Freed on this thread, which took no counter: off the owner's count.
    drop(block);
    assert_eq!(counter.live(), 0);
    assert_eq!(counter.peak(), 1 << 20);
    counter.reset_peak();
    assert_eq!(counter.peak(), 0);
}

/// Without the feature (or the driver) a GPU device is a clear error naming the flag.
#[test]
fn an_unavailable_device_is_an_error_naming_the_flag() {
    assert!(TrainDevice::Cpu.resolve().is_ok());
    if let Err(e) = TrainDevice::Cuda.resolve() {
        assert!(e.starts_with("--device cuda:"), "{e}");
    }
    if let Err(e) = TrainDevice::Wgpu.resolve() {
        assert!(e.starts_with("--device wgpu:"), "{e}");
    }
}

#[test]
fn distributed_timeout_minutes_sets_the_collective_timeout() {
    let args = |extra: &[&str]| {
        burn_megatron_examples::pretrain::Args::try_parse_from(
            std::iter::once("pretrain").chain(extra.iter().copied()),
        )
        .unwrap()
        .train
    };
    assert_eq!(
        args(&[]).distributed_timeout(),
        burn_megatron::comm::DEFAULT_TIMEOUT
    );
    let long = args(&["--distributed-timeout-minutes", "30"]);
    assert_eq!(long.distributed_timeout().as_secs(), 1800);
    assert!(long.validate().is_ok());
    let huge = args(&["--distributed-timeout-minutes", &u64::MAX.to_string()]);
    assert_eq!(huge.distributed_timeout().as_secs(), u64::MAX);
    let err = args(&["--distributed-timeout-minutes", "0"])
        .validate()
        .unwrap_err();
    assert!(err.contains("--distributed-timeout-minutes"), "{err}");
}

/// `--lr-decay-style WSD` holds `--lr` until the last `--lr-wsd-decay-iters`, then anneals
/// to `--min-lr` (Megatron's formula, linear here: halfway at the middle of the phase);
/// without the decay iterations it is refused, naming the flag.
#[test]
fn the_wsd_schedule_is_reachable_from_the_flags() {
    let train = |extra: &[&str]| {
        let flags = [
            "pretrain",
            "--train-iters",
            "100",
            "--lr",
            "1.0",
            "--min-lr",
            "0.0",
        ];
        let all = flags.iter().chain(extra).copied();
        burn_megatron_examples::pretrain::Args::try_parse_from(all)
            .unwrap()
            .train
    };
    let wsd = train(&[
        "--lr-decay-style",
        "WSD",
        "--lr-wsd-decay-iters",
        "20",
        "--lr-wsd-decay-style",
        "linear",
        "--lr-warmup-fraction",
        "0",
    ]);
    let s = burn_megatron_examples::pretrain::scheduler(&wsd).unwrap();
    assert_eq!(s.lr_at(50), 1.0);
    assert_eq!(s.lr_at(80), 1.0);
    assert!((s.lr_at(90) - 0.5).abs() < 1e-12, "{}", s.lr_at(90));
    assert!(s.lr_at(100).abs() < 1e-12);
    let err = burn_megatron_examples::pretrain::scheduler(&train(&["--lr-decay-style", "wsd"]))
        .unwrap_err();
    assert!(err.contains("--lr-wsd-decay-iters"), "{err}");
}
