//! Generation against `transformers`' `generate(do_sample=False)` on the fixtures (three
//! left-padded prompts of 3, 7 and 5 tokens, 10 new tokens, and again stopping at an EOS
//! token), at TP 1 and TP 2 and through pipeline stages; with the key/value cache and
//! without it; sampling with a seed.

use super::Error;
use super::hf::FIXTURES;
use burn_megatron::launch::{LaunchOptions, RankContext, threads};
use burn_megatron::models::{
    GenerateConfig, Gpt, HfGptConfig, generate, generate_stages, load_hf_gpt, load_hf_gpt_weights,
    read_hf_tensors,
};
use burn_megatron::tensor_parallel::Sampling;
use burn_megatron::topology::{LayerSplit, ParallelConfig, PipelinePosition};
use burn_megatron_tests::fixture;
use burn_megatron_tests::read_safetensors;
use burn_megatron_tests::tp_ranks;

/// Token ids per prompt.
type Tokens = Vec<Vec<u32>>;

/// Rows of a `[n, m]` i64 fixture tensor.
fn rows(
    f: &std::collections::BTreeMap<String, (Vec<usize>, Vec<f64>)>,
    name: &str,
) -> Vec<Vec<u32>> {
    let (shape, v) = &f[name];
    v.chunks(shape[1])
        .map(|r| r.iter().map(|&x| x as u32).collect())
        .collect()
}

#[test]
fn greedy_tokens_equal_transformers_at_tp1_and_tp2_with_and_without_the_cache() {
    for name in FIXTURES {
        let (prompts, greedy, greedy_eos, eos) = expected(name);
        for tp in [1, 2] {
            let out = tp_ranks(tp, |ctx| {
                let (model, _) = load_hf_gpt(&fixture(name), &ctx.groups.tp, &ctx.device)?;
                let config = GenerateConfig::new(10);
                let cached = generate(&model, &prompts, &config)?.tokens;
                let uncached =
                    generate(&model, &prompts, &config.clone().with_use_cache(false))?.tokens;
                let stopped = generate(
                    &model,
                    &prompts,
                    &config.clone().with_eos_token_id(Some(eos)),
                )?
                .tokens;
                Ok::<_, Error>((cached, uncached, stopped))
            })
            .unwrap();
            for (rank, (cached, uncached, stopped)) in out.into_iter().enumerate() {
                let what = format!("{name} tp {tp} rank {rank}");
                assert_eq!(cached, greedy, "{what}: greedy with the cache");
                assert_eq!(uncached, greedy, "{what}: greedy without the cache");
                assert_eq!(stopped, greedy_eos, "{what}: stopping at EOS {eos}");
            }
        }
    }
}

#[test]
fn sampling_is_seeded_the_same_on_every_rank_and_with_or_without_the_cache() {
    let out = tp_ranks(2, |ctx| {
        let (model, _) = load_hf_gpt(&fixture("hf_llama_tiny"), &ctx.groups.tp, &ctx.device)?;
        let prompts = vec![vec![5, 6, 7], vec![9]];
        let sampling = Sampling::Sample {
            temperature: 0.8,
            top_k: Some(20),
            top_p: Some(0.9),
        };
        let config = GenerateConfig::new(12).with_sampling(sampling).with_seed(3);
        let a = generate(&model, &prompts, &config)?.tokens;
        let b = generate(&model, &prompts, &config.clone().with_use_cache(false))?.tokens;
        let c = generate(&model, &prompts, &config.clone().with_seed(4))?.tokens;
        // A prompt that with the new tokens passes the context (64) is refused.
        let long = generate(&model, &[vec![1; 60]], &config)
            .unwrap_err()
            .to_string();
        Ok::<_, Error>((a, b, c, long))
    })
    .unwrap();
    let (a, b, c, long) = &out[0];
    assert_eq!(a, b, "cache or not, the same draws");
    assert_eq!(out[1].0, *a, "both ranks draw the same tokens");
    assert_ne!(a, c, "another seed draws other tokens");
    assert!(
        long.contains("60 tokens") && long.contains("max_position_embeddings 64"),
        "{long}"
    );
}

/// The prompts of a fixture without their left padding, `transformers`' greedy tokens, and
/// the same stopped at its EOS token (ours stop there; `transformers` fills a finished row
/// with the pad id), with that token.
fn expected(name: &str) -> (Tokens, Tokens, Tokens, u32) {
    let f = read_safetensors(&fixture(name).join("generate.safetensors"));
    let mask = rows(&f, "prompt_mask");
    let prompts: Vec<Vec<u32>> = rows(&f, "prompt_ids")
        .into_iter()
        .zip(&mask)
        .map(|(ids, m)| {
            ids.into_iter()
                .zip(m)
                .filter(|(_, m)| **m == 1)
                .map(|(t, _)| t)
                .collect()
        })
        .collect();
    let eos = f["eos_id"].1[0] as u32;
    let greedy_eos: Vec<Vec<u32>> = rows(&f, "greedy_eos")
        .into_iter()
        .map(|r| match r.iter().position(|&t| t == eos) {
            Some(i) => r[..=i].to_vec(),
            None => r,
        })
        .collect();
    (prompts, rows(&f, "greedy"), greedy_eos, eos)
}

/// Each rank's chunks of fixture `name` at the layout `config` (V chunks), loaded from its
/// Hugging Face weights.
fn stages(name: &str, ctx: &RankContext, vp: usize) -> Result<Vec<Gpt>, Error> {
    let hf = HfGptConfig::from_file(&fixture(name).join("config.json"))?;
    let tensors = read_hf_tensors(&fixture(name))?;
    let config = hf.to_gpt_config(ctx.state.tensor_model_parallel_size());
    (0..vp)
        .map(|c| {
            let position = PipelinePosition::of(&ctx.state, c);
            let chunk = config.init_stage(&ctx.groups.tp, position, &ctx.device)?;
            Ok(load_hf_gpt_weights(chunk, &hf, &tensors)?)
        })
        .collect()
}

