use clap::Parser;

#[test]
fn distributed_timeout_minutes_sets_the_collective_timeout() {
    let args = |extra: &[&str]| {
        crate::pretrain::Args::try_parse_from(
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
        crate::pretrain::Args::try_parse_from(all).unwrap().train
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
    let s = crate::pretrain::scheduler(&wsd).unwrap();
    assert_eq!(s.lr_at(50), 1.0);
    assert_eq!(s.lr_at(80), 1.0);
    assert!((s.lr_at(90) - 0.5).abs() < 1e-12, "{}", s.lr_at(90));
    assert!(s.lr_at(100).abs() < 1e-12);
    let err = crate::pretrain::scheduler(&train(&["--lr-decay-style", "wsd"])).unwrap_err();
    assert!(err.contains("--lr-wsd-decay-iters"), "{err}");
}
