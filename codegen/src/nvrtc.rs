//! Compiling generated CUDA C with NVRTC (through cudarc, loaded at run time): PTX for the
//! artifact (`compute_XXa`), and a cubin (`sm_XXa`, where ptxas runs, so invalid instructions
//! fail and register use and spills are reported; the artifact keeps it too, and the CUDA
//! backend loads it before the PTX). Both are cached on disk (the cubin with ptxas's log),
//! keyed by source + options + architecture + NVRTC version.
//!
//! Where NVRTC comes from, in order: the loader path; `$BBC_NVRTC_DIR`; the PyPI wheel bbc
//! installs into its home (`crate::home`, `cuda/nvidia/cu13/lib`); a CUDA toolkit
//! (`$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`). `bbc` installs the wheel on first use
//! where none is found ([`WHEEL`]).

use cudarc::nvrtc::{result, sys};
use sha2::{Digest, Sha256};
use std::ffi::CString;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    #[error("NVRTC is not available: {0}")]
    Missing(String),
    #[error("NVRTC failed to compile `{kernel}` for {arch}:\n{log}\n--- source ---\n{code}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
        code: String,
    },
    #[error("NVRTC: {0}")]
    Api(String),
}

/// What ptxas reported for one kernel on one architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resources {
    pub arch: String,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    /// ptxas's warnings, and its notes of a performance loss, such as `wgmma` serialised
    /// because the compiler touched its registers in flight or met it on a path it cannot
    /// prove the whole warpgroup takes: correct code, lost overlap.
    pub warnings: Vec<String>,
}

/// The pip requirement of the NVRTC bbc installs where none is found.
pub const WHEEL: &str = "nvidia-cuda-nvrtc==13.5.37";

/// Where bbc installs [`WHEEL`] (`pip install --target`).
pub fn wheel_dir() -> PathBuf {
    crate::home::dir().join("cuda")
}

/// The directories searched for `libnvrtc.so.13` after the loader path, in order.
pub fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("BBC_NVRTC_DIR") {
        dirs.push(PathBuf::from(d));
    }
    dirs.push(wheel_dir().join("nvidia/cu13/lib"));
    let toolkits = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")]);
    for toolkit in toolkits {
        dirs.push(toolkit.join("lib64"));
        dirs.push(toolkit.join("targets/x86_64-linux/lib"));
        dirs.push(toolkit.join("targets/sbsa-linux/lib"));
    }
    dirs
}

/// Make NVRTC loadable: already on the loader path, or preloaded by full path (later loads by
/// soname then find it). Returns its version.
pub fn ensure_loaded() -> Result<(i32, i32), NvrtcError> {
    // SAFETY: probing for the library has no side effect beyond loading it.
    if !unsafe { sys::is_culib_present() } {
        let found = candidate_dirs()
            .into_iter()
            .map(|d| d.join("libnvrtc.so.13"))
            .find(|p| p.is_file());
        let Some(path) = found else {
            let searched: Vec<String> = candidate_dirs().iter().map(|d| d.display().to_string()).collect();
            return Err(NvrtcError::Missing(format!(
                "libnvrtc.so.13 is on neither the loader path nor in {}; install a CUDA 13 toolkit, or `pip install --target {} {WHEEL}`, or point BBC_NVRTC_DIR at the directory holding it",
                searched.join(", "),
                wheel_dir().display()
            )));
        };
        // SAFETY: loading NVRTC runs its initialisers, as any NVRTC user does. The handle is
        // leaked on purpose: the library stays loaded for the process.
        let lib = unsafe { libloading_open(&path) }.map_err(NvrtcError::Missing)?;
        std::mem::forget(lib);
        // SAFETY: as above.
        if !unsafe { sys::is_culib_present() } {
            return Err(NvrtcError::Missing(format!(
                "{} loaded but NVRTC is still not visible",
                path.display()
            )));
        }
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (checked above); the pointers are valid for the call.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| NvrtcError::Api(format!("{e:?}")))?;
    Ok((major, minor))
}

unsafe fn libloading_open(path: &std::path::Path) -> Result<libloading::Library, String> {
    // SAFETY: the caller accepts the library's initialisers running.
    unsafe { libloading::Library::new(path) }.map_err(|e| format!("{}: {e}", path.display()))
}

struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by create_program and is destroyed once.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn compile(kernel: &str, source: &str, options: &[String]) -> Result<(Program, String), NvrtcError> {
    let arch = options.first().cloned().unwrap_or_default();
    let src = CString::new(source).map_err(|e| NvrtcError::Api(e.to_string()))?;
    let name = CString::new(format!("{kernel}.cu")).map_err(|e| NvrtcError::Api(e.to_string()))?;
    let prog = Program(result::create_program(&src, Some(&name)).map_err(|e| NvrtcError::Api(format!("{e:?}")))?);
    // SAFETY: `prog` is a live program; options are plain strings.
    let compiled = unsafe { result::compile_program(prog.0, options) };
    // SAFETY: as above; the log exists after a compile attempt.
    let log = unsafe { result::get_program_log(prog.0) }
        .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>())
        .unwrap_or_default();
    let log = log.trim_end_matches('\0').to_string();
    match compiled {
        Ok(()) => Ok((prog, log)),
        Err(_) => Err(NvrtcError::Compile {
            kernel: kernel.into(),
            arch,
            log,
            code: source.into(),
        }),
    }
}

