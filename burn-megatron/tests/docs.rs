//! The README and the book (`docs/`) stay short, linked and compiled.
//!
//! Code in the docs is never written by hand: a book page includes a region of a file that CI
//! compiles (mdBook's `{{#include file:anchor}}`, the lines between `// ANCHOR: name` and
//! `// ANCHOR_END: name`), and a Rust block in the README is a copy of such a region that
//! this test compares line for line. So when the code changes, the docs change with it or
//! this test fails. Only std is used, so the test links no Burn and builds in seconds.

use std::path::{Component, Path, PathBuf};

const README_MAX_LINES: usize = 300;

fn repo() -> PathBuf {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    Path::new(root).canonicalize().unwrap()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A path relative to the repository, for messages.
fn rel(path: &Path) -> String {
    format!("{}", path.strip_prefix(repo()).unwrap_or(path).display())
}

/// Every `.md` file under `docs/src`, sorted.
fn book_pages() -> Vec<PathBuf> {
    let (mut pages, mut dirs) = (Vec::new(), vec![repo().join("docs/src")]);
    while let Some(dir) = dirs.pop() {
        for path in std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()) {
            match path.extension() {
                _ if path.is_dir() => dirs.push(path),
                Some(ext) if ext == "md" => pages.push(path),
                _ => {}
            }
        }
    }
    pages.sort();
    pages
}

/// The ```rust blocks of a Markdown text: the 1-based line of each opening fence, and the
/// lines inside.
fn rust_blocks(text: &str) -> Vec<(usize, Vec<&str>)> {
    let (mut out, mut inside) = (Vec::<(usize, Vec<&str>)>::new(), None);
    for (i, line) in text.lines().enumerate() {
        match (line.trim_start().strip_prefix("```"), inside) {
            (Some(_), Some(_)) => inside = None,
            (Some(info), None) => {
                let rust = info.split(',').next().map(str::trim) == Some("rust");
                out.extend(rust.then(|| (i + 1, Vec::new())));
                inside = Some(rust);
            }
            (None, Some(true)) => out.last_mut().unwrap().1.push(line),
            (None, _) => {}
        }
    }
    out
}

/// `(FILE, ANCHOR)` out of a line `{open}FILE:ANCHOR{close}`.
fn source<'a>(line: &'a str, open: &str, close: &str) -> Option<(&'a str, &'a str)> {
    let inner = line.trim().strip_prefix(open)?.strip_suffix(close)?;
    inner.rsplit_once(':')
}

/// Whether `line` is the marker `KIND: name` of exactly `name`, as mdBook reads it.
fn has_marker(line: &str, kind: &str, name: &str) -> bool {
    let words: Vec<&str> = line.split_whitespace().collect();
    let kind = format!("{kind}:");
    words.windows(2).any(|w| w[0] == kind && w[1] == name)
}

/// The lines of `file` between its `ANCHOR: name` and `ANCHOR_END: name` lines, without
/// the marker lines of other anchors (as mdBook includes them).
fn region(file: &Path, name: &str) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", rel(file)))?;
    let lines: Vec<&str> = text.lines().collect();
    let find = |kind| lines.iter().position(|l| has_marker(l, kind, name));
    let marker = |l: &&&str| l.contains("ANCHOR: ") || l.contains("ANCHOR_END: ");
    match (find("ANCHOR"), find("ANCHOR_END")) {
        (Some(start), Some(end)) if start < end => {
            let kept = lines[start + 1..end].iter().filter(|l| !marker(l));
            Ok(kept.map(|l| l.to_string()).collect())
        }
        _ => Err(format!("{} has no ANCHOR/ANCHOR_END {name}", rel(file))),
    }
}

/// A region as the README shows it: a doctest's `///` or `//!` markers and the common
/// indentation removed.
fn dedent(lines: Vec<String>) -> Vec<String> {
    let undoc = |l: &String| {
        let t = l.trim_start();
        let rest = t.strip_prefix("///").or_else(|| t.strip_prefix("//!"))?;
        Some(rest.strip_prefix(' ').unwrap_or(rest).to_string())
    };
    let undone: Option<Vec<String>> = lines.iter().map(undoc).collect();
    let lines = undone.unwrap_or(lines);
    let indent = |l: &&String| l.len() - l.trim_start().len();
    let text = lines.iter().filter(|l| !l.trim().is_empty());
    let cut = text.map(|l| indent(&l)).min();
    let strip = |l: &String| l.get(cut.unwrap_or(0)..).unwrap_or("").to_string();
    lines.iter().map(strip).collect()
}

/// `path` joined onto `dir` with `.` and `..` resolved, or `None` when it is absolute or
/// climbs out of the repository.
fn resolve(dir: &Path, path: &str) -> Option<PathBuf> {
    let (root, mut out) = (repo(), dir.to_path_buf());
    for c in Path::new(path).components() {
        match c {
            Component::Normal(part) => out.push(part),
            Component::ParentDir if out != root => _ = out.pop(),
            Component::CurDir => {}
            _ => return None,
        }
    }
    out.starts_with(&root).then_some(out)
}

