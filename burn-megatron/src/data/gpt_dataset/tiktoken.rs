//! tiktoken's BPE files (Meta's Llama 3 `tokenizer.model`) as a Hugging Face byte-level BPE.
//!
//! A tiktoken file holds each token's bytes (base64) and its rank; encoding repeatedly joins
//! the adjacent pair whose join has the lowest rank. A byte-level BPE whose merges are every
//! split of every token into two tokens, ranked by the joined token's rank, joins the same
//! pairs in the same order, and `ignore_merges` takes a whole piece that is a token at once,
//! as tiktoken does. That is how `transformers` converts these files, and how Meta's
//! `tokenizer.json` for Llama 3 was made. The pattern and the special tokens are in the
//! Python code that reads the file, not in the file.

use super::DataError;
use ahash::AHashMap;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// The pre-tokenizer pattern of Meta's Llama 3 tokenizer (Llama 3 to 3.3): contractions,
/// letter runs with one leading non-letter, digits in threes, punctuation runs, newlines,
/// spaces.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How many special tokens Meta's Llama 3 tokenizer puts after the ranks.
const LLAMA3_SPECIAL_COUNT: usize = 256;

/// Meta's Llama 3 special tokens in id order, numbered from the first id after the ranks
/// (128000 in Meta's files): Llama 3.1's names, which Meta's code and `transformers`'
/// conversion give for 3.1 to 3.3. Llama 3.0 named ids 2–5, 8 and 10 as reserved tokens, and
/// numbers its reserved tokens from 5 where 3.1 numbers them from 2; the ids a chat uses
/// (begin and end of text, the header marks, end of turn) are the same.
pub fn llama3_special_tokens() -> Vec<String> {
    let named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ];
    let reserved = (2..).map(|i| format!("<|reserved_special_token_{i}|>"));
    (named.iter().map(|t| t.to_string()))
        .chain(reserved)
        .take(LLAMA3_SPECIAL_COUNT)
        .collect()
}

/// The lines of a tiktoken file that hold something, without a `\r` before the newline, with
/// their line numbers (from 1).
fn lines(bytes: &[u8]) -> impl Iterator<Item = (usize, &[u8])> {
    (bytes.split(|&b| b == b'\n').enumerate())
        .map(|(i, line)| (i + 1, line.strip_suffix(b"\r").unwrap_or(line)))
        .filter(|(_, line)| !line.is_empty())
}

/// Whether `bytes` look like a tiktoken file rather than JSON: the first line that holds
/// something is base64, a space, and a number.
pub(super) fn looks_like_tiktoken(bytes: &[u8]) -> bool {
    let first = lines(bytes).next().map(|(_, l)| l).unwrap_or_default();
    let mut fields = first.split(|&b| b == b' ');
    let token = fields.next().is_some_and(|t| STANDARD.decode(t).is_ok());
    let rank = fields
        .next()
        .and_then(|r| std::str::from_utf8(r).ok())
        .is_some_and(|r| r.trim_end().parse::<u32>().is_ok());
    token && rank && fields.next().is_none()
}

/// The ranks of a tiktoken file, indexed by rank: each token's bytes. Ranks must run from 0
/// without a gap or a repeat (the special tokens' ids follow them), and every single byte
/// must be a token (otherwise some text has no encoding).
fn ranks(bytes: &[u8], name: &str) -> Result<Vec<Vec<u8>>, DataError> {
    let format = |message: String| DataError::Format {
        path: name.to_string(),
        message,
    };
    let n = lines(bytes).count();
    // With every rank below the number of tokens and none given twice, none is missing.
    let mut by_rank: Vec<Option<Vec<u8>>> = vec![None; n];
    let mut seen = std::collections::HashSet::new();
    for (i, line) in lines(bytes) {
        let bad = || format!("line {i}: not `<base64 token> <rank>`");
        let (token, rank) = match line.iter().position(|&b| b == b' ') {
            Some(at) => (&line[..at], &line[at + 1..]),
            None => return Err(format(bad())),
        };
        let token = STANDARD.decode(token).map_err(|_| format(bad()))?;
        if token.is_empty() {
            return Err(format(format!("line {i}: an empty token")));
        }
        let rank: usize = (std::str::from_utf8(rank).ok())
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| format(bad()))?;
        let slot = by_rank.get_mut(rank).ok_or_else(|| {
            format(format!(
                "line {i}: rank {rank}, but the file holds {n} tokens (ranks run from 0 \
                 without a gap)"
            ))
        })?;
        if slot.is_some() {
            return Err(format(format!("line {i}: rank {rank} given twice")));
        }
        if !seen.insert(token.clone()) {
            return Err(format(format!("line {i}: a token given twice")));
        }
        *slot = Some(token);
    }
    let ranks: Vec<Vec<u8>> = by_rank.into_iter().flatten().collect();
    if let Some(b) = (0..=255u8).find(|b| !seen.contains(&vec![*b])) {
        return Err(format(format!("the byte {b:#04x} is not a token")));
    }
    Ok(ranks)
}

/// GPT-2's byte-to-character map, under which a byte-level BPE's vocabulary is text:
/// printable Latin-1 bytes are themselves, the other 68 take the characters from U+0100 on.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 0x100u32;
    for (b, c) in (0..=255u8).zip(chars.iter_mut()) {
        *c = if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
            char::from(b)
        } else {
            next += 1;
            // U+0100..U+0144: never a surrogate.
            char::from_u32(next - 1).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
    }
    chars
}

