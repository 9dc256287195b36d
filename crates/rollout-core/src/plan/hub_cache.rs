//! `model_path` as a Hugging Face hub id (`"org/name"`), resolved in the local hub cache
//! without the network: the same lookup as `python_plugins.hub_cache`, so the planner reads
//! the `config.json` the policy will load.
//!
//! The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub`; a model lives in `models--org--name/snapshots/<commit>`,
//! the commit named by `models--org--name/refs/main`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// `path` itself when it names something on disk or is not shaped like a hub id; else the
/// cached snapshot of that hub id when there is one; else `path` (whose read then fails
/// naming it).
pub fn resolve(path: &Path) -> PathBuf {
    resolve_with(path, |name| std::env::var_os(name))
}

/// [`resolve`] with the environment read through `var`.
pub(super) fn resolve_with(path: &Path, var: impl Fn(&str) -> Option<OsString>) -> PathBuf {
    if path.exists() {
        return path.to_path_buf();
    }
    let Some(text) = path.to_str().filter(|text| is_hub_id(text)) else {
        return path.to_path_buf();
    };
    let Some(cache) = cache_dir(&var) else {
        return path.to_path_buf();
    };
    let (repo, revision) = text.split_once('@').unwrap_or((text, "main"));
    let model = cache.join(format!("models--{}", repo.replace('/', "--")));
    // A branch or tag in `refs/`, else the revision is the commit itself.
    let commit = std::fs::read_to_string(model.join("refs").join(revision))
        .map(|commit| commit.trim().to_owned())
        .unwrap_or_else(|_| revision.to_owned());
    if commit.is_empty() || !commit.chars().all(|c| c.is_ascii_alphanumeric()) {
        return path.to_path_buf();
    }
    let snapshot = model.join("snapshots").join(commit);
    if snapshot.is_dir() {
        snapshot
    } else {
        path.to_path_buf()
    }
}

/// `org/name` or `org/name@revision`: two non-empty parts of letters, digits, `-`, `_` and
/// `.`, neither starting with `.` (so `./model` and `../x` are paths, never hub ids).
pub(super) fn is_hub_id(text: &str) -> bool {
    let (text, revision) = text.split_once('@').unwrap_or((text, "x"));
    let plain = |part: &str| {
        part.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    if revision.is_empty() || revision.starts_with('.') || !plain(revision) {
        return false;
    }
    let mut parts = text.split('/');
    let (Some(org), Some(name), None) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    [org, name]
        .iter()
        .all(|part| !part.is_empty() && !part.starts_with('.') && plain(part))
}

fn cache_dir(var: &impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| {
        var(name)
            .filter(|value| !value.is_empty())
            .map(PathBuf::from)
    };
    if let Some(cache) = set("HF_HUB_CACHE") {
        return Some(cache);
    }
    if let Some(home) = set("HF_HOME") {
        return Some(home.join("hub"));
    }
    let base = set("XDG_CACHE_HOME").or_else(|| set("HOME").map(|home| home.join(".cache")))?;
    Some(base.join("huggingface").join("hub"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn cached(root: &Path, repo: &str, commit: &str) -> PathBuf {
        let model = root.join(format!("models--{}", repo.replace('/', "--")));
        let snapshot = model.join("snapshots").join(commit);
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(model.join("refs")).unwrap();
        std::fs::write(model.join("refs").join("main"), format!("{commit}\n")).unwrap();
        snapshot
    }

    fn env(pairs: &[(&str, &Path)]) -> impl Fn(&str) -> Option<OsString> + use<> {
        let pairs: Vec<(String, OsString)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_os_str().to_owned()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn a_hub_id_resolves_to_the_snapshot_refs_main_names() {
        let dir = tempfile::tempdir().unwrap();
        let hub = dir.path().join("hub");
        let snapshot = cached(&hub, "org/tiny-chat", "0123abcd");
        cached(&hub, "org/other", "ffff");
        let id = Path::new("org/tiny-chat");
        assert_eq!(resolve_with(id, env(&[("HF_HUB_CACHE", &hub)])), snapshot);
        // A revision: a commit of `snapshots/`.
        let pinned = Path::new("org/tiny-chat@0123abcd");
        assert_eq!(
            resolve_with(pinned, env(&[("HF_HUB_CACHE", &hub)])),
            snapshot
        );
        // HF_HOME/hub, then XDG_CACHE_HOME/huggingface/hub, then HOME/.cache/huggingface/hub.
        assert_eq!(resolve_with(id, env(&[("HF_HOME", dir.path())])), snapshot);
        let xdg = dir.path().join("xdg");
        let snapshot = cached(&xdg.join("huggingface").join("hub"), "org/tiny-chat", "77");
        assert_eq!(resolve_with(id, env(&[("XDG_CACHE_HOME", &xdg)])), snapshot);
        let home = dir.path().join("home");
        let snapshot = cached(&home.join(".cache/huggingface/hub"), "org/tiny-chat", "88");
        assert_eq!(resolve_with(id, env(&[("HOME", &home)])), snapshot);
    }

    #[test]
    fn paths_and_misses_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let hub = dir.path().join("hub");
        let vars = || env(&[("HF_HUB_CACHE", &hub)]);
        // Not cached, a missing snapshot, a hostile ref: the path as given.
        let id = Path::new("org/missing");
        assert_eq!(resolve_with(id, vars()), id);
        let snapshot = cached(&hub, "org/gone", "abc");
        std::fs::remove_dir(&snapshot).unwrap();
        assert_eq!(
            resolve_with(Path::new("org/gone"), vars()),
            Path::new("org/gone")
        );
        cached(&hub, "org/evil", "../../etc");
        assert_eq!(
            resolve_with(Path::new("org/evil"), vars()),
            Path::new("org/evil")
        );
        // A directory that exists wins over the cache.
        let local = dir.path().join("org");
        std::fs::create_dir_all(local.join("model")).unwrap();
        let existing = local.join("model");
        assert_eq!(resolve_with(&existing, vars()), existing);
        for text in [
            "./org/name",
            "../org",
            "/abs/path",
            "a/b/c",
            "org/",
            "/name",
            "org/.x",
        ] {
            assert!(!is_hub_id(text), "{text}");
        }
        assert!(is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") && is_hub_id("org/name@v1.0"));
        assert!(!is_hub_id("org/name@") && !is_hub_id("org/name@../x"));
    }

    #[test]
    fn the_planner_reads_a_cached_models_config() {
        let dir = tempfile::tempdir().unwrap();
        let hub = dir.path().join("hub");
        let snapshot = cached(&hub, "org/tiny", "c0ffee");
        let config = r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "max_position_embeddings": 128}"#;
        std::fs::write(snapshot.join("config.json"), config).unwrap();
        let resolved = resolve_with(Path::new("org/tiny"), env(&[("HF_HUB_CACHE", &hub)]));
        let shape = super::super::ModelShape::read(&resolved).unwrap();
        assert_eq!(shape.vocab_size, 64);
    }
}
