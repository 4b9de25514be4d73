//! Where the text comes from: a procedural generator of English-like documents (the
//! offline default) or a text / JSONL file.
//!
//! The generator's text has structure a small model can learn: subject–verb agreement
//! (`the dog runs` / `the dogs run`), pronouns that agree with the subject of the
//! document, topic words that recur within a document, fixed phrases, and sentence openers
//! that follow the order of a story (`first` … `then` … `finally`) so that sentence order
//! is predictable (SOP).

use super::DataError;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use std::path::Path;

/// A document: its sentences, in order.
pub type Document = Vec<String>;

struct Topic {
    nouns: &'static [(&'static str, &'static str)],
    places: &'static [&'static str],
}

const TOPICS: &[Topic] = &[
    Topic {
        nouns: &[
            ("dog", "dogs"),
            ("cat", "cats"),
            ("horse", "horses"),
            ("bird", "birds"),
            ("fox", "foxes"),
        ],
        places: &["farm", "field", "barn", "meadow"],
    },
    Topic {
        nouns: &[
            ("sailor", "sailors"),
            ("boat", "boats"),
            ("captain", "captains"),
            ("fish", "fish"),
            ("wave", "waves"),
        ],
        places: &["harbor", "sea", "island", "shore"],
    },
    Topic {
        nouns: &[
            ("teacher", "teachers"),
            ("student", "students"),
            ("book", "books"),
            ("lesson", "lessons"),
            ("child", "children"),
        ],
        places: &["school", "library", "classroom", "garden"],
    },
    Topic {
        nouns: &[
            ("baker", "bakers"),
            ("cook", "cooks"),
            ("bread", "breads"),
            ("cake", "cakes"),
            ("guest", "guests"),
        ],
        places: &["kitchen", "market", "bakery", "village"],
    },
    Topic {
        nouns: &[
            ("engineer", "engineers"),
            ("machine", "machines"),
            ("worker", "workers"),
            ("train", "trains"),
            ("bridge", "bridges"),
        ],
        places: &["city", "factory", "station", "tunnel"],
    },
];

/// Verbs as (third person singular, plural) with the preposition they take.
const VERBS: &[(&str, &str, &str)] = &[
    ("walks", "walk", "to"),
    ("runs", "run", "across"),
    ("looks", "look", "at"),
    ("waits", "wait", "near"),
    ("works", "work", "in"),
    ("sings", "sing", "about"),
    ("thinks", "think", "about"),
    ("moves", "move", "toward"),
];
const ADJECTIVES: &[&str] = &[
    "old", "young", "quiet", "small", "large", "happy", "tired", "clever", "brave", "gentle",
];
const ADVERBS: &[&str] = &[
    "slowly",
    "quickly",
    "carefully",
    "often",
    "rarely",
    "always",
];
const PHRASES: &[&str] = &[
    "in the early morning",
    "at the end of the day",
    "as a matter of fact",
    "for a long time",
    "without a sound",
    "under the grey sky",
];
/// Openers in story order: a document's sentences use them in this order.
const OPENERS: &[&str] = &["first", "then", "after that", "later", "finally"];

fn pick<'a, T>(rng: &mut ChaCha8Rng, items: &'a [T]) -> &'a T {
    &items[rng.random_range(0..items.len())]
}

fn sentence(rng: &mut ChaCha8Rng, topic: &Topic, subject: usize, plural: bool, i: usize) -> String {
    let (sg, pl) = topic.nouns[subject];
    let (verb_sg, verb_pl, prep) = *pick(rng, VERBS);
    let verb = if plural { verb_pl } else { verb_sg };
    let (osg, opl) = *pick(rng, topic.nouns);
    let object = if rng.random::<bool>() { osg } else { opl };
    let opener = OPENERS[i.min(OPENERS.len() - 1)];
    let subject_words = if i > 0 && rng.random::<f64>() < 0.4 {
        (if plural { "they" } else { "it" }).to_string()
    } else {
        format!(
            "the {} {}",
            pick(rng, ADJECTIVES),
            if plural { pl } else { sg }
        )
    };
    let mut s = format!(
        "{opener} {subject_words} {verb} {} {prep} the {object}",
        pick(rng, ADVERBS)
    );
    if rng.random::<f64>() < 0.5 {
        s.push_str(&format!(" in the {}", pick(rng, topic.places)));
    }
    if rng.random::<f64>() < 0.3 {
        s.push_str(&format!(" {}", pick(rng, PHRASES)));
    }
    s.push('.');
    s
}

