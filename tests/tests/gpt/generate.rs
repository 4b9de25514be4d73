//! Generation against `transformers`' `generate(do_sample=False)` on the fixtures (three
//! left-padded prompts of 3, 7 and 5 tokens, 10 new tokens, and again stopping at an EOS
//! token), at TP 1 and TP 2; with the key/value cache and without it; sampling with a seed.

use super::Error;
use super::hf::{FIXTURES, fixture};
use burn_megatron::models::{GenerateConfig, generate, load_hf_gpt};
use burn_megatron::tensor_parallel::Sampling;
use burn_megatron_tests::read_safetensors;
use burn_megatron_tests::tp_ranks;

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
        let f = read_safetensors(&fixture(name).join("generate.safetensors"));
        let mask = rows(&f, "prompt_mask");
        // The prompts without their left padding.
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
        let greedy = rows(&f, "greedy");
        let eos = f["eos_id"].1[0] as u32;
        // transformers fills a finished row with the pad id; ours stop at the EOS token.
        let greedy_eos: Vec<Vec<u32>> = rows(&f, "greedy_eos")
            .into_iter()
            .map(|r| match r.iter().position(|&t| t == eos) {
                Some(i) => r[..=i].to_vec(),
                None => r,
            })
            .collect();
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
