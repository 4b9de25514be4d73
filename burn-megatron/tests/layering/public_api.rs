//! One public way in per concept, read from the sources as the layering checks are: no item
//! is public under two paths, no two public names differ by case only, `lib.rs`'s module map
//! names every module, and no public item is hidden from the docs (test hooks sit behind the
//! `test-hooks` feature instead).

use super::{Source, sources};
use std::collections::{BTreeMap, BTreeSet};

/// A module's path from the crate root, and its code.
type Module = (Vec<String>, String);

/// A module's code with its inline `mod name { … }` blocks split out as modules of their own.
fn split_inline(module: &[String], code: &str, out: &mut Vec<Module>) {
    let mut own = String::new();
    let mut rest = code;
    while let Some((at, name, body_start)) = next_inline_mod(rest) {
        own.push_str(&rest[..at]);
        let body = &rest[body_start..];
        let end = matching_brace(body);
        let mut child = module.to_vec();
        child.push(name.clone());
        own.push_str(&format!(
            "{}mod {name};",
            &rest[at..at + pub_prefix(&rest[at..])]
        ));
        split_inline(&child, &body[..end], out);
        rest = &body[(end + 1).min(body.len())..];
    }
    own.push_str(rest);
    out.push((module.to_vec(), own));
}

/// The length of `pub ` at the start of `s`, if it is there.
fn pub_prefix(s: &str) -> usize {
    if s.starts_with("pub ") { 4 } else { 0 }
}

/// The next `mod name {` at the start of a line: its offset, name, and where its body begins.
fn next_inline_mod(code: &str) -> Option<(usize, String, usize)> {
    let mut offset = 0;
    for line in code.split_inclusive('\n') {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let decl = trimmed.strip_prefix("pub ").unwrap_or(trimmed);
        if let Some(rest) = decl.strip_prefix("mod ")
            && let Some(name) = rest.trim_end().strip_suffix('{')
        {
            let brace = offset + line.find('{').unwrap_or(0);
            return Some((offset + indent, name.trim().to_string(), brace + 1));
        }
        offset += line.len();
    }
    None
}

/// Where the brace closing a block that starts just after its `{` is.
fn matching_brace(body: &str) -> usize {
    let mut depth = 1usize;
    for (k, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    body.len()
}

/// Each file's module and code.
fn files() -> Vec<Module> {
    sources()
        .into_iter()
        .map(|Source { module, code, .. }| (module, code))
        .collect()
}

/// Every module with its own code (inline ones split out), and which modules are `pub`.
fn modules(files: &[Module]) -> (Vec<Module>, BTreeSet<Vec<String>>) {
    let mut split = Vec::new();
    for (module, code) in files {
        split_inline(module, code, &mut split);
    }
    let mut public = BTreeSet::from([Vec::new()]);
    for (module, code) in &split {
        for line in code.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("pub mod ") {
                let mut child = module.clone();
                child.push(rest.trim_end_matches(';').trim().to_string());
                public.insert(child);
            }
        }
    }
    (split, public)
}

/// Whether every module on the way to `module` is public.
fn reachable(module: &[String], public: &BTreeSet<Vec<String>>) -> bool {
    (0..=module.len()).all(|k| public.contains(&module[..k].to_vec()))
}

/// The `pub use` statements of a module's code, each as one line.
fn pub_uses(code: &str) -> Vec<String> {
    let mut uses = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("pub use ") {
        let after = &rest[at + "pub use ".len()..];
        let end = after.find(';').unwrap_or(after.len());
        uses.push(
            after[..end]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" "),
        );
        rest = &after[end..];
    }
    uses
}

/// A use tree's leaves: each path's segments and the name it is exported as.
fn leaves(tree: &str) -> Vec<Module> {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let prefix: Vec<String> = segments(&tree[..open]);
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let mut out = Vec::new();
        for part in split_top(inner) {
            for (mut path, name) in leaves(&part) {
                let mut full = prefix.clone();
                full.append(&mut path);
                out.push((full, name));
            }
        }
        return out;
    }
    let (path, alias) = match tree.split_once(" as ") {
        Some((p, a)) => (p, Some(a.trim().to_string())),
        None => (tree, None),
    };
    let path = segments(path);
    let name = alias.unwrap_or_else(|| path.last().cloned().unwrap_or_default());
    vec![(path, name)]
}