/// Every inline link target `](target)` outside code, with its 1-based line.
fn links(text: &str) -> Vec<(usize, String)> {
    let (mut out, mut in_fence) = (Vec::new(), false);
    for (i, line) in text.lines().enumerate() {
        in_fence ^= line.trim_start().starts_with("```");
        // Text between backticks is code, not a link.
        let prose = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        for (at, _) in prose.match_indices("](").filter(|_| !in_fence) {
            let target = prose[at + 2..].split([')', ' ']).next().unwrap_or("");
            out.push((i + 1, target.to_string()));
        }
    }
    out
}

fn assert_none(problems: Vec<String>) {
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

#[test]
fn the_readme_is_at_most_300_lines() {
    let lines = read(&repo().join("README.md")).lines().count();
    let fix = "move the rest into the book (docs/src)";
    assert!(lines <= README_MAX_LINES, "README.md: {lines} lines; {fix}");
}

#[test]
fn every_rust_block_in_the_book_includes_an_anchored_region() {
    let mut problems = Vec::new();
    for page in book_pages() {
        let text = read(&page);
        for (line, body) in rust_blocks(&text) {
            let at = format!("{}:{line}", rel(&page));
            let include = match body.as_slice() {
                [one] => source(one, "{{#include ", "}}"),
                _ => None,
            };
            let Some((path, anchor)) = include else {
                problems.push(format!("{at}: not one {{{{#include FILE:ANCHOR}}}} line"));
                continue;
            };
            let file = resolve(page.parent().unwrap(), path);
            let found = file.ok_or(format!("{path} is outside the repository"));
            if let Err(e) = found.and_then(|file| region(&file, anchor)) {
                problems.push(format!("{at}: {e}"));
            }
        }
    }
    assert_none(problems);
}

/// A README block (its fence on `line`) against the region that the `<!-- include:
/// FILE:ANCHOR -->` line before it names: `Err` says where they differ.
fn readme_block(text: &str, line: usize, body: &[&str]) -> Result<(), String> {
    let above: Vec<&str> = text.lines().take(line - 1).collect();
    let comment = above.iter().rev().find(|l| !l.trim().is_empty());
    let source = comment.and_then(|l| source(l, "<!-- include: ", " -->"));
    let Some((path, anchor)) = source else {
        let fix = "put <!-- include: FILE:ANCHOR --> before it";
        return Err(format!("{line}: {fix}"));
    };
    if !path.starts_with("examples/") && !path.starts_with("burn-megatron/src/") {
        let fix = "name a file in examples/ or burn-megatron/src/";
        return Err(format!("{line}: {path}: {fix}"));
    }
    let region = region(&repo().join(path), anchor).map_err(|e| format!("{line}: {e}"))?;
    let expected = dedent(region);
    let n = expected.len().max(body.len());
    let differs = |&i: &usize| expected.get(i).map(String::as_str) != body.get(i).copied();
    let Some(i) = (0..n).find(differs) else {
        return Ok(());
    };
    let (at, want, got) = (line + 1 + i, expected.get(i), body.get(i));
    Err(format!(
        "{at}: differs from {path}:{anchor} (its line {}): expected {want:?}, found {got:?}; \
         copy the region again",
        i + 1
    ))
}

#[test]
fn every_rust_block_in_the_readme_is_a_copy_of_an_anchored_region() {
    let text = read(&repo().join("README.md"));
    let blocks = rust_blocks(&text).into_iter();
    let errors = blocks.filter_map(|(line, body)| readme_block(&text, line, &body).err());
    assert_none(errors.map(|e| format!("README.md:{e}")).collect());
}

#[test]
fn every_relative_link_resolves_inside_the_repository() {
    let mut problems = Vec::new();
    for file in [vec![repo().join("README.md")], book_pages()].concat() {
        for (line, target) in links(&read(&file)) {
            let at = format!("{}:{line}", rel(&file));
            let path = target.split('#').next().unwrap_or("");
            let web = target.starts_with("http://") || target.starts_with("https://");
            if web || (path.is_empty() && target.starts_with('#')) {
                continue;
            }
            match resolve(file.parent().unwrap(), path) {
                None => problems.push(format!("{at}: `{target}` is outside the repository")),
                Some(p) if !p.exists() => problems.push(format!("{at}: `{target}`: no such file")),
                Some(_) => {}
            }
        }
    }
    assert_none(problems);
}

#[test]
fn the_summary_lists_every_page_of_the_book() {
    let src = repo().join("docs/src");
    let summary = src.join("SUMMARY.md");
    let (mut listed, mut problems) = (Vec::new(), Vec::new());
    for (line, target) in links(&read(&summary)) {
        match resolve(&src, &target).filter(|p| p.is_file()) {
            Some(p) => listed.push(p),
            None => problems.push(format!("docs/src/SUMMARY.md:{line}: no page `{target}`")),
        }
    }
    for page in book_pages() {
        if page != summary && !listed.contains(&page) {
            problems.push(format!("{}: not listed in docs/src/SUMMARY.md", rel(&page)));
        }
    }
    assert_none(problems);
}
