//! Configurations and inputs a GPT cannot take are errors naming the values, before any
//! weight is drawn or any work is done.

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::models::{
    AttnMaskType, GptConfig, LayerNormPosition, PositionEmbeddingType, RopeScaling,
};
use burn_megatron::tensor_parallel::IdCheck;
use burn_megatron_tests::gpt::{gpt2, llama};
use burn_megatron_tests::tp_ranks;

fn refused_at(config: &GptConfig, tp: usize) -> String {
    let out = tp_ranks(tp, |ctx| {
        Ok::<_, String>(
            config
                .init(&ctx.groups.tp, &ctx.device)
                .err()
                .map(|e| e.to_string()),
        )
    })
    .unwrap();
    out[0].clone().expect("the configuration must be refused")
}

#[test]
fn head_group_and_tp_arithmetic_is_refused_naming_both_numbers() {
    // 2 query groups over 4 ranks.
    let e = refused_at(&llama(2, 8), 4);
    assert!(
        e.contains("query groups (2)") && e.contains("tensor-parallel size (4)"),
        "{e}"
    );
    // 4 heads in 3 groups.
    let mut three_groups = llama(2, 8);
    three_groups.transformer.attention.num_query_groups = Some(3);
    let e = refused_at(&three_groups, 1);
    assert!(
        e.contains("attention heads (4)") && e.contains("query groups (3)"),
        "{e}"
    );
    // 6 heads over 4 ranks.
    let mut six_heads = gpt2(2, 8);
    let t = &mut six_heads.transformer;
    (t.attention.num_attention_heads, t.hidden_size) = (6, 36);
    let e = refused_at(&six_heads, 4);
    assert!(
        e.contains("attention heads (6)") && e.contains("tensor-parallel size (4)"),
        "{e}"
    );
    // A vocabulary larger than its padding, a rotary head of odd width, a bad scaling.
    let e = refused_at(&llama(2, 8).with_vocab_size(Some(65)), 1);
    assert!(e.contains("65") && e.contains("64"), "{e}");
    let mut odd_head = llama(2, 8);
    odd_head.transformer.attention.kv_channels = Some(7);
    let e = refused_at(&odd_head, 1);
    assert!(e.contains("7"), "{e}");
    let scaling = RopeScaling::Linear { factor: 0.5 };
    let e = refused_at(&llama(2, 8).with_rope_scaling(Some(scaling)), 1);
    assert!(e.contains("0.5"), "{e}");
    // A norm epsilon neither RMSNorm nor LayerNorm can use.
    for config in [llama(2, 8), gpt2(2, 8)] {
        let e = refused_at(
            &config.map_transformer(|t| t.with_layernorm_epsilon(-1e-6)),
            1,
        );
        assert!(
            e.contains("layernorm_epsilon must be finite and positive, got -0.000001"),
            "{e}"
        );
    }
    // A GPT whose layer config asks for bidirectional or post-norm layers: refused, not
    // quietly built causal and pre-norm.
    let mut bidirectional = llama(2, 8);
    bidirectional.transformer.attention.attn_mask_type = AttnMaskType::Padding;
    let e = refused_at(&bidirectional, 1);
    assert!(
        e.contains("causal and pre-norm") && e.contains("Padding"),
        "{e}"
    );
    let post = gpt2(2, 8).map_transformer(|t| t.with_layernorm_position(LayerNormPosition::Post));
    let e = refused_at(&post, 1);
    assert!(e.contains("layernorm_position to Pre (it is Post)"), "{e}");
}

#[test]
fn sequences_beyond_the_learned_positions_are_refused_and_rope_has_no_such_limit() {
    let out = tp_ranks(1, |ctx| {
        let d = &ctx.device;
        let ids = |s: usize| Tensor::<2, Int>::from_data(TensorData::new(vec![1i64; s], [1, s]), d);
        let learned = gpt2(1, 8)
            .init(&ctx.groups.tp, d)
            .map_err(|e| e.to_string())?;
        let e = learned.forward(ids(9)).unwrap_err().to_string();
        let rope = llama(1, 8).with_position_embedding_type(PositionEmbeddingType::Rope);
        let rope = rope.init(&ctx.groups.tp, d).map_err(|e| e.to_string())?;
        let ok = rope.forward(ids(9)).is_ok();
        let bad = rope
            .forward(Tensor::from_data(TensorData::new(vec![64i64], [1, 1]), d))
            .unwrap_err()
            .to_string();
        // Told the loader checked its ids, the model clamps a bad one into the table.
        let rope = rope.with_id_check(IdCheck::Clamp);
        let one = |id: i64| Tensor::<2, Int>::from_data(TensorData::new(vec![id], [1, 1]), d);
        let logits = |id| rope.forward(one(id)).map(|l| l.into_data());
        let clamped = logits(64).map_err(|e| e.to_string())? == logits(63).unwrap();
        Ok::<_, String>((e, ok, bad, clamped))
    })
    .unwrap();
    let (e, ok, bad, clamped) = &out[0];
    assert!(
        e.contains("position 8") && e.contains("max_position_embeddings 8"),
        "{e}"
    );
    assert!(ok);
    assert!(bad.contains("token id 64"), "{bad}");
    assert!(clamped, "IdCheck::Clamp looks id 64 up as 63, the last row");
}
