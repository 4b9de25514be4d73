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