/// `count` documents of 3–5 sentences each, the same for the same seed.
///
/// ```
/// let docs = burn_megatron::data::synthetic_corpus(2, 7);
/// assert_eq!(docs, burn_megatron::data::synthetic_corpus(2, 7));
/// assert!(docs[0][0].starts_with("first "));
/// ```
pub fn synthetic_corpus(count: usize, seed: u64) -> Vec<Document> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let topic = pick(&mut rng, TOPICS);
            let subject = rng.random_range(0..topic.nouns.len());
            let plural = rng.random::<bool>();
            let sentences = rng.random_range(3..=OPENERS.len());
            (0..sentences)
                .map(|i| sentence(&mut rng, topic, subject, plural, i))
                .collect()
        })
        .collect()
}

/// Every word the generator writes, the full stop, and the letters alone and as `##`
/// continuations (so unseen text still tokenizes): a fixed WordPiece vocabulary for
/// [`synthetic_corpus`], sorted.
pub fn synthetic_vocabulary() -> Vec<String> {
    let mut words: Vec<String> = TOPICS
        .iter()
        .flat_map(|t| {
            t.nouns
                .iter()
                .flat_map(|(s, p)| [*s, *p])
                .chain(t.places.iter().copied())
        })
        .chain(VERBS.iter().flat_map(|(s, p, prep)| [*s, *p, *prep]))
        .chain(
            ADJECTIVES
                .iter()
                .chain(ADVERBS)
                .chain(PHRASES)
                .chain(OPENERS)
                .copied(),
        )
        .flat_map(|w| w.split(' '))
        .chain(["the", "it", "they", "in", "."])
        .map(str::to_string)
        .chain(('a'..='z').flat_map(|c| [c.to_string(), format!("##{c}")]))
        .collect();
    words.sort();
    words.dedup();
    words
}

/// Splits text into sentences at `.`, `!` and `?` followed by whitespace.
fn split_sentences(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut start = 0;
    let bytes = text.as_bytes();
    for (i, &c) in bytes.iter().enumerate() {
        let ends = matches!(c, b'.' | b'!' | b'?')
            && bytes.get(i + 1).is_none_or(|n| n.is_ascii_whitespace());
        if ends {
            out.push(text[start..=i].trim().to_string());
            start = i + 1;
        }
    }
    out.push(text[start..].trim().to_string());
    out.retain(|s| !s.is_empty());
    out
}

/// Reads a corpus: `.jsonl` files hold one document per line as `{"text": "..."}`; any
/// other file holds plain text with documents separated by blank lines. Sentences are split
/// at `.`, `!` and `?`. Documents with fewer than two sentences are dropped (a sentence
/// pair needs two).
pub fn load_corpus(path: &Path) -> Result<Vec<Document>, DataError> {
    let text = std::fs::read_to_string(path).map_err(|e| DataError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    let raw: Vec<String> = if path.extension().is_some_and(|e| e == "jsonl") {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, line)| {
                let value: serde_json::Value =
                    serde_json::from_str(line).map_err(|e| DataError::Format {
                        path: path.display().to_string(),
                        message: format!("line {}: {e}", i + 1),
                    })?;
                value["text"]
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| DataError::Format {
                        path: path.display().to_string(),
                        message: format!("line {}: no string field \"text\"", i + 1),
                    })
            })
            .collect::<Result<_, _>>()?
    } else {
        text.split("\n\n").map(str::to_string).collect()
    };
    let docs: Vec<Document> = raw
        .iter()
        .map(|d| split_sentences(d))
        .filter(|d| d.len() >= 2)
        .collect();
    if docs.is_empty() {
        return Err(DataError::Format {
            path: path.display().to_string(),
            message: "no document with at least two sentences".into(),
        });
    }
    Ok(docs)
}

#[cfg(test)]
mod tests;