/// Through pipeline stages, every rank gets `transformers`' greedy tokens: TP 2 × PP 2,
/// interleaved, and uneven splits whose end chunks hold no layer; a seeded sample equals the
/// whole model's.
#[test]
fn greedy_tokens_through_pipeline_stages_equal_transformers() {
    let split = LayerSplit::default();
    let layouts = [
        // (tp, pp, vp, split): 2 layers as 1 + 1; at TP 2; as 0 + 1 | 1 + 0 interleaved
        // with the embedding and the loss counted; as 0 + 1 + 1 with the embedding counted.
        (1, 2, 1, split),
        (2, 2, 1, split),
        (
            1,
            2,
            2,
            split.with_embedding_counted(true).with_loss_counted(true),
        ),
        (1, 3, 1, split.with_embedding_counted(true)),
    ];
    let sampling = Sampling::Sample {
        temperature: 0.8,
        top_k: Some(20),
        top_p: Some(0.9),
    };
    let sampled = GenerateConfig::new(8).with_sampling(sampling).with_seed(3);
    for name in FIXTURES {
        let (prompts, greedy, greedy_eos, eos) = expected(name);
        // The whole model's seeded draws at TP 1 and 2.
        let whole = [1, 2].map(|tp| {
            tp_ranks(tp, |ctx| {
                let (model, _) = load_hf_gpt(&fixture(name), &ctx.groups.tp, &ctx.device)?;
                Ok::<_, Error>(generate(&model, &prompts, &sampled)?.tokens)
            })
            .unwrap()
            .remove(0)
        });
        for (tp, pp, vp, split) in layouts {
            let layout = ParallelConfig::new(tp * pp, tp, pp)
                .with_virtual_pipeline((vp > 1).then_some(vp))
                .with_layer_split(split);
            let out = threads(&layout, LaunchOptions::default(), |ctx| {
                let chunks = stages(name, &ctx, vp)?;
                let pp = &ctx.groups.pp;
                let config = GenerateConfig::new(10);
                let run = |config: &GenerateConfig| generate_stages(&chunks, pp, &prompts, config);
                Ok::<_, Error>((
                    run(&config)?.tokens,
                    run(&config.clone().with_use_cache(false))?.tokens,
                    run(&config.clone().with_eos_token_id(Some(eos)))?.tokens,
                    run(&sampled)?.tokens,
                ))
            })
            .unwrap();
            for (rank, (cached, uncached, stopped, drawn)) in out.into_iter().enumerate() {
                let what = format!("{name} TP {tp} × PP {pp} × VP {vp} {split:?} rank {rank}");
                assert_eq!(cached, greedy, "{what}: greedy with the cache");
                assert_eq!(uncached, greedy, "{what}: greedy without the cache");
                assert_eq!(stopped, greedy_eos, "{what}: stopping at EOS {eos}");
                assert_eq!(
                    drawn,
                    whole[tp - 1],
                    "{what}: the whole model's seeded draws"
                );
            }
        }
    }
    // Chunks built for another pipeline are refused on every rank before any message.
    let out = threads(
        &ParallelConfig::new(2, 1, 2),
        LaunchOptions::default(),
        |ctx| {
            let (model, _) = load_hf_gpt(&fixture("hf_llama_tiny"), &ctx.groups.tp, &ctx.device)?;
            let config = GenerateConfig::new(2);
            let e = generate_stages(&[model], &ctx.groups.pp, &[vec![1, 2]], &config).unwrap_err();
            Ok::<_, Error>(e.to_string())
        },
    )
    .unwrap();
    assert!(
        out[0].contains("holds the head, which only the last stage does"),
        "{}",
        out[0]
    );
    assert!(
        out[1].contains("holds the embedding, which only the first stage does"),
        "{}",
        out[1]
    );
    // One rank wrong: it says why and the other names it. Chunks built under other splits
    // (layers 0..2 and 1..4 of 4) are refused on both.
    let llama = burn_megatron_tests::gpt::llama(4, 16);
    let out = threads(
        &ParallelConfig::new(2, 1, 2),
        LaunchOptions::default(),
        |ctx| {
            let (rank, tp, d) = (
                ctx.state.pipeline_model_parallel_rank(),
                &ctx.groups.tp,
                &ctx.device,
            );
            let at = PipelinePosition::of(&ctx.state, 0);
            let own = llama.init_stage(tp, at, d)?;
            let (whole, other) = match rank {
                1 => {
                    let split = LayerSplit::default().with_first_stage(1);
                    (
                        llama.init(tp, d)?,
                        llama.init_stage(tp, at.with_split(split), d)?,
                    )
                }
                _ => (own.clone(), own),
            };
            let config = GenerateConfig::new(2);
            let run = |chunk: Gpt| {
                generate_stages(&[chunk], &ctx.groups.pp, &[vec![1, 2]], &config)
                    .unwrap_err()
                    .to_string()
            };
            Ok::<_, Error>((run(whole), run(other)))
        },
    )
    .unwrap();
    assert!(
        out[0].0.contains("pipeline ranks [1] refused"),
        "{}",
        out[0].0
    );
    assert!(out[1].0.contains("holds the embedding"), "{}", out[1].0);
    for (rank, (_, e)) in out.iter().enumerate() {
        let want = "virtual stage 1 (chunk 0 of pipeline rank 1) starts at layer 1, not 2";
        assert!(e.contains(want), "rank {rank}: {e}");
    }
}
