//! SentencePiece BPE models (Llama 2's `tokenizer.model`) as a Hugging Face BPE.
//!
//! The model is a protocol buffer: its pieces with their scores and types, how it was
//! trained, and how it normalises text. SentencePiece's BPE joins the adjacent pair whose
//! join is the piece of highest score; a Hugging Face BPE whose merges are every split of
//! every piece into two pieces, ranked by the joined piece's score, joins the same pairs.
//! Text becomes pieces as SentencePiece makes it: normalised (Llama 2's: not at all), a `▁`
//! before it (the dummy prefix) and for every space, characters without a piece as their
//! UTF-8 bytes (`<0x..>`, byte fallback). That is how `transformers` converts these files.

use super::DataError;
use ahash::AHashMap;
use prost::Message;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{NormalizerWrapper, Precompiled, Prepend, Replace, Sequence};
use tokenizers::{AddedToken, Tokenizer};

/// The parts of SentencePiece's `ModelProto` read here (field numbers as in its
/// `sentencepiece_model.proto`; the rest is skipped).
#[derive(Clone, PartialEq, Message)]
struct ModelProto {
    #[prost(message, repeated, tag = "1")]
    pieces: Vec<Piece>,
    #[prost(message, optional, tag = "2")]
    trainer_spec: Option<TrainerSpec>,
    #[prost(message, optional, tag = "3")]
    normalizer_spec: Option<NormalizerSpec>,
}

#[derive(Clone, PartialEq, Message)]
struct Piece {
    #[prost(string, optional, tag = "1")]
    piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    score: Option<f32>,
    /// 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    #[prost(int32, optional, tag = "3")]
    kind: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct TrainerSpec {
    /// 1 unigram (the default), 2 BPE, 3 word, 4 char.
    #[prost(int32, optional, tag = "3")]
    model_type: Option<i32>,
    #[prost(bool, optional, tag = "24")]
    treat_whitespace_as_suffix: Option<bool>,
    #[prost(bool, optional, tag = "35")]
    byte_fallback: Option<bool>,
}

#[derive(Clone, PartialEq, Message)]
struct NormalizerSpec {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(bytes = "vec", optional, tag = "2")]
    precompiled_charsmap: Option<Vec<u8>>,
    /// Default true.
    #[prost(bool, optional, tag = "3")]
    add_dummy_prefix: Option<bool>,
    /// Default true.
    #[prost(bool, optional, tag = "4")]
    remove_extra_whitespaces: Option<bool>,
    /// Default true.
    #[prost(bool, optional, tag = "5")]
    escape_whitespaces: Option<bool>,
}

const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BPE_MODEL: i32 = 2;

/// Whether `bytes` parse as a SentencePiece model with pieces.
pub(super) fn looks_like_sentencepiece(bytes: &[u8]) -> bool {
    ModelProto::decode(bytes).is_ok_and(|m| !m.pieces.is_empty())
}

