//! The crate's modules import downwards only, the optimizer's files form no cycle, and the
//! public API has one way in per item ([`public_api`]).
//!
//! This reads the sources (the compiler does not forbid a cycle between modules of one
//! crate): every `crate::…` and `super::…` path outside test code is resolved to the
//! top-level module it names, and each top-level module may only name modules on a lower
//! level of [`LEVELS`]. Inside `optimizer/`, a path is resolved to the file that defines
//! the item it names, and the graph of those file references must be acyclic.

#[path = "layering/public_api.rs"]
mod public_api;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, bottom up. A module may import modules of lower levels only (not its own
/// level): the leaves, the collectives, the parallel layers, the models, data parallelism,
/// the optimizer and the pipeline, then what assembles a rank (its launch context, with its
/// pipeline channels), checkpoints, and drop-in conversion (a Burn model split by plans over
/// tensor-parallel layers and pipeline stages), and at the top the training object.
const LEVELS: &[&[&str]] = &[
    // Files read through a memory map, by the leaves above and the data sets.
    &["mapped_file"],
    &[
        "topology",
        "device",
        "module_path",
        "safetensors_io",
        "pytorch_io",
        "legacy_record",
        "shards",
        "grad_hooks",
        "activation",
        "aux_loss",
        "param_grads",
    ],
    &["comm"],
    &["tensor_parallel"],
    &["context_parallel", "moe"],
    &["recompute"],
    &["models"],
    &["data_parallel", "data"],
    &["optimizer", "pipeline"],
    &["launch", "checkpoint", "dropin"],
    &["training"],
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Test code may reach anywhere (tests of a layer run on the layers above it).
fn is_test_file(rel: &Path) -> bool {
    rel.components().any(|c| c.as_os_str() == "tests")
        || rel
            .file_stem()
            .and_then(|s| s.to_str())
            .is_some_and(|s| s == "tests" || s.ends_with("_tests"))
}

/// The module path of a file relative to `src/` (`optimizer/fused_adam/flat.rs` →
/// `[optimizer, fused_adam, flat]`; a `mod.rs` is its directory).
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_str().unwrap().to_string())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// `text` without comments, string literals and `#[cfg(test)]` items.
fn code_of(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            // A one-character literal such as '"' or '{'.
            i += 3;
        } else if c == '\'' && next == Some('\\') {
            i += 2;
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    strip_cfg_test(&out)
}

/// Removes each item under `#[cfg(test)]`: up to its `;` or its balanced braces.
fn strip_cfg_test(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at + "#[cfg(test)]".len()..];
        let (semi, brace) = (item.find(';'), item.find('{'));
        let end = match (semi, brace) {
            (Some(s), Some(b)) if s < b => s + 1,
            (Some(s), None) => s + 1,
            (_, Some(b)) => {
                let mut depth = 0usize;
                let mut end = item.len();
                for (k, ch) in item[b..].char_indices() {
                    match ch {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = b + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (None, None) => item.len(),
        };
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path the code names from `crate::` or `super::`, resolved against `module` and
/// expanded over `{…}` groups: each as its segments from the crate root.
fn crate_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let starts_ident = i == 0 || !is_ident_char(bytes[i - 1]) && bytes[i - 1] != ':';
        let word: String = bytes[i..]
            .iter()
            .take_while(|c| is_ident_char(**c))
            .collect();
        if starts_ident && (word == "crate" || word == "super") {
            let (mut base, mut j) = (Vec::new(), i);
            if word == "super" {
                base = module.to_vec();
                // `super` of a file module is its parent; repeated `super::` climbs.
                while bytes[j..].iter().collect::<String>().starts_with("super::") {
                    base.pop();
                    j += "super::".len();
                }
            } else {
                j += "crate".len();
                if !bytes[j..].iter().collect::<String>().starts_with("::") {
                    i = j;
                    continue;
                }
                j += 2;
            }
            let (tails, end) = path_tails(&bytes, j);
            for t in tails {
                let mut p = base.clone();
                p.extend(t);
                paths.push(p);
            }
            i = end.max(i + 1);
        } else {
            i += word.len().max(1);
        }
    }
    paths
}

/// The path segments from `at` (`a::b::{c, d::e}` gives `[a,b,c]` and `[a,b,d,e]`), and
/// where the path ends.
fn path_tails(s: &[char], mut at: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    loop {
        while s.get(at).is_some_and(|c| c.is_whitespace()) {
            at += 1;
        }
        if s.get(at) == Some(&'{') {
            at += 1;
            let mut all = Vec::new();
            loop {
                while s.get(at).is_some_and(|c| c.is_whitespace() || *c == ',') {
                    at += 1;
                }
                match s.get(at) {
                    None => return (all, at),
                    Some('}') => {
                        at += 1;
                        break;
                    }
                    _ => {
                        let (tails, end) = path_tails(s, at);
                        for t in tails {
                            let mut p = prefix.clone();
                            p.extend(t);
                            all.push(p);
                        }
                        // Past an `as` rename or anything else up to the next item.
                        at = end;
                        while s.get(at).is_some_and(|c| *c != ',' && *c != '}') {
                            at += 1;
                        }
                    }
                }
            }
            return (all, at);
        }
        let word: String = s[at..].iter().take_while(|c| is_ident_char(**c)).collect();
        if word.is_empty() {
            return (vec![prefix], at);
        }
        at += word.len();
        prefix.push(word);
        if s[at..].iter().take(2).collect::<String>() == "::" {
            at += 2;
        } else {
            return (vec![prefix], at);
        }
    }
}

struct Source {
    rel: PathBuf,
    module: Vec<String>,
    code: String,
}

fn sources() -> Vec<Source> {
    let root = src();
    rust_files(&root)
        .into_iter()
        .map(|path| {
            let rel = path.strip_prefix(&root).unwrap().to_path_buf();
            let text = std::fs::read_to_string(&path).unwrap();
            Source {
                module: module_of(&rel),
                code: code_of(&text),
                rel,
            }
        })
        .filter(|s| !is_test_file(&s.rel))
        .collect()
}

/// Each top-level module reaching a module at its own or a higher level, with the file
/// and path that does.
fn upward_imports(sources: &[Source]) -> Vec<String> {
    let level: BTreeMap<&str, usize> = LEVELS
        .iter()
        .enumerate()
        .flat_map(|(l, ms)| ms.iter().map(move |m| (*m, l)))
        .collect();
    let mut found = BTreeSet::new();
    for s in sources {
        let Some(from) = s.module.first() else {
            continue;
        };
        let from_level = *level
            .get(from.as_str())
            .unwrap_or_else(|| panic!("module `{from}` has no level in LEVELS"));
        for p in crate_paths(&s.code, &s.module) {
            let Some(to) = p.first() else { continue };
            if to == from {
                continue;
            }
            let Some(&to_level) = level.get(to.as_str()) else {
                continue;
            };
            if to_level >= from_level {
                found.insert(format!(
                    "{from} -> {to}: {} names crate::{}",
                    s.rel.display(),
                    p.join("::")
                ));
            }
        }
    }
    found.into_iter().collect()
}

/// Top-level items of a file that other files can name.
fn public_items(code: &str) -> Vec<String> {
    let mut items = Vec::new();
    for line in code.lines() {
        let Some(rest) = line.strip_prefix("pub") else {
            continue;
        };
        let rest = match rest.strip_prefix('(') {
            Some(r) => &r[r.find(')').map_or(0, |k| k + 1)..],
            None => rest,
        };
        let mut words = rest.split_whitespace();
        let kind = words.next().unwrap_or("");
        if matches!(
            kind,
            "struct" | "enum" | "trait" | "fn" | "type" | "const" | "static"
        ) && let Some(name) = words.next()
        {
            items.push(name.chars().take_while(|c| is_ident_char(*c)).collect());
        }
    }
    items
}

/// The file-level references among the optimizer's files: file → files it names (through
/// the items they define or their module names).
fn optimizer_file_graph(sources: &[Source]) -> BTreeMap<String, BTreeSet<String>> {
    let files: Vec<&Source> = sources
        .iter()
        .filter(|s| s.module.first().is_some_and(|m| m == "optimizer"))
        .collect();
    let name = |s: &Source| s.rel.display().to_string();
    let mut defined: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in &files {
        // A `mod.rs` re-exports; the items are where they are defined.
        if !s.rel.ends_with("mod.rs") {
            for item in public_items(&s.code) {
                defined.entry(item).or_default().insert(name(s));
            }
        }
    }
    let by_module: BTreeMap<Vec<String>, String> =
        files.iter().map(|s| (s.module.clone(), name(s))).collect();
    let mut graph = BTreeMap::new();
    for s in &files {
        let mut targets = BTreeSet::new();
        for p in crate_paths(&s.code, &s.module) {
            if p.first().is_none_or(|m| m != "optimizer") {
                continue;
            }
            // The longest prefix that is a file module, else the file defining the item.
            let file = (1..=p.len())
                .rev()
                .find_map(|k| by_module.get(&p[..k]).filter(|f| !f.ends_with("mod.rs")));
            match file {
                Some(f) => {
                    targets.insert(f.clone());
                }
                None => {
                    if let Some(files) = p.last().and_then(|last| defined.get(last)) {
                        targets.extend(files.iter().cloned());
                    }
                }
            }
        }
        targets.remove(&name(s));
        graph.insert(name(s), targets);
    }
    graph
}

/// Each cycle of `graph`, as the files around it (found by depth-first search).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<Vec<String>>,
    ) {
        if let Some(at) = stack.iter().position(|n| n == node) {
            found.push(stack[at..].to_vec());
            return;
        }
        if done.contains(node) {
            return;
        }
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, stack, done, found);
        }
        stack.pop();
        done.insert(node.to_string());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        visit(node, graph, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

/// Data parallelism, the optimizer and the pipeline run any model, the built-in ones and a
/// Burn user's: none of them names the built-in models, though their level would allow it.
const MODEL_AGNOSTIC: &[&str] = &["data_parallel", "optimizer", "pipeline"];

#[test]
fn the_training_machinery_names_no_built_in_model() {
    let sources = sources();
    let found: Vec<String> = sources
        .iter()
        .filter(|s| {
            s.module
                .first()
                .is_some_and(|m| MODEL_AGNOSTIC.contains(&m.as_str()))
        })
        .flat_map(|s| {
            crate_paths(&s.code, &s.module)
                .into_iter()
                .filter(|p| p.first().is_some_and(|m| m == "models"))
                .map(move |p| format!("{} names crate::{}", s.rel.display(), p.join("::")))
        })
        .collect();
    assert!(
        found.is_empty(),
        "model-agnostic modules naming the models:\n{}",
        found.join("\n")
    );
}

#[test]
fn modules_import_only_lower_layers() {
    let sources = sources();
    assert!(
        sources.len() > 50,
        "the sources were found: {}",
        sources.len()
    );
    let upward = upward_imports(&sources);
    assert!(
        upward.is_empty(),
        "imports running up the layers:\n{}",
        upward.join("\n")
    );
}

#[test]
fn optimizer_files_form_no_cycle() {
    let graph = optimizer_file_graph(&sources());
    // The graph is really seen: the optimizer wrapper names the fused optimizer's files.
    assert!(
        graph["optimizer/megatron.rs"].contains("optimizer/fused_adam/flat.rs"),
        "{graph:#?}"
    );
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "file-level cycles in optimizer/:\n{}",
        found
            .iter()
            .map(|c| c.join(" -> "))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The scanner itself: grouped imports, `super::` and test items.
#[test]
fn the_scanner_resolves_grouped_paths_and_skips_tests() {
    let code = code_of(
        "use crate::{comm::{Comm, ReduceOp}, topology};\n\
         use super::super::x::Y; // crate::nope\n\
         let s = \"crate::nope\";\n\
         #[cfg(test)]\nmod tests { use crate::nope; }\n\
         fn f() { crate::a::b(); }",
    );
    let module: Vec<String> = vec!["p".into(), "q".into(), "r".into()];
    let paths: Vec<String> = crate_paths(&code, &module)
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        paths,
        [
            "comm::Comm",
            "comm::ReduceOp",
            "topology",
            "p::x::Y",
            "a::b"
        ]
    );
}
