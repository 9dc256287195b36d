//! The layering of `docs/architecture.md` holds: within each crate a top-level module uses
//! only the modules listed below it, every module is listed, and no two sibling modules (at
//! any depth) use each other. Crates are held by their `Cargo.toml`; this holds the modules.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module by its path from the crate root (`["train", "steps"]`).
type Module = Vec<String>;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Each crate's levels, top first, as `docs/architecture.md` lists them in its layering
/// block: `crate: a > b, c > d`.
fn documented_layering() -> BTreeMap<String, Vec<Vec<String>>> {
    let text = std::fs::read_to_string(workspace().join("docs/architecture.md")).unwrap();
    let start = text
        .find("```layering")
        .expect("docs/architecture.md has a ```layering block");
    let block = &text[start + "```layering".len()..];
    let block = &block[..block.find("```").expect("the layering block is closed")];
    block
        .lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(krate, levels)| {
            let levels = levels
                .split('>')
                .map(|level| level.split(',').map(|m| m.trim().to_owned()).collect())
                .collect();
            (krate.trim().to_owned(), levels)
        })
        .collect()
}

/// Every module of the crate at `src` and its file.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut found = BTreeMap::new();
    let mut pending = vec![src.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(src).unwrap().with_extension("");
            let mut module: Module = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                module.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                module.pop();
            }
            if module.first().is_some_and(|first| first == "bin") {
                continue;
            }
            found.insert(module, path);
        }
    }
    found
}

/// The code of `path` before its unit tests, comments removed.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = match text.find("#[cfg(test)]") {
        Some(tests) => &text[..tests],
        None => &text,
    };
    text.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules `module` refers to: `crate::x...` (also inside `crate::{x, y}`) and its
/// siblings through `super::x`.
fn references(module: &Module, code: &str, all: &BTreeMap<Module, PathBuf>) -> BTreeSet<Module> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end]
                .split(',')
                .map(|part| part.trim().split("::").next().unwrap_or(""))
                .collect()
        } else {
            vec![identifier(rest)]
        };
        for name in names {
            let target = vec![name.to_owned()];
            if all.contains_key(&target) {
                found.insert(target);
            }
        }
    }
    let parent = &module[..module.len().saturating_sub(1)];
    let mut rest = code;
    while let Some(at) = rest.find("super::") {
        rest = &rest[at + "super::".len()..];
        let mut sibling = parent.to_vec();
        sibling.push(identifier(rest).to_owned());
        if sibling != *module && all.contains_key(&sibling) {
            found.insert(sibling);
        }
    }
    found
}

fn identifier(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The edges between sibling subtrees: `a` uses something in `b`, both children of one
/// module.
fn sibling_edges(krate: &Path) -> BTreeSet<(Module, Module)> {
    let all = modules(&krate.join("src"));
    let mut edges = BTreeSet::new();
    for (module, path) in &all {
        if module.iter().any(|part| part.contains("test")) {
            continue;
        }
        for target in references(module, &code(path), &all) {
            let shared = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if shared >= module.len() || shared >= target.len() {
                continue; // within its own subtree, or its ancestor
            }
            edges.insert((module[..=shared].to_vec(), target[..=shared].to_vec()));
        }
    }
    edges
}

#[test]
fn every_crate_keeps_the_documented_layering() {
    let layering = documented_layering();
    assert!(layering.len() >= 7, "{layering:?}");
    let mut broken = Vec::new();
    for (krate, levels) in &layering {
        let dir = workspace().join("crates").join(krate);
        let level_of: BTreeMap<&str, usize> = levels
            .iter()
            .enumerate()
            .flat_map(|(level, modules)| modules.iter().map(move |m| (m.as_str(), level)))
            .collect();
        for module in modules(&dir.join("src")).keys() {
            let Some(top) = module.first() else { continue };
            if !top.contains("test") && !level_of.contains_key(top.as_str()) {
                broken.push(format!("{krate}: `{top}` is not in the layering"));
            }
        }
        for (from, to) in sibling_edges(&dir) {
            if from.len() != 1 {
                continue;
            }
            let (Some(&above), Some(&below)) =
                (level_of.get(from[0].as_str()), level_of.get(to[0].as_str()))
            else {
                continue;
            };
            if above >= below {
                broken.push(format!(
                    "{krate}: `{}` uses `{}`, which is not below it",
                    from[0], to[0]
                ));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn no_two_modules_use_each_other() {
    let mut cycles = Vec::new();
    for entry in std::fs::read_dir(workspace().join("crates")).unwrap() {
        let krate = entry.unwrap().path();
        let edges = sibling_edges(&krate);
        for (a, b) in &edges {
            if a < b && edges.contains(&(b.clone(), a.clone())) {
                cycles.push(format!(
                    "{}: {} <-> {}",
                    krate.display(),
                    a.join("::"),
                    b.join("::")
                ));
            }
        }
    }
    assert!(cycles.is_empty(), "{}", cycles.join("\n"));
}
