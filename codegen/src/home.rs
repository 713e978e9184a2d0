//! Where bbc keeps what it fetches and caches: `$BBC_HOME`, else `$XDG_CACHE_HOME/bbc`, else
//! `~/.cache/bbc`. Fetched models, the NVRTC wheel bbc installs and NVRTC's output cache live
//! under it.

use std::path::PathBuf;

pub fn dir() -> PathBuf {
    if let Some(home) = std::env::var_os("BBC_HOME") {
        return PathBuf::from(home);
    }
    if let Some(xdg) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(xdg).join("bbc");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("bbc")
}
