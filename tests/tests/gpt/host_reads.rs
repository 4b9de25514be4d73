//! The host reads of a GPT training step, each a device synchronisation on a GPU, counted by
//! `burn_megatron_kernels::device::thread_host_reads`: which ones a step makes, so that a new
//! one shows up here before it shows up in a GPU profile.
//!
//! Megatron's own are one per step: the gradients' sum of squares, which is the grad norm and
//! the inf/NaN check at once. The executor reads no loss (the losses stay on the device until
//! the caller reads them, all micro-batches in one read, as Megatron does at its log
//! interval). The token ids' range check reads once per micro-batch unless the model is told
//! the loader checked them on the host (`IdCheck::Clamp`).

use super::Error;
use burn::optim::AdamWConfig;
use burn::tensor::DType;
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{Gpt, GptStageOutput};
use burn_megatron::optimizer::{MegatronOptimizer, NormType};
use burn_megatron::pipeline::{
    ChunkOutput, ForwardBackwardConfig, ForwardStep, P2pShapes, PipelineSchedule,
    forward_backward_func, read_losses,
};
use burn_megatron::tensor_parallel::IdCheck;
use burn_megatron::topology::ParallelConfig;
use burn_megatron_kernels::device::thread_host_reads;
use burn_megatron_tests::gpt::{gpt_rows, llama};

const SEQ: usize = 8;
const MICRO_BATCHES: usize = 3;

/// `(reads in forward and backward, in the optimizer step, in reading the losses)` of the
/// second of two steps (the first may read more while things are set up), at one rank.
fn step_reads(check: IdCheck) -> (u64, u64, u64) {
    let layout = ParallelConfig::new(1, 1, 1);
    let out = threads(&layout, LaunchOptions::default(), |ctx| {
        let device = &ctx.device;
        let mut model = llama(2, SEQ)
            .init(&ctx.groups.tp, device)?
            .with_id_check(check);
        let mut optim =
            MegatronOptimizer::new(AdamWConfig::new().init(), &model, ctx.groups.mp.clone(), 0)
                .with_clip_grad(1.0, NormType::L2);
        let p2p = ctx.p2p(P2pShapes::Fixed {
            dims: vec![SEQ, 1, 32],
            dtype: DType::F32,
        });
        let mut reads = (0, 0, 0);
        for _ in 0..2 {
            let start = thread_host_reads();
            let fb = ForwardBackwardConfig::new(PipelineSchedule::new(1, MICRO_BATCHES));
            let out = forward_backward_func(
                |s: ForwardStep<'_, Gpt, 3>| -> Result<ChunkOutput<3>, Error> {
                    let b = gpt_rows(s.microbatch, 1, SEQ, device);
                    let ids = s.input.is_none().then_some(b.ids);
                    Ok(match s.model.forward_stage(ids, s.input, None)? {
                        GptStageOutput::Hidden(h) => ChunkOutput::Activation(h),
                        GptStageOutput::Logits(logits) => ChunkOutput::Loss {
                            loss: s.model.loss(logits, b.labels, b.mask)?,
                            report: Vec::new(),
                        },
                    })
                },
                std::slice::from_ref(&model),
                &p2p,
                fb,
            )?;
            let backward_done = thread_host_reads();
            let losses = read_losses(&out.losses);
            let read = thread_host_reads();
            assert_eq!(losses.len(), MICRO_BATCHES);
            assert!(losses.iter().all(|l| l.loss.is_finite() && l.loss > 0.0));
            model = optim.step(1e-3, model, out.grads)?.0;
            reads = (
                backward_done - start,
                thread_host_reads() - read,
                read - backward_done,
            );
        }
        Ok::<_, Error>(reads)
    });
    out.unwrap()[0]
}

