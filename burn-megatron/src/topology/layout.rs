//! Megatron-Core's `--pipeline-model-parallel-layout`: the layers of every virtual pipeline
//! stage, written out.

use super::TopologyError;
use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;

/// What each virtual pipeline stage holds, as Megatron-Core's
/// `--pipeline-model-parallel-layout` writes it: stages separated by `|`, in virtual-stage
/// order (`chunk·P + pipeline_rank`), each a run of `E` (the embedding), `t` (a transformer
/// layer) and `L` (the output layer and loss). `x*n` repeats a letter, `(…)*n` a group
/// (stage separators included), and commas are cosmetic. The embedding must come first and
/// the loss last, once each; a stage may hold no transformer layer. The number of stages is
/// `P·V`, so the layout also sets the virtual pipeline size.
///
/// ```
/// use burn_megatron::topology::PipelineLayout;
/// // The embedding alone on the first stage, the loss with one layer on the last.
/// let layout: PipelineLayout = "E|t*3|(tt|)*2,tL".parse().unwrap();
/// assert_eq!(layout.layers_per_virtual_stage(), &[0, 3, 2, 2, 1]);
/// assert!("Ett|tL|E".parse::<PipelineLayout>().is_err());
/// ```
///
/// A handle, `Copy` as the [`LayerSplit`](super::LayerSplit) and the pipeline positions that
/// carry it are: each distinct layout is parsed into storage kept for the life of the process
/// (a layout is configuration, parsed a few times per run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PipelineLayout(&'static Parsed);

#[derive(Debug, PartialEq, Eq, Hash)]
struct Parsed {
    /// As the user wrote it.
    text: String,
    /// Transformer layers of each virtual stage.
    layers: Vec<usize>,
}

/// Every layout parsed so far, so that parsing one again keeps nothing more.
static PARSED: Mutex<Vec<&'static Parsed>> = Mutex::new(Vec::new());

impl PipelineLayout {
    /// The layout `text` describes.
    ///
    /// # Errors
    ///
    /// A letter other than `E`, `t`, `L` (`m`, Megatron's multi-token prediction layer, is
    /// not built here), an unbalanced group, a repetition of nothing, and an embedding or a
    /// loss that is not once, first (last).
    pub fn parse(text: &str) -> Result<Self, TopologyError> {
        let invalid = |reason: String| TopologyError::InvalidPipelineLayout {
            layout: text.to_string(),
            reason,
        };
        let chars: Vec<char> = text.chars().filter(|c| *c != ',').collect();
        let (unrolled, rest) = unroll(&chars, 0, false).map_err(invalid)?;
        if rest != chars.len() {
            return Err(invalid("a `)` closes no group".into()));
        }
        let letters: String = unrolled.iter().filter(|c| **c != '|').collect();
        if let Some(bad) = letters.chars().find(|c| !matches!(c, 'E' | 't' | 'L')) {
            let why = match bad {
                'm' => "multi-token prediction layers (`m`) are not built by this library",
                _ => "the layers are `E` (embedding), `t` (transformer layer) and `L` (loss)",
            };
            return Err(invalid(format!("`{bad}`: {why}")));
        }
        let once = |c: char| letters.chars().filter(|x| *x == c).count() == 1;
        if !(letters.starts_with('E') && once('E')) {
            return Err(invalid("the embedding `E` must come first, once".into()));
        }
        if !(letters.ends_with('L') && once('L')) {
            return Err(invalid("the loss `L` must come last, once".into()));
        }
        let layers = unrolled
            .split(|c| *c == '|')
            .map(|stage| stage.iter().filter(|c| **c == 't').count())
            .collect();
        let parsed = Parsed {
            text: text.to_string(),
            layers,
        };
        // A panic elsewhere while holding the lock leaves the list whole: use it as it is.
        let mut all = PARSED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(same) = all.iter().find(|p| ***p == parsed) {
            return Ok(Self(same));
        }
        let kept: &'static Parsed = Box::leak(Box::new(parsed));
        all.push(kept);
        Ok(Self(kept))
    }

    /// Transformer layers of each virtual stage, in virtual-stage order.
    pub fn layers_per_virtual_stage(&self) -> &'static [usize] {
        &self.0.layers
    }

    /// The virtual stages, `P·V`.
    pub fn num_stages(&self) -> usize {
        self.0.layers.len()
    }

    /// The error a check of this layout against the pipeline or the model gives.
    pub(super) fn invalid(&self, reason: String) -> TopologyError {
        TopologyError::InvalidPipelineLayout {
            layout: self.to_string(),
            reason,
        }
    }

    /// The transformer layers of every stage together.
    pub fn num_layers(&self) -> usize {
        self.0.layers.iter().sum()
    }
}

/// The letters and `|`s of `chars[start..]` with every repetition unrolled, up to the `)`
/// that closes the group it is `in_group` (or the end), and where it stopped. Groups do not
/// nest, as in Megatron-Core.
fn unroll(chars: &[char], start: usize, in_group: bool) -> Result<(Vec<char>, usize), String> {
    let mut out: Vec<char> = Vec::new();
    let mut i = start;
    while i < chars.len() {
        let unit = match chars[i] {
            ')' => break,
            '(' if in_group => return Err("groups `(…)*n` do not nest".into()),
            '(' if chars.get(i + 1) == Some(&')') => return Err("an empty group `()`".into()),
            '(' => {
                let (inner, end) = unroll(chars, i + 1, true)?;
                if chars.get(end) != Some(&')') {
                    return Err("a `(` is not closed".into());
                }
                i = end + 1;
                let (times, next) = repeat(chars, i)?.ok_or("a group `(…)` needs `*n` after it")?;
                i = next;
                too_many(inner.len(), times, out.len())?;
                inner.repeat(times)
            }
            '*' => return Err("`*` repeats nothing".into()),
            c => {
                i += 1;
                match repeat(chars, i)? {
                    Some((times, next)) => {
                        i = next;
                        too_many(1, times, out.len())?;
                        vec![c; times]
                    }
                    None => vec![c],
                }
            }
        };
        too_many(unit.len(), 1, out.len())?;
        out.extend(unit);
    }
    Ok((out, i))
}

/// Refuses a layout that would unroll past a million letters, before it is unrolled.
fn too_many(unit: usize, times: usize, so_far: usize) -> Result<(), String> {
    match unit.checked_mul(times).and_then(|n| n.checked_add(so_far)) {
        Some(n) if n <= 1 << 20 => Ok(()),
        _ => Err("it unrolls to more than a million layers".into()),
    }
}

/// The count of a `*n` at `chars[i..]` and where it ends; none without a `*` and digits.
fn repeat(chars: &[char], i: usize) -> Result<Option<(usize, usize)>, String> {
    if chars.get(i) != Some(&'*') {
        return Ok(None);
    }
    let digits = chars[i + 1..]
        .iter()
        .take_while(|c| c.is_ascii_digit())
        .count();
    if digits == 0 {
        return Ok(None);
    }
    let n: String = chars[i + 1..i + 1 + digits].iter().collect();
    let times = n
        .parse()
        .map_err(|_| format!("the repetition `*{n}` is too large"))?;
    Ok(Some((times, i + 1 + digits)))
}

impl FromStr for PipelineLayout {
    type Err = TopologyError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

impl fmt::Display for PipelineLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.text)
    }
}