/// What one NVRTC compile for a real architecture gives: the machine code (a cubin), the PTX
/// it was assembled from (the same text a compile for the virtual architecture gives), and
/// what ptxas reported.
#[derive(Debug, Clone)]
pub struct MachineCode {
    pub cubin: Vec<u8>,
    pub ptx: String,
    /// `None` where ptxas's log held none even on a second try: the H200 run of 2026-11-30
    /// saw NVRTC 13.0 return an empty log once for a kernel that builds with a report
    /// elsewhere. The cubin is still good; only callers that check resources need the report.
    pub resources: Option<Resources>,
}

/// Machine code of `source` for the real architecture `arch` (a cubin, with its PTX), and what
/// ptxas reported, cached on disk. A cubin loads without the driver compiling anything, so it
/// also loads on a driver older than this NVRTC (within the CUDA major version), which
/// refuses its PTX.
pub fn compile_cubin(kernel: &str, source: &str, arch: &str) -> Result<MachineCode, NvrtcError> {
    let version = ensure_loaded()?;
    let options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-Xptxas=-v".to_string(),
    ];
    // Cached with ptxas's log, which the resources are read from; only with a report.
    let key = cache_key(source, &options, version);
    let hit = (|| {
        let cubin = cached(&key, "cubin")?;
        let ptx = String::from_utf8(cached(&key, "ptx")?).ok()?;
        let log = cached(&key, "ptxas")?;
        let resources = parse_resources(arch, std::str::from_utf8(&log).ok()?)?;
        Some(MachineCode {
            cubin,
            ptx,
            resources: Some(resources),
        })
    })();
    if let Some(code) = hit {
        return Ok(code);
    }
    let mut built = build_cubin(kernel, source, &options)?;
    if parse_resources(arch, &built.1).is_none() {
        built = build_cubin(kernel, source, &options)?;
    }
    let (code, log) = built;
    let resources = parse_resources(arch, &log);
    if resources.is_some() {
        // The log last: an entry counts only when every file is there.
        store(
            &key,
            &[
                ("cubin", &code.cubin),
                ("ptx", code.ptx.as_bytes()),
                ("ptxas", log.as_bytes()),
            ],
        );
    }
    Ok(MachineCode { resources, ..code })
}

/// One NVRTC compile to a cubin: the image and its PTX (no resources yet), and ptxas's log.
fn build_cubin(kernel: &str, source: &str, options: &[String]) -> Result<(MachineCode, String), NvrtcError> {
    let (prog, log) = compile(kernel, source, options)?;
    let mut size = 0usize;
    // SAFETY: the program compiled for a real architecture, so it holds a cubin; `size` is
    // valid for the call.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| NvrtcError::Api(format!("{e:?}")))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds the `size` bytes NVRTC said it needs.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| NvrtcError::Api(format!("{e:?}")))?;
    // SAFETY: the program compiled successfully.
    let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| NvrtcError::Api(format!("{e:?}")))?;
    let ptx = ptx
        .iter()
        .map(|&c| c as u8 as char)
        .collect::<String>()
        .trim_end_matches('\0')
        .to_string();
    let code = MachineCode {
        cubin,
        ptx,
        resources: None,
    };
    Ok((code, log))
}

/// From lines like `ptxas info : Used 16 registers, …` and `0 bytes spill stores, 0 bytes spill loads`.
pub fn parse_resources(arch: &str, log: &str) -> Option<Resources> {
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let registers = log.lines().find_map(|l| number_before(l, " registers"))?;
    let spills = log.lines().find(|l| l.contains("spill stores"))?;
    Some(Resources {
        arch: arch.into(),
        registers,
        spill_stores: number_before(spills, "bytes spill stores")?,
        spill_loads: number_before(spills, "bytes spill loads")?,
        warnings: log
            .lines()
            .filter(|l| l.starts_with("ptxas warning") || l.contains("Potential Performance Loss"))
            .map(str::to_string)
            .collect(),
    })
}

fn cache_key(source: &str, options: &[String], version: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for o in options {
        h.update(o.as_bytes());
        h.update([0]);
    }
    h.update(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The cached file `{key}.{ext}`, if there is one.
fn cached(key: &str, ext: &str) -> Option<Vec<u8>> {
    std::fs::read(cache_dir()?.join(format!("{key}.{ext}"))).ok()
}

/// Cache `files` (extension, bytes) under `key`, in order; best effort (a failed write only
/// costs a recompile later).
fn store(key: &str, files: &[(&str, &[u8])]) {
    if let Some(dir) = cache_dir() {
        let _ = std::fs::create_dir_all(&dir).and_then(|_| {
            files
                .iter()
                .try_for_each(|(ext, bytes)| std::fs::write(dir.join(format!("{key}.{ext}")), bytes))
        });
    }
}

fn cache_dir() -> Option<PathBuf> {
    Some(crate::home::dir().join("nvrtc-cache"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_ptxas_report() {
        let log = "ptxas info    : Compiling entry function 'k' for 'sm_90a'\nptxas info    : Function properties for k\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 16 registers, used 0 barriers, 360 bytes cmem[0]\nptxas warning : something slow\nptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized\n";
        assert_eq!(
            parse_resources("sm_90a", log),
            Some(Resources {
                arch: "sm_90a".into(),
                registers: 16,
                spill_stores: 0,
                spill_loads: 0,
                warnings: vec![
                    "ptxas warning : something slow".into(),
                    "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized"
                        .into()
                ],
            })
        );
        assert_eq!(parse_resources("sm_90a", "nothing"), None);
    }
}
