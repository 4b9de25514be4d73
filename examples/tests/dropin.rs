//! The drop-in examples end to end: a plain Burn Llama (`tp_llama_dropin`) and a BERT on
//! Burn's `TransformerEncoder` (`tp_bert_dropin`), each beside its layer-swapped
//! tensor-parallel copy, load one saved record (each rank only its shards), train to the same
//! losses and gradients and predict the same tokens; the Llama also split into TP 2 × PP 2
//! stages. The examples fail past 1e-5 themselves; the tests read their numbers too.

use crate::common::example_binary;

/// `name` run with `args`: its standard output, after it succeeded.
fn run(name: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(example_binary(name))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} {args:?}:\n{stdout}\n{stderr}");
    stdout
}

/// A scratch copy of the test fixture `name` (`tests/fixtures/{name}`), to add files to.
fn fixture_copy(name: &str) -> std::path::PathBuf {
    let fixture = format!("{}/../tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(fixture).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    dir
}

/// `name` run with `args` fails, its error naming `what`.
fn fails_naming(name: &str, args: &[&str], what: &str) {
    let out = std::process::Command::new(example_binary(name))
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains(what), "{stderr}");
}

/// The text after `prefix` on the line that starts with it.
fn after<'a>(stdout: &'a str, prefix: &str) -> &'a str {
    let line = stdout.lines().find(|l| l.starts_with(prefix));
    line.unwrap_or_else(|| panic!("no {prefix:?} line in:\n{stdout}"))[prefix.len()..].trim()
}

/// The loss differences of the step lines ("    2     4.157634     4.157633    4.77e-7").
fn loss_differences(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 4 && f[0].parse::<usize>().is_ok()).then(|| f[3].parse().unwrap())
        })
        .collect()
}

/// "largest relative gradient difference (step 0): 3.47e-7 (layers.0.attention_norm.gamma)"
fn gradient_difference(stdout: &str) -> f64 {
    let rest = after(stdout, "largest relative gradient difference (step 0):");
    let value = rest.split_whitespace().next().and_then(|v| v.parse().ok());
    value.unwrap_or_else(|| panic!("no number in {rest:?}"))
}