#[test]
fn a_gpt_step_reads_the_host_only_where_listed() {
    for (check, per_microbatch) in [(IdCheck::Clamp, 0), (IdCheck::Refuse, 1)] {
        let (forward_backward, optimizer, losses) = step_reads(check);
        println!(
            "{check:?}: host reads: {forward_backward} in forward and backward, {optimizer} in \
             the optimizer step, {losses} for every micro-batch's loss"
        );
        // Refusing bad ids reads their extremes; clamping reads nothing.
        assert_eq!(
            forward_backward,
            per_microbatch * MICRO_BATCHES as u64,
            "{check:?}"
        );
        // The sum of squares of the gradients (norm and inf/NaN check).
        assert_eq!(optimizer, 1, "{check:?}");
        // All micro-batches' losses at once.
        assert_eq!(losses, 1, "{check:?}");
    }
}

/// `(reads in forward, backward and the gradients' reduction, in the optimizer step)` of the
/// second of two steps of one rank of DP 2 (ranks as threads, so collectives go through host
/// memory), the reduction overlapped with backward or after it.
fn data_parallel_step_reads(overlap: bool, distributed: bool) -> (u64, u64) {
    use burn_megatron::optimizer::InnerOptimizer;
    use burn_megatron::topology::PipelinePosition;
    use burn_megatron::training::ParallelTrainingConfig;
    use burn_megatron_tests::gpt::causal_lm_step;
    use std::sync::Arc;
    let layout = ParallelConfig::new(2, 1, 1);
    let out = threads(&layout, LaunchOptions::default(), |ctx| {
        let device = &ctx.device;
        let position = PipelinePosition::of(&ctx.state, 0);
        let model = llama(2, SEQ)
            .init_stage(&ctx.groups.tp, position, device)?
            .with_id_check(IdCheck::Clamp);
        let mut chunks = vec![model];
        let training = ParallelTrainingConfig::new()
            .with_overlap_grad_reduce(overlap)
            .with_use_distributed_optimizer(distributed)
            .init(&ctx, &chunks, Arc::new(|p: &str| p.to_string()))?;
        let mut optim = training
            .optimizer(InnerOptimizer::from(AdamWConfig::new().init()), &chunks)?
            .with_clip_grad(1.0, NormType::L2);
        let p2p = ctx.p2p(P2pShapes::Fixed {
            dims: vec![SEQ, 1, 32],
            dtype: DType::F32,
        });
        let hooks = training.grad_sync();
        let first = ctx.state.data_parallel_rank() * MICRO_BATCHES;
        let mut reads = (0, 0);
        for _ in 0..2 {
            let start = thread_host_reads();
            let mut fb = ForwardBackwardConfig::new(PipelineSchedule::new(1, MICRO_BATCHES));
            fb.grad_sync = hooks.as_deref();
            let out = forward_backward_func(
                |s: ForwardStep<'_, Gpt, 3>| causal_lm_step(s, first, SEQ, device),
                &chunks,
                &p2p,
                fb,
            )?;
            let mut grads = out.grads;
            training.finalize(&chunks, &mut grads)?;
            let reduced = thread_host_reads();
            chunks = optim.step(1e-3, chunks, grads)?.0;
            reads = (reduced - start, thread_host_reads() - reduced);
        }
        Ok::<_, Error>(reads)
    });
    out.unwrap()[0]
}

/// The overlapped reduction reads nothing on the rank's thread: the hooks hand over device
/// tensors and its worker reads the buckets (on NCCL, nothing is read at all). Reduced after
/// backward on a host communicator, each bucket is one read on the rank's thread.
#[test]
fn the_overlapped_reduction_reads_nothing_on_the_rank_thread() {
    for distributed in [false, true] {
        let (overlapped, optimizer) = data_parallel_step_reads(true, distributed);
        let (after, _) = data_parallel_step_reads(false, distributed);
        println!(
            "DP 2, distributed optimizer {distributed}: host reads on the rank's thread in \
             forward, backward and reduction: {overlapped} overlapped, {after} after backward; \
             {optimizer} in the optimizer step"
        );
        assert_eq!(overlapped, 0, "distributed {distributed}");
        assert!(
            after > 0,
            "distributed {distributed}: the bucket reads are counted"
        );
        assert!(optimizer >= 1, "the sum of squares at least");
    }
}