/// The SentencePiece model `bytes` (named `name` in errors) as a Hugging Face BPE: its
/// control and unknown pieces (`<s>`, `</s>`, `<unk>`) special tokens at their ids. Only BPE
/// models are read (a unigram model's encoding is another algorithm), with the spaces
/// SentencePiece keeps as they are (`remove_extra_whitespaces` off, as in Llama 2's).
pub(super) fn tokenizer(bytes: &[u8], name: &str) -> Result<Tokenizer, DataError> {
    let format = |message: String| DataError::Format {
        path: name.to_string(),
        message,
    };
    let model =
        ModelProto::decode(bytes).map_err(|e| format(format!("not a SentencePiece model: {e}")))?;
    let trainer = model.trainer_spec.clone().unwrap_or_default();
    let normalizer = model.normalizer_spec.clone().unwrap_or_default();
    let model_type = trainer.model_type.unwrap_or(1);
    if model_type != BPE_MODEL {
        let kind = match model_type {
            1 => "unigram",
            3 => "word",
            4 => "char",
            _ => "unknown",
        };
        return Err(format(format!(
            "a SentencePiece {kind} model; only BPE models (Llama 2's) are read: use the \
             tokenizer.json beside it"
        )));
    }
    if normalizer.remove_extra_whitespaces.unwrap_or(true) {
        return Err(format(
            "a SentencePiece model that removes extra whitespace (remove_extra_whitespaces) is \
             not read: use the tokenizer.json beside it"
                .into(),
        ));
    }
    if trainer.treat_whitespace_as_suffix.unwrap_or(false) {
        return Err(format(
            "a SentencePiece model whose `▁` ends words (treat_whitespace_as_suffix) is not read"
                .into(),
        ));
    }
    let mut vocab: AHashMap<String, u32> = AHashMap::new();
    let (mut special, mut unk) = (Vec::new(), None);
    for (id, p) in (0u32..).zip(&model.pieces) {
        let piece = p.piece.clone().unwrap_or_default();
        if vocab.insert(piece.clone(), id).is_some() {
            return Err(format(format!("the piece {piece:?} is given twice")));
        }
        match p.kind.unwrap_or(1) {
            UNKNOWN => {
                unk = Some(piece.clone());
                special.push(piece);
            }
            CONTROL => special.push(piece),
            // SentencePiece matches them in the text before BPE, whole; a Hugging Face
            // added token gets the dummy prefix around it instead.
            USER_DEFINED => {
                return Err(format(format!(
                    "the user-defined piece {piece:?}: models with user-defined pieces \
                     (Gemma's) are not read, use the tokenizer.json beside it"
                )));
            }
            _ => {}
        }
    }
    // Without one, SentencePiece refuses the model; a Hugging Face BPE would drop what it
    // cannot encode.
    if unk.is_none() {
        return Err(format("no unknown piece (type UNKNOWN)".into()));
    }
    if !normalizer.escape_whitespaces.unwrap_or(true) {
        return Err(format(
            "a SentencePiece model that keeps spaces as they are (escape_whitespaces off) is \
             not read"
                .into(),
        ));
    }
    let merges = merges(&model.pieces, &vocab);
    let err = |e: tokenizers::Error| DataError::Tokenizer(format!("{name}: {e}"));
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .fuse_unk(true)
        .byte_fallback(trainer.byte_fallback.unwrap_or(false));
    if let Some(unk) = unk {
        bpe = bpe.unk_token(unk);
    }
    let mut tokenizer = Tokenizer::new(bpe.build().map_err(err)?);
    let prefix = normalizer.add_dummy_prefix.unwrap_or(true);
    let mut normalizers = Vec::new();
    match normalizer.precompiled_charsmap.as_deref() {
        Some(map) if !map.is_empty() => {
            // The map's first four bytes are its trie's length: a map that does not hold it
            // would panic at the first text normalised.
            let trie = (map.get(..4)).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let fits = |t: u32| (4..=map.len() - 4).contains(&(t as usize)) && t.is_multiple_of(4);
            if !trie.is_some_and(fits) {
                return Err(format(
                    "the normaliser's precompiled map is malformed".into(),
                ));
            }
            let map = Precompiled::from(map)
                .map_err(|e| format(format!("the normaliser {:?}'s map: {e}", normalizer.name)))?;
            normalizers.push(NormalizerWrapper::Precompiled(map));
        }
        _ => {}
    }
    if prefix {
        normalizers.push(NormalizerWrapper::Prepend(Prepend::new("▁".into())));
    }
    normalizers.push(NormalizerWrapper::Replace(
        Replace::new(" ", "▁").map_err(err)?,
    ));
    tokenizer
        .with_normalizer(Some(Sequence::new(normalizers)))
        .map_err(err)?;
    let mut decoders = vec![
        DecoderWrapper::Replace(Replace::new("▁", " ").map_err(err)?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    tokenizer
        .add_special_tokens(special.into_iter().map(|t| AddedToken::from(t, true)))
        .map_err(err)?;
    Ok(tokenizer)
}

/// Every split of every piece into two pieces, highest joined score first (then by the
/// joined piece's id and the two pieces' ids, so that the order is fixed, as `transformers`
/// fixes it). Splits are between characters.
fn merges(pieces: &[Piece], vocab: &AHashMap<String, u32>) -> Vec<(String, String)> {
    let mut merges: Vec<(f32, u32, u32, u32, String, String)> = Vec::new();
    for (id, p) in (0u32..).zip(pieces) {
        let piece = p.piece.as_deref().unwrap_or_default();
        let score = p.score.unwrap_or(0.0);
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                merges.push((score, id, li, ri, l.to_string(), r.to_string()));
            }
        }
    }
    merges.sort_by(|a, b| (b.0.total_cmp(&a.0)).then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3))));
    merges
        .into_iter()
        .map(|(_, _, _, _, l, r)| (l, r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model of another kind, one that removes extra whitespace, one with user-defined
    /// pieces or without an unknown piece, and a malformed normalisation map are refused
    /// naming why.
    #[test]
    fn models_of_another_kind_are_refused() {
        let model = |model_type: i32, remove: bool| {
            ModelProto {
                pieces: vec![Piece {
                    piece: Some("<unk>".into()),
                    score: Some(0.0),
                    kind: Some(UNKNOWN),
                }],
                trainer_spec: Some(TrainerSpec {
                    model_type: Some(model_type),
                    ..Default::default()
                }),
                normalizer_spec: Some(NormalizerSpec {
                    remove_extra_whitespaces: Some(remove),
                    ..Default::default()
                }),
            }
            .encode_to_vec()
        };
        let err = |bytes: Vec<u8>| tokenizer(&bytes, "t.model").unwrap_err().to_string();
        assert!(err(model(1, false)).contains("a SentencePiece unigram model"));
        assert!(err(model(2, true)).contains("remove_extra_whitespaces"));
        let mut user = ModelProto::decode(model(2, false).as_slice()).unwrap();
        user.pieces.push(Piece {
            piece: Some("<sep>".into()),
            score: Some(0.0),
            kind: Some(USER_DEFINED),
        });
        assert!(err(user.encode_to_vec()).contains("user-defined piece \"<sep>\""));
        let mut no_unk = ModelProto::decode(model(2, false).as_slice()).unwrap();
        no_unk.pieces[0].kind = Some(1);
        assert!(err(no_unk.encode_to_vec()).contains("no unknown piece"));
        let mut bad_map = ModelProto::decode(model(2, false).as_slice()).unwrap();
        if let Some(n) = bad_map.normalizer_spec.as_mut() {
            // An empty trie: `Precompiled::from` takes it, and its first text panics.
            n.precompiled_charsmap = Some(b"\0\0\0\0abc".to_vec());
        }
        assert!(err(bad_map.encode_to_vec()).contains("precompiled map is malformed"));
        assert!(tokenizer(&model(2, false), "t.model").is_ok());
        assert!(looks_like_sentencepiece(&model(2, false)));
        assert!(!looks_like_sentencepiece(b"{\"version\": \"1.0\"}"));
    }
}