#[test]
fn the_swapped_plain_burn_llama_matches_the_plain_one() {
    let stdout = run("tp_llama_dropin", &["--steps", "3"]);
    assert!(gradient_difference(&stdout) <= 1e-5, "{stdout}");
    // The TP 2 table, then the TP 2 × PP 2 one.
    let steps = loss_differences(&stdout);
    assert_eq!(steps.len(), 6, "{stdout}");
    assert!(steps.iter().all(|d| *d <= 1e-5), "{stdout}");
    let pipelined = after(
        &stdout,
        "largest relative gradient difference (step 0, TP=2×PP=2):",
    );
    let pipelined: f64 = (pipelined.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number in {pipelined:?}"));
    assert!(pipelined <= 1e-5, "{stdout}");
    // Greedy generation through each rank's key/value cache and the vocabulary-parallel
    // sampler: the plain model's tokens.
    assert_eq!(
        after(&stdout, "greedy tokens TP=1:"),
        after(&stdout, "greedy tokens TP=2:")
    );
    // The trained TP 2 weights, written back with save_gathered and loaded by the plain
    // model with Burn's load_file, give the split model's loss.
    let saved = after(
        &stdout,
        "trained at TP=2, saved with save_gathered, loaded by the plain model:",
    );
    let diff = (saved.rsplit("|diff| ").next())
        .and_then(|d| d.trim_end_matches(')').parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no difference in {saved:?}"));
    assert!(diff <= 1e-5, "{saved}");
    // Shard-on-load of an 80 MiB record at TP 2: rank 0's peak against its shards plus one
    // whole tensor (measured 0.86; building the whole model first holds 80 MiB before any
    // split, 1.4 or more).
    // "loading a 80.02 MiB record at TP 2: rank 0 peaks at 48.11 MiB = 0.86x (its shards ..."
    let line = stdout
        .lines()
        .find(|l| l.starts_with("loading a "))
        .expect("a loading line");
    let ratio: f64 = line
        .split_once(" = ")
        .and_then(|(_, rest)| rest.split_once('x'))
        .and_then(|(r, _)| r.parse().ok())
        .unwrap_or_else(|| panic!("no ratio in {line:?}"));
    assert!(ratio <= 1.2, "{line}");
}

/// `--hf`: a Hugging Face Llama checkpoint (the fixture `transformers` wrote) at TP 1 and 2,
/// each rank reading its shards, generates the same tokens; the integration test
/// `dropin::hf_llama` holds the same code to `transformers`' logits, gradients and tokens. A
/// checkpoint the model cannot hold fails, naming the setting.
#[test]
fn the_llama_example_reads_a_hugging_face_checkpoint() {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");
    let llama = format!("{fixtures}/hf_llama_tiny");
    let args = [
        "--hf",
        &llama,
        "--prompt",
        "86,13,60,13,9,28,68",
        "--new-tokens",
        "10",
    ];
    let stdout = run("tp_llama_dropin", &args);
    let tokens = after(&stdout, "greedy tokens TP=1:");
    assert_eq!(tokens.split(',').count(), 10, "{stdout}");
    assert_eq!(tokens, after(&stdout, "greedy tokens TP=2:"));
    // `--no-reference`: TP 2 alone, the same tokens; `--device cuda` without a GPU (or
    // without the `cuda` feature) fails before any rank starts, naming the flag.
    let alone = run(
        "tp_llama_dropin",
        &[&args[..], &["--no-reference"]].concat(),
    );
    assert!(!alone.contains("TP=1"), "{alone}");
    assert_eq!(after(&alone, "greedy tokens TP=2:"), tokens);
    if burn_megatron::device::cuda_device(0).is_err() {
        let cuda = [&args[..], &["--no-reference", "--device", "cuda"]].concat();
        fails_naming("tp_llama_dropin", &cuda, "--device cuda");
    }
    // `--text` through a `tokenizer.json` beside the checkpoint: a word-level one whose
    // `wN` is token N, so the prompt is BOS and the ids the words name.
    let dir = fixture_copy("hf_llama_tiny");
    let mut vocab = serde_json::json!({"<unk>": 0, "<s>": 1, "</s>": 2});
    for id in 3..100 {
        vocab[format!("w{id}")] = serde_json::json!(id);
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let text = "w86 w13 w60 w13 w9 w28 w68";
    let args = [
        "--hf",
        dir.to_str().unwrap(),
        "--text",
        text,
        "--new-tokens",
        "6",
    ];
    let stdout = run("tp_llama_dropin", &args);
    let words = after(&stdout, "text TP=1:");
    assert_eq!(words, after(&stdout, "text TP=2:"));
    // The words name the tokens the same prompt as ids (BOS first) generates.
    let ids = ["--prompt", "1,86,13,60,13,9,28,68", "--new-tokens", "6"];
    let stdout = run("tp_llama_dropin", &[&["--hf", &llama][..], &ids].concat());
    let tokens = after(&stdout, "greedy tokens TP=1:");
    let tokens = tokens.trim_matches(|c| c == '[' || c == ']').split(", ");
    let named: Vec<String> = tokens.map(|t| format!("w{t}")).collect();
    assert_eq!(words, format!("{:?}", named.join(" ")), "{stdout}");
    std::fs::remove_dir_all(dir).unwrap();
    let qwen2 = format!("{fixtures}/hf_qwen2_tiny");
    fails_naming("tp_llama_dropin", &["--hf", &qwen2], "model_type");
    // `--save-hf`: written back at TP 2, the checkpoint reads again to the same tokens.
    let out = std::env::temp_dir().join(format!("hf-llama-saved-{}", std::process::id()));
    let prompt = ["--prompt", "86,13,60,13,9,28,68", "--new-tokens", "10"];
    let save = ["--hf", &llama, "--save-hf", out.to_str().unwrap()];
    let saved = run("tp_llama_dropin", &[&save[..], &prompt].concat());
    assert!(saved.contains("written at TP 2"), "{saved}");
    let again = ["--hf", out.to_str().unwrap()];
    let again = run("tp_llama_dropin", &[&again[..], &prompt].concat());
    assert_eq!(
        after(&again, "greedy tokens TP=2:"),
        after(&saved, "greedy tokens TP=2:")
    );
    std::fs::remove_dir_all(out).unwrap();
}

/// The prompt `--text "Hello world"` makes through the tokenizer fixture in `dir`: the id its
/// `tokenizer_expected.json` gives under `bos`, then the tokenizer's own ids for the text.
fn hello_world(dir: &str, bos: &str) -> Vec<i64> {
    let path = format!("{dir}/tokenizer_expected.json");
    let tokens: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let case = (tokens["cases"].as_array().unwrap().iter())
        .find(|c| c["text"] == "Hello world")
        .unwrap();
    let ids = case["ids"].as_array().unwrap().iter();
    std::iter::once(&tokens[bos])
        .chain(ids)
        .map(|i| i.as_i64().unwrap())
        .collect()
}

/// `--meta`: a Llama in Meta's format split over two model-parallel files (the fixture
/// `make_meta_llama.py` wrote) at TP 1 and 4, each rank reading its shards of the joined
/// parts, generates `transformers`' greedy tokens; the integration test
/// `dropin::hf_llama::meta_format` holds it to `transformers`' logits and gradients. Without
/// the RoPE scaling factor Meta's files do not give, it fails, naming the setting.
#[test]
fn the_llama_example_reads_a_meta_checkpoint() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/meta_llama_tiny_mp2"
    );
    let prompt = [
        "--prompt",
        "305,424,102,212,189,238,330",
        "--new-tokens",
        "10",
    ];
    let meta = ["--meta", dir, "--rope-scaling-factor", "32"];
    let args = [&meta[..], &["--tp", "4"], &prompt];
    let stdout = run("tp_llama_dropin", &args.concat());
    assert!(stdout.contains("(2 model-parallel files)"), "{stdout}");
    // `transformers`' tokens (tests/fixtures/meta_llama_tiny/generate.safetensors, row 1).
    let want = "[136, 218, 337, 218, 400, 91, 422, 61, 36, 324]";
    assert_eq!(after(&stdout, "greedy tokens TP=1:"), want, "{stdout}");
    assert_eq!(after(&stdout, "greedy tokens TP=4:"), want, "{stdout}");
    fails_naming("tp_llama_dropin", &["--meta", dir], "use_scaled_rope");
    // `--dtype`: each rank's device set to bf16 or f16 before the model is built, the weights
    // are read from the bfloat16 files in that type (half f32's bytes on every rank), and TP 4
    // generates what TP 1 does. In f16 the tokens are also `transformers`' own.
    let weights = |out: &str, tp: usize| -> (String, usize) {
        let line = after(out, &format!("weights TP={tp}:"));
        let (dtypes, bytes) = line.split_once(", ").unwrap();
        (
            dtypes.to_string(),
            bytes.split(' ').next().unwrap().parse().unwrap(),
        )
    };
    let f32_bytes = [weights(&stdout, 1).1, weights(&stdout, 4).1];
    assert_eq!(weights(&stdout, 1).0, "[F32]");
    for (dtype, held) in [("bf16", "[BF16]"), ("f16", "[F16]")] {
        let args = [&meta[..], &["--tp", "4", "--dtype", dtype], &prompt];
        let out = run("tp_llama_dropin", &args.concat());
        assert_eq!(
            weights(&out, 1),
            (held.to_string(), f32_bytes[0] / 2),
            "{out}"
        );
        assert_eq!(
            weights(&out, 4),
            (held.to_string(), f32_bytes[1] / 2),
            "{out}"
        );
        let tokens = after(&out, "greedy tokens TP=1:");
        assert_eq!(tokens, after(&out, "greedy tokens TP=4:"));
        if dtype == "f16" {
            assert_eq!(tokens, want, "{out}");
        }
    }
    // `--text` through the directory's `tokenizer.model`: the prompt is `<|begin_of_text|>`
    // and tiktoken's ids for the text (tests/fixtures/meta_llama_tiny/tokenizer_expected.json),
    // and it generates what those ids as `--prompt` generate.
    let ids = hello_world(&format!("{dir}/../meta_llama_tiny"), "begin_of_text");
    let text = [&meta[..], &["--text", "Hello world", "--new-tokens", "6"]].concat();
    let stdout = run("tp_llama_dropin", &text);
    assert_eq!(
        after(&stdout, "prompt ids:"),
        format!("{ids:?}"),
        "{stdout}"
    );
    assert_eq!(after(&stdout, "text TP=1:"), after(&stdout, "text TP=2:"));
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    let ids = ids.join(",");
    let as_ids = [&meta[..], &["--prompt", &ids, "--new-tokens", "6"]].concat();
    let again = run("tp_llama_dropin", &as_ids);
    assert_eq!(
        after(&stdout, "greedy tokens TP=2:"),
        after(&again, "greedy tokens TP=2:")
    );
    // Without a tokenizer.model, `--text` is refused naming it; an id outside the vocabulary
    // is refused before any rank starts.
    let bare = std::env::temp_dir().join(format!("meta-no-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&bare).unwrap();
    for f in ["params.json", "consolidated.00.pth", "consolidated.01.pth"] {
        std::fs::copy(format!("{dir}/{f}"), bare.join(f)).unwrap();
    }
    let bare_args = [
        "--meta",
        bare.to_str().unwrap(),
        "--rope-scaling-factor",
        "32",
    ];
    let hi = [
        &bare_args[..],
        &["--text", "Hello world", "--new-tokens", "2"],
    ]
    .concat();
    fails_naming("tp_llama_dropin", &hi, "tokenizer.model");
    // Llama 2's kind of tokenizer.model (SentencePiece's) in its place: the prompt is `<s>`
    // and SentencePiece's ids (tests/fixtures/spm_llama2_tiny/tokenizer_expected.json).
    let spm = format!("{dir}/../spm_llama2_tiny");
    std::fs::copy(
        format!("{spm}/tokenizer.model"),
        bare.join("tokenizer.model"),
    )
    .unwrap();
    let ids = hello_world(&spm, "bos");
    let stdout = run("tp_llama_dropin", &hi);
    assert_eq!(
        after(&stdout, "prompt ids:"),
        format!("{ids:?}"),
        "{stdout}"
    );
    std::fs::remove_dir_all(bare).unwrap();
    let outside = [&meta[..], &["--prompt", "1,576"]].concat();
    fails_naming(
        "tp_llama_dropin",
        &outside,
        "576 is not in the vocabulary of 576",
    );
}

/// `--hf --text`: a Hugging Face BERT checkpoint (the fixture `transformers` wrote) beside a
/// `vocab.txt`, at TP 1 and 2, fills the same masks; the integration test `dropin::hf_bert`
/// holds the same code to `transformers`' logits. A checkpoint of another model type fails,
/// naming the setting.
#[test]
fn the_bert_example_reads_a_hugging_face_checkpoint() {
    let dir = fixture_copy("hf_bert_tiny");
    // A word-level vocabulary the size of the model's: `wN` is token N.
    let special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"].map(String::from);
    let vocab: Vec<String> = special
        .into_iter()
        .chain((5..100).map(|i| format!("w{i}")))
        .collect();
    std::fs::write(dir.join("vocab.txt"), vocab.join("\n")).unwrap();
    let text = "w17 w23 [MASK] w42 w8 [MASK] w61";
    let args = ["--hf", dir.to_str().unwrap(), "--text", text, "--tp", "2"];
    let stdout = run("tp_bert_dropin", &args);
    let filled = after(&stdout, "masks filled at TP=1:");
    // `--save-hf`: written back at TP 2 beside the vocabulary, the checkpoint fills the
    // masks alike.
    let out = std::env::temp_dir().join(format!("hf-bert-saved-{}", std::process::id()));
    let saved = run(
        "tp_bert_dropin",
        &[&args[..], &["--save-hf", out.to_str().unwrap()]].concat(),
    );
    assert!(saved.contains("written at TP 2"), "{saved}");
    std::fs::copy(dir.join("vocab.txt"), out.join("vocab.txt")).unwrap();
    let again = ["--hf", out.to_str().unwrap(), "--text", text, "--tp", "2"];
    let again = run("tp_bert_dropin", &again);
    assert_eq!(
        after(&again, "masks filled at TP=2:"),
        after(&stdout, "masks filled at TP=2:")
    );
    std::fs::remove_dir_all(&out).unwrap();
    assert_eq!(
        filled.split("], ").next().unwrap().split(',').count(),
        2,
        "{stdout}"
    );
    assert_eq!(filled, after(&stdout, "masks filled at TP=2:"));
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["model_type"] = serde_json::json!("roberta");
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    fails_naming("tp_bert_dropin", &args, "model_type");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_swapped_burn_encoder_bert_matches_the_plain_one_at_tp_2_and_4() {
    for tp in ["2", "4"] {
        let stdout = run("tp_bert_dropin", &["--tp", tp, "--steps", "3"]);
        assert!(gradient_difference(&stdout) <= 1e-5, "{stdout}");
        let steps = loss_differences(&stdout);
        assert_eq!(steps.len(), 3, "{stdout}");
        assert!(steps.iter().all(|d| *d <= 1e-5), "{stdout}");
        let filled = after(&stdout, "masks filled at TP=1:");
        assert_eq!(filled, after(&stdout, &format!("masks filled at TP={tp}:")));
    }
}