fn segments(path: &str) -> Vec<String> {
    path.split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// `a, b::{c, d}, e` split at the commas outside braces.
fn split_top(s: &str) -> Vec<String> {
    let (mut out, mut depth, mut current) = (Vec::new(), 0i32, String::new());
    for c in s.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    out.push(current);
    out.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

/// The module a re-exported path names its item from, from the crate root; `None` for
/// another crate.
fn source_module(
    from: &[String],
    path: &[String],
    known: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let (first, rest) = path.split_first()?;
    let mut base = match first.as_str() {
        "crate" => Vec::new(),
        "self" => from.to_vec(),
        "super" => from[..from.len().saturating_sub(1)].to_vec(),
        child => {
            let mut m = from.to_vec();
            m.push(child.to_string());
            if !known.contains(&m) {
                return None;
            }
            m
        }
    };
    let mut rest = rest.to_vec();
    rest.pop();
    for seg in rest {
        match seg.as_str() {
            "super" => {
                base.pop();
            }
            _ => base.push(seg),
        }
    }
    Some(base)
}

/// Items public under two paths: a `pub use` in a public module of an item whose own module
/// is public too.
fn exported_twice(files: &[Module]) -> Vec<String> {
    let (split, public) = modules(files);
    let known: BTreeSet<Vec<String>> = split.iter().map(|(m, _)| m.clone()).collect();
    let mut found = Vec::new();
    for (module, code) in &split {
        if !reachable(module, &public) {
            continue;
        }
        for tree in pub_uses(code) {
            for (path, name) in leaves(&tree) {
                let Some(source) = source_module(module, &path, &known) else {
                    continue;
                };
                if source != *module && reachable(&source, &public) {
                    found.push(format!(
                        "`{name}` is public as crate::{}::{name} and as crate::{}",
                        module.join("::"),
                        path.join("::").trim_start_matches("crate::"),
                    ));
                }
            }
        }
    }
    found
}

/// The public type names of the crate's public modules (structs, enums, traits, type
/// aliases, and re-exported names in CamelCase), by their lowercase spelling.
fn public_type_names(files: &[Module]) -> BTreeMap<String, BTreeSet<String>> {
    let (split, public) = modules(files);
    let mut names: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, code) in split.iter().filter(|(m, _)| reachable(m, &public)) {
        let mut add = |name: String| {
            if !name.starts_with(|c: char| c.is_ascii_uppercase()) {
                return;
            }
            let path = format!("{}::{name}", module.join("::"));
            names.entry(name.to_lowercase()).or_default().insert(path);
        };
        let mut depth = 0i32;
        for line in code.lines() {
            if depth == 0 {
                let decl = line.trim_start();
                for kind in ["pub struct ", "pub enum ", "pub trait ", "pub type "] {
                    if let Some(rest) = decl.strip_prefix(kind) {
                        let name: String = rest
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        add(name);
                    }
                }
            }
            depth += line.matches('{').count() as i32 - line.matches('}').count() as i32;
        }
        for tree in pub_uses(code) {
            for (_, name) in leaves(&tree) {
                add(name);
            }
        }
    }
    names
}

/// Public type names that differ by case only (`GptDataset` and `GPTDataset`).
fn case_clashes(files: &[Module]) -> Vec<String> {
    public_type_names(files)
        .into_values()
        .filter(|paths| {
            let spellings: BTreeSet<&str> = paths
                .iter()
                .map(|p| p.rsplit("::").next().unwrap_or(p))
                .collect();
            spellings.len() > 1
        })
        .map(|paths| paths.into_iter().collect::<Vec<_>>().join(" vs "))
        .collect()
}

#[test]
fn no_item_is_public_under_two_paths() {
    let found = exported_twice(&files());
    assert!(found.is_empty(), "exported twice:\n{}", found.join("\n"));
}

#[test]
fn no_two_public_type_names_differ_by_case_only() {
    let clashes = case_clashes(&files());
    assert!(
        clashes.is_empty(),
        "names differing by case only:\n{}",
        clashes.join("\n")
    );
}

#[test]
fn the_module_map_in_lib_rs_names_every_module() {
    let lib = std::fs::read_to_string(super::src().join("lib.rs")).unwrap();
    let docs: String = lib.lines().filter(|l| l.starts_with("//!")).collect();
    let missing: Vec<&str> = lib
        .lines()
        .filter_map(|l| {
            l.strip_prefix("pub mod ")
                .or_else(|| l.strip_prefix("mod "))
        })
        .map(|m| m.trim_end_matches(';'))
        .filter(|m| !docs.contains(&format!("`{m}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "lib.rs's module map misses: {missing:?}"
    );
}

#[test]
fn no_public_item_is_hidden_from_the_docs() {
    let hidden: Vec<String> = sources()
        .iter()
        .filter(|s| s.code.contains("#[doc(hidden)]"))
        .map(|s| s.rel.display().to_string())
        .collect();
    assert!(
        hidden.is_empty(),
        "#[doc(hidden)] in {hidden:?}: put test hooks behind a feature"
    );
}

#[test]
fn the_checks_see_a_double_export_and_a_case_clash() {
    let file = |module: &[&str], code: &str| {
        (
            module.iter().map(|m| m.to_string()).collect::<Vec<_>>(),
            code.to_string(),
        )
    };
    let crate_files = [
        file(&[], "pub mod data;\npub mod models;\nmod private;\n"),
        file(&["data"], "pub mod megatron;\npub struct GptData;\n"),
        file(
            &["data", "megatron"],
            "pub struct GPTData;\npub fn split() {}\n",
        ),
        file(&["private"], "pub struct Hidden;\n"),
        file(
            &["models"],
            "pub use crate::data::{GptData, megatron::split};\npub use crate::private::Hidden;\n\
             pub mod advanced {\n    pub use super::super::private::Hidden as Again;\n}\n",
        ),
    ];
    let twice = exported_twice(&crate_files);
    assert_eq!(twice.len(), 2, "{twice:?}");
    assert!(
        twice[0].contains("`GptData`") && twice[1].contains("`split`"),
        "{twice:?}"
    );
    let clashes = case_clashes(&crate_files);
    assert_eq!(clashes.len(), 1, "{clashes:?}");
    assert!(clashes[0].contains("megatron::GPTData") && clashes[0].contains("data::GptData"));
    let names: Vec<String> = leaves("{b::{X, c::{Y as Z}}, crate::d::W}")
        .into_iter()
        .map(|(_, name)| name)
        .collect();
    assert_eq!(names, ["X", "Z", "W"]);
}
