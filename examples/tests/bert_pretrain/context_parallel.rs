//! `bert_pretrain` under context parallelism: each rank holds chunks r and 2·CP−1−r of every
//! sequence, attention is bidirectional over the whole padded sequence, the MLM loss counts
//! the whole sequences' masked tokens and the SOP head CP rank 0's [CLS].

use crate::common::{args, sop, tmp};
use burn_megatron_examples::pretrain::run;

/// CP 2 (`p2p`, `a2a`), CP 4 (`all_gather`), TP 2 × CP 2 with SP, CP 2 × PP 2 (1F1B), CP 2
/// × DP 2 with the distributed optimizer and the overlapped reducer, and CP 2 `p2p` with
/// selective recomputation train as the unsplit run does (dropout off): every iteration's
/// MLM and SOP losses and grad norm within 1e-5 relative of CP 1. A checkpoint saved at
/// CP 2 × DP 2 resumes at CP 1; bad CP flags are refused naming the numbers.
#[test]
fn context_parallel_training_matches_the_unsplit_run() {
    let dir = tmp("bert-cp");
    let base = [
        "--num-layers",
        "2",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--train-iters",
        "8",
        "--eval-interval",
        "0",
        "--tensor-model-parallel-size",
        "1",
        "--world-size",
        "1",
    ];
    let run = |extra: &[&str]| run(&args(&[&base[..], extra].concat(), &dir)).map(|s| s.log);
    let one = run(&[]).unwrap();
    let cp2 = ["--world-size", "2", "--context-parallel-size", "2"];
    let cp2_dp2 = ["--world-size", "4", "--context-parallel-size", "2"];
    let layouts: [&[&str]; 7] = [
        &[&cp2[..], &["--cp-comm-type", "p2p"]].concat(),
        &[&cp2[..], &["--cp-comm-type", "a2a"]].concat(),
        &["--world-size", "4", "--context-parallel-size", "4"],
        &[
            "--world-size",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--context-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        &[&cp2_dp2[..], &["--pipeline-model-parallel-size", "2"]].concat(),
        &[
            &cp2_dp2[..],
            &["--use-distributed-optimizer", "--overlap-grad-reduce"],
        ]
        .concat(),
        &[
            &cp2[..],
            &[
                "--recompute-granularity",
                "selective",
                "--cp-comm-type",
                "p2p",
            ],
        ]
        .concat(),
    ];
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * y.abs().max(1.0);
    for layout in layouts {
        let log = run(layout).unwrap();
        assert_eq!(log.len(), one.len(), "{layout:?}");
        for (a, b) in log.iter().zip(&one) {
            let at = format!("{layout:?} iteration {}", a.iteration);
            assert!(
                close(a.lm_loss, b.lm_loss),
                "{at}: lm {} vs {}",
                a.lm_loss,
                b.lm_loss
            );
            assert!(close(sop(a), sop(b)), "{at}: sop {} vs {}", sop(a), sop(b));
            let (ga, gb) = (a.grad_norm.unwrap(), b.grad_norm.unwrap());
            assert!(close(ga, gb), "{at}: grad norm {ga} vs {gb}");
        }
    }
    // Saved at CP 2 × DP 2 with the distributed optimizer, resumed at CP 1 × DP 1.
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let saving = [
        "--use-distributed-optimizer",
        "--save",
        s,
        "--save-interval",
        "4",
    ];
    run(&[&cp2_dp2[..], &saving[..]].concat()).unwrap();
    let resumed = run(&["--load", s, "--ckpt-step", "4"]).unwrap();
    assert_eq!(resumed.first().unwrap().iteration, 5);
    for (a, b) in resumed.iter().zip(&one[4..]) {
        let at = format!("resumed iteration {}", a.iteration);
        assert!(
            close(a.lm_loss, b.lm_loss),
            "{at}: {} vs {}",
            a.lm_loss,
            b.lm_loss
        );
    }
    let refused = |extra: &[&str]| run(extra).unwrap_err();
    let e = refused(&[&cp2[..], &["--seq-length", "30"]].concat());
    assert!(e.contains("--seq-length (30)") && e.contains("(4)"), "{e}");
    let e = refused(&[
        "--world-size",
        "4",
        "--context-parallel-size",
        "4",
        "--cp-comm-type",
        "a2a",
    ]);
    assert!(
        e.contains("--num-attention-heads (2)") && e.contains("--context-parallel-size (4)"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