/// The tiktoken file `bytes` (named `name` in errors) as a byte-level BPE splitting text by
/// `pattern`, with `special_tokens` numbered from the first id after the ranks.
pub(super) fn tokenizer(
    bytes: &[u8],
    name: &str,
    pattern: &str,
    special_tokens: &[String],
) -> Result<Tokenizer, DataError> {
    let ranks = ranks(bytes, name)?;
    let chars = byte_chars();
    let text = |t: &[u8]| -> String { t.iter().map(|&b| chars[usize::from(b)]).collect() };
    let rank_of: AHashMap<&[u8], usize> = (ranks.iter().enumerate())
        .map(|(r, t)| (t.as_slice(), r))
        .collect();
    // Every split of a token into two tokens, at the joined token's rank (then by the pieces'
    // ranks, so that the order is fixed).
    let mut merges: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (rank, token) in ranks.iter().enumerate() {
        for at in 1..token.len() {
            let (l, r) = token.split_at(at);
            if let (Some(&lr), Some(&rr)) = (rank_of.get(l), rank_of.get(r)) {
                merges.push((rank, lr, rr, at));
            }
        }
    }
    merges.sort_unstable();
    let merges = merges
        .into_iter()
        .map(|(rank, _, _, at)| {
            let (l, r) = ranks[rank].split_at(at);
            (text(l), text(r))
        })
        .collect();
    let vocab: AHashMap<String, u32> = (ranks.iter().zip(0u32..))
        .map(|(t, id)| (text(t), id))
        .collect();
    let err = |e: tokenizers::Error| DataError::Tokenizer(format!("{name}: {e}"));
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(true)
        .build()
        .map_err(err)?;
    let mut tokenizer = Tokenizer::new(bpe);
    let split = Split::new(
        SplitPattern::Regex(pattern.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(err)?;
    let byte_level = ByteLevel::default()
        .add_prefix_space(false)
        .use_regex(false);
    tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(byte_level),
    ])));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    tokenizer
        .add_special_tokens((special_tokens.iter()).map(|t| AddedToken::from(t.clone(), true)))
        .map_err(err)?;
    for (i, t) in special_tokens.iter().enumerate() {
        let want = ranks.len() + i;
        if tokenizer.token_to_id(t).map(|id| id as usize) != Some(want) {
            return Err(DataError::Tokenizer(format!(
                "{name}: the special token {t} is not id {want} (a special token given twice, \
                 or one that is also a rank's token?)"
            )));
        }
    }
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_map_is_the_byte_level_alphabet() {
        let chars = byte_chars();
        let ours: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(ours.len(), 256);
        assert_eq!(ours, ByteLevel::alphabet().into_iter().collect());
        // GPT-2's map: the space is U+0120 ("Ġ"), the newline U+010A ("Ċ").
        assert_eq!(
            (chars[usize::from(b' ')], chars[usize::from(b'\n')]),
            ('Ġ', 'Ċ')
        );
    }

    /// A piece that is a token is taken whole, as tiktoken takes it, even where the merges
    /// cannot reach it: with `bc` ranked before `ab`, the merges stop at `a bc d`. The ids are
    /// tiktoken 0.14's for these ranks (`Encoding(pat_str=r"\S+|\s+", ...)`).
    #[test]
    fn a_piece_that_is_a_token_is_taken_whole() {
        let mut lines: Vec<String> = (0..=255u8)
            .map(|b| format!("{} {b}", STANDARD.encode([b])))
            .collect();
        for (token, rank) in ["bc", "ab", "cd", "abcd"].iter().zip(256..) {
            lines.push(format!("{} {rank}", STANDARD.encode(token)));
        }
        let t = tokenizer(lines.join("\n").as_bytes(), "t", r"\S+|\s+", &[]).unwrap();
        let ids = |text: &str| t.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(ids("abcd"), [259]);
        assert_eq!(ids("xabcd"), [120, 97, 256, 100]);
        assert_eq!(ids("abcd abc"), [259, 32, 97, 256]);
    }

    #[test]
    fn ranks_with_a_gap_a_repeat_or_a_missing_byte_are_refused() {
        let bytes: Vec<String> = (0..=255u8)
            .map(|b| format!("{} {b}", STANDARD.encode([b])))
            .collect();
        let file = |extra: &[&str]| {
            let mut lines = bytes.clone();
            lines.extend(extra.iter().map(|s| s.to_string()));
            lines.join("\n").into_bytes()
        };
        let ab = STANDARD.encode(b"ab");
        assert_eq!(
            ranks(&file(&[&format!("{ab} 256")]), "t").unwrap().len(),
            257
        );
        let err = |f: Vec<u8>| ranks(&f, "t").unwrap_err().to_string();
        assert!(err(file(&[&format!("{ab} 257")])).contains("rank 257, but the file holds 257"));
        let huge = format!("{ab} 18446744073709551615");
        assert!(err(file(&[&huge])).contains("the file holds 257 tokens"));
        assert!(err(file(&["  257"])).contains("line 257: an empty token"));
        assert!(err(file(&[&format!("{ab} 255")])).contains("rank 255 given twice"));
        let repeat = format!("{} 256", STANDARD.encode(b"a"));
        assert!(err(file(&[&repeat])).contains("a token given twice"));
        assert!(err(file(&["not base64! 256"])).contains("line 257"));
        let z = format!("{} 122", STANDARD.encode(b"z"));
        let without_z = String::from_utf8(file(&[]))
            .unwrap()
            .replace(&z, &format!("{ab} 122"));
        assert!(err(without_z.into_bytes()).contains("the byte 0x7a is not a token"));
    }
}
