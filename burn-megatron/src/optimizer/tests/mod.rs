use super::*;
use burn::optim::lr_scheduler::LrScheduler;
use std::f64::consts::PI;

fn config(style: LrDecayStyle) -> OptimizerParamSchedulerConfig {
    OptimizerParamSchedulerConfig {
        init_lr: 0.01,
        max_lr: 0.1,
        min_lr: 0.001,
        lr_warmup_steps: 100,
        lr_decay_steps: 1000,
        lr_decay_style: style,
        wsd_decay_steps: Some(200),
        lr_wsd_decay_style: Some(WsdDecayStyle::Linear),
        start_wd: 0.0,
        end_wd: 0.1,
        wd_incr_steps: 1000,
        wd_incr_style: WdIncrStyle::Linear,
    }
}

fn sched(style: LrDecayStyle) -> OptimizerParamScheduler {
    OptimizerParamScheduler::new(config(style)).unwrap()
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-9, "{a} vs {b}");
}

#[test]
fn warmup_is_linear_from_init_to_max_for_every_style() {
    for style in [
        LrDecayStyle::Constant,
        LrDecayStyle::Linear,
        LrDecayStyle::Cosine,
        LrDecayStyle::InverseSquareRoot,
        LrDecayStyle::Wsd,
    ] {
        let s = sched(style);
        close(s.lr_at(0), 0.01);
        close(s.lr_at(50), 0.055);
        close(s.lr_at(100), 0.1);
    }
}

#[test]
fn decay_styles_inside_and_after_decay() {
    let s = sched(LrDecayStyle::Constant);
    close(s.lr_at(500), 0.1);
    close(s.lr_at(5000), 0.1); // Megatron returns max_lr for constant, even past decay

    let s = sched(LrDecayStyle::Linear);
    close(s.lr_at(500), 0.056);
    close(s.lr_at(550), 0.001 + 0.099 * (1.0 - 450.0 / 900.0));
    close(s.lr_at(1000), 0.001);
    close(s.lr_at(1001), 0.001);

    let s = sched(LrDecayStyle::Cosine);
    close(
        s.lr_at(500),
        0.001 + 0.099 * 0.5 * ((PI * 400.0 / 900.0).cos() + 1.0),
    );
    assert!((s.lr_at(500) - 0.0590961).abs() < 1e-6);
    close(
        s.lr_at(101),
        0.001 + 0.099 * 0.5 * ((PI / 900.0).cos() + 1.0),
    );
    close(s.lr_at(1000), 0.001);
    close(s.lr_at(1200), 0.001);

    let s = sched(LrDecayStyle::InverseSquareRoot);
    close(s.lr_at(400), 0.05);
    close(s.lr_at(1000), 0.1 * 10.0 / 1000f64.sqrt());
    close(s.lr_at(1001), 0.001);
}

#[test]
fn wsd_is_stable_then_anneals_in_each_shape() {
    let shapes = [
        (WsdDecayStyle::Linear, 0.5),
        (WsdDecayStyle::Cosine, 0.5),
        (WsdDecayStyle::Exponential, 2.0 * 0.5f64.sqrt() - 1.0),
        (WsdDecayStyle::MinusSqrt, 1.0 - 0.5f64.sqrt()),
    ];
    for (shape, coeff_at_900) in shapes {
        let mut c = config(LrDecayStyle::Wsd);
        c.lr_wsd_decay_style = Some(shape);
        let s = OptimizerParamScheduler::new(c).unwrap();
        close(s.lr_at(500), 0.1);
        close(s.lr_at(800), 0.1);
        close(s.lr_at(900), 0.001 + 0.099 * coeff_at_900);
        close(s.lr_at(1000), 0.001);
        close(s.lr_at(1001), 0.001);
    }
}

#[test]
fn weight_decay_increments() {
    let s = sched(LrDecayStyle::Linear);
    close(s.wd_at(0), 0.0);
    close(s.wd_at(250), 0.025);
    close(s.wd_at(1000), 0.1);
    close(s.wd_at(1001), 0.1);
    let mut c = config(LrDecayStyle::Linear);
    c.wd_incr_style = WdIncrStyle::Cosine;
    let s = OptimizerParamScheduler::new(c).unwrap();
    close(s.wd_at(250), 0.1 * 0.5 * ((PI * 0.75).cos() + 1.0));
    close(s.wd_at(0), 0.0);
    let mut c = config(LrDecayStyle::Linear);
    (c.start_wd, c.end_wd, c.wd_incr_style) = (0.05, 0.05, WdIncrStyle::Constant);
    close(OptimizerParamScheduler::new(c).unwrap().wd_at(10), 0.05);
}

#[test]
fn param_groups_override_max_min_lr_and_scale_weight_decay() {
    let s = sched(LrDecayStyle::Linear);
    let g = ParamGroupSchedule {
        max_lr: Some(0.2),
        min_lr: Some(0.0),
        wd_mult: Some(0.0),
    };
    close(s.group_lr_at(50, &g), 0.01 + 0.19 * 0.5);
    close(s.group_lr_at(550, &g), 0.2 * 0.5);
    close(s.group_lr_at(2000, &g), 0.0);
    close(s.group_wd_at(500, &g), 0.0);
    close(s.group_wd_at(500, &ParamGroupSchedule::default()), 0.05);
}

#[test]
fn burn_lr_scheduler_steps_and_state_round_trips() {
    let mut s = sched(LrDecayStyle::Cosine);
    close(LrScheduler::step(&mut s), 0.01);
    close(LrScheduler::step(&mut s), s.lr_at(1));
    for _ in 0..48 {
        LrScheduler::step(&mut s);
    }
    let record = s.to_record();
    let mut resumed = sched(LrDecayStyle::Cosine);
    resumed.load_record(record);
    assert_eq!(resumed.num_steps(), 50);
    close(LrScheduler::step(&mut resumed), 0.055);
    let mut m = sched(LrDecayStyle::Linear);
    let (lr, wd) = m.advance(500);
    close(lr, 0.056);
    close(wd, 0.05);
}

#[test]
fn invalid_settings_are_rejected_with_the_numbers() {
    type Edit = fn(&mut OptimizerParamSchedulerConfig);
    let cases: [(Edit, &str); 6] = [
        (|c| c.min_lr = -1.0, "min_lr (-1) must be >= 0"),
        (
            |c| c.max_lr = 0.0001,
            "max_lr (0.0001) must be >= min_lr (0.001)",
        ),
        (|c| c.init_lr = 0.5, "init_lr (0.5) must be <= max_lr (0.1)"),
        (
            |c| c.lr_warmup_steps = 1000,
            "lr_warmup_steps (1000) must be < lr_decay_steps (1000)",
        ),
        (
            |c| c.wsd_decay_steps = None,
            "the WSD style needs wsd_decay_steps",
        ),
        (
            |c| c.end_wd = -0.1,
            "need 0 <= start_wd (0) <= end_wd (-0.1)",
        ),
    ];
    for (edit, msg) in cases {
        let mut c = config(LrDecayStyle::Wsd);
        edit(&mut c);
        let e = OptimizerParamScheduler::new(c).unwrap_err();
        assert!(e.contains(msg), "{e}");
    }
}

mod distributed;
